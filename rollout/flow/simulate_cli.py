"""`slipstream simulate`: the simulator's command line. The flow flags are derived from the FlowConfig
schema (`--prompts-per-step` for `prompts_per_step`, the type and choices from the field's annotation, the
help from its docstring), one for each knob a policy reads; the workload, hardware model and output flags
are the simulator's own. Flags override the `--config` file's [flow] section, which is validated like any
config. Left out: the controller's knobs (retries, timeouts, error budget), which the simulator does not model.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import sys
import typing
from typing import Literal

from common.config import Config, ConfigError, FlowConfig, field_docs, load_config, validate
from rollout.flow.policy import FlowPolicy
from rollout.flow.sim_report import ascii_timeline, compare_table, save_png
from rollout.flow.simulator import Costs, ThroughputModel, Workload, simulate
from rollout.flow.strategies import policy_from_config


def _policy_knobs() -> list[dataclasses.Field]:
    """The FlowConfig fields a policy reads, in schema order: its strategy and the knobs its constructor takes."""
    takes = inspect.signature(FlowPolicy.__init__).parameters
    return [f for f in dataclasses.fields(FlowConfig) if f.name == "strategy" or f.name in takes]


def _flow_args(parser: argparse.ArgumentParser) -> None:
    """A flag per policy knob (`--max-staleness`), typed by its FlowConfig annotation (bool: --x/--no-x,
    Literal: choices) and explained by its docstring; unset flags stay None and leave the config's value."""
    g = parser.add_argument_group("flow (default: the config's [flow] section, or FlowConfig defaults)")
    hints, docs = typing.get_type_hints(FlowConfig), field_docs(FlowConfig)
    for f in _policy_knobs():
        tp, flag, help_text = hints[f.name], "--" + f.name.replace("_", "-"), docs[f.name].replace("%", "%%")
        if tp is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        elif typing.get_origin(tp) is Literal:
            g.add_argument(flag, choices=typing.get_args(tp), help=help_text)
        elif tp in (int, float, str):
            g.add_argument(flag, type=tp, help=help_text)
        else:
            raise TypeError(f"flow.{f.name}: no command-line flag for a {tp!r} field; give it a type here")


def flow_from_args(args: argparse.Namespace) -> FlowConfig:
    """The flow section: from --config (or defaults), then the explicit flags; validated like a config."""
    cfg = load_config(args.config) if args.config else Config()
    flow = dataclasses.replace(
        cfg.flow,
        **{f.name: getattr(args, f.name) for f in _policy_knobs() if getattr(args, f.name) is not None},
    )
    validate(dataclasses.replace(cfg, flow=flow))
    return flow


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream simulate",
        description="Simulate a flow-control strategy in simulated time and print its schedule.",
    )
    p.add_argument("--config", help="TOML config whose [flow] section is used (flags override it)")
    _flow_args(p)
    w, m, c = Workload(), ThroughputModel(), Costs()
    g = p.add_argument_group("workload")
    g.add_argument("--steps", type=int, default=20, help="optimizer steps to simulate (default %(default)s)")
    g.add_argument(
        "--num-prompts",
        type=int,
        help="prompts in the data (default: steps * prompts_per_step; with dynamic sampling, as many as it takes)",
    )
    g.add_argument("--median-tokens", type=float, default=w.median_tokens, help="median sample length")
    g.add_argument("--sigma", type=float, default=w.sigma, help="lognormal sigma of sample lengths")
    g.add_argument("--prompt-sigma", type=float, default=w.prompt_sigma, help="lognormal sigma of prompt medians")
    g.add_argument("--prompt-tokens", type=int, default=w.prompt_tokens)
    g.add_argument("--max-tokens", type=int, default=w.max_tokens, help="cap of a sample's length")
    g.add_argument("--seed", type=int, default=w.seed)
    g.add_argument(
        "--uniform-group-rate",
        type=float,
        default=w.uniform_group_rate,
        help="fraction of prompts whose samples all get the same reward (default %(default)s: every group has "
        "signal); a run's 1 - rl/groups_used / prompts_per_step estimates it",
    )
    g = p.add_argument_group("hardware model")
    g.add_argument("--peak-tokens-per-s", type=float, default=m.peak_tokens_per_s)
    g.add_argument("--half-concurrency", type=float, default=m.half_concurrency)
    g.add_argument("--train-s-per-token", type=float, default=c.train_s_per_token)
    g.add_argument("--train-overhead-s", type=float, default=c.train_step_overhead_s)
    g.add_argument("--sync-s", type=float, default=c.sync_s)
    g = p.add_argument_group("output")
    g.add_argument("--width", type=int, default=100, help="columns of the ASCII timeline")
    g.add_argument("--png", help="write the timeline figure to this PNG file")
    g.add_argument("--compare", action="store_true", help="also run the other strategies and print a table")
    return p


def cli_main(argv: list[str]) -> int:
    """`slipstream simulate`: run the simulator; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        flow = flow_from_args(args)
        num_prompts = args.num_prompts
        if num_prompts is None and not flow.dynamic_sampling:
            num_prompts = args.steps * flow.prompts_per_step
        workload = Workload(
            num_prompts=num_prompts,
            median_tokens=args.median_tokens,
            sigma=args.sigma,
            prompt_sigma=args.prompt_sigma,
            prompt_tokens=args.prompt_tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
            uniform_group_rate=args.uniform_group_rate,
        )
        if not 0.0 <= args.uniform_group_rate <= 1.0:
            raise ValueError(f"--uniform-group-rate must be within [0, 1], got {args.uniform_group_rate}")
        model = ThroughputModel(args.peak_tokens_per_s, args.half_concurrency)
        costs = Costs(args.train_s_per_token, args.train_overhead_s, args.sync_s)
        strategies = [flow.strategy]
        if args.compare:
            strategies += [s for s in ("on_policy", "one_step_off", "fully_async") if s != flow.strategy]
        results = []
        for strategy in strategies:
            policy = policy_from_config(
                dataclasses.replace(flow, strategy=strategy), num_prompts=num_prompts, max_steps=args.steps
            )
            results.append(simulate(policy, workload, model, costs))
    except (ConfigError, ValueError) as exc:
        print(f"slipstream simulate: {exc}", file=sys.stderr)
        return 2
    for r in results:
        print(r.summary())
        print(ascii_timeline(r, args.width))
        print()
    if args.compare:
        base = next(r for r in results if r.strategy == "on_policy")
        print(compare_table([(r.strategy, r) for r in results], base))
    if args.png:
        save_png(results, args.png)
        print(f"timeline written to {args.png}")
    return 0


if __name__ == "__main__":  # pragma: no cover - `slipstream simulate` is the entry point
    raise SystemExit(cli_main(sys.argv[1:]))
