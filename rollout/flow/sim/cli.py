"""`slipstream simulate`: the simulator's command line. Modes: by default, simulate the config's strategy (and
with `--strategies`, others beside it in a table) and print the schedule; `--calibrate RUN_DIR` fits the timing
model to a run's metrics and writes it (calibrate.py); `--compare RUN_DIR` replays the run's config with that
model and sets the prediction beside the measurement (compare.py); `--sweep KEY=V1,V2,...` runs a grid of
settings and recommends one (sweep.py). Inputs are layers, each over the one before: built-in defaults; the
whole config (`--config`, or the compared run's config.toml): its [flow] section, its trainer.steps and seed, and
the workload its rollout section implies (`task_workload`); the compared run's measurements (its completion
lengths, prompt tokens and steps); the timing model file (`--model`), with its episode model (turns per
episode, tool calls), whose turns histogram the compared run's own replaces (turns, like lengths, are the
workload's); then the flags. The flow flags are
derived from the FlowConfig schema (`--prompts-per-step` for `prompts_per_step`, the type and choices from the
field's annotation, the help from its docstring), one for each knob a policy reads. Left out: the controller's
knobs (retries, timeouts, error budget), which the simulator does not model.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from common.config import Config, ConfigError, FlowConfig, field_docs, load_config, parse_value, validate
from rollout.flow.policy import FlowPolicy
from rollout.flow.sim.calibrate import (
    MODEL_FILE,
    CalibrationError,
    RunMetrics,
    SimModel,
    calibrate,
    describe,
    describe_episodes,
    load_model,
    read_run,
    save_model,
    turns_histogram,
)
from rollout.flow.sim.compare import comparison_table, measured_result
from rollout.flow.sim.report import SimResult, ascii_timeline, compare_table, save_png
from rollout.flow.sim.simulator import Costs, EpisodeModel, ThroughputModel, Workload, simulate
from rollout.flow.sim.sweep import Setting, parse_axes, recommend, run_sweep, save_sweep_png, sweep_table
from rollout.flow.strategies import STRATEGIES, policy_from_config

LOGNORMAL = ("median_tokens", "sigma", "prompt_sigma")
THROUGHPUT = ("peak_tokens_per_s", "half_concurrency", "latency_s", "workers")
COSTS = ("train_s_per_token", "train_step_overhead_s", "sync_s", "pause_s")
EPISODES = ("tool_s", "tool_sd", "env_tokens")


def _policy_knobs() -> list[dataclasses.Field]:
    """The FlowConfig fields a policy reads, in schema order: its strategy and its knobs."""
    return [f for f in dataclasses.fields(FlowConfig) if f.name == "strategy" or f.name in FlowPolicy.KNOBS]


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


def _config(args: argparse.Namespace, path: str | Path | None) -> Config:
    """The config at `path` (or the defaults) with the explicit flow flags over its [flow]; validated."""
    cfg = load_config(path) if path else Config()
    knobs = {f.name: getattr(args, f.name) for f in _policy_knobs() if getattr(args, f.name) is not None}
    cfg = dataclasses.replace(cfg, flow=dataclasses.replace(cfg.flow, **knobs))
    validate(cfg)
    return cfg


def task_workload(cfg: Config) -> dict[str, Any]:
    """The Workload fields a config implies: rollout.max_tokens caps completions, and for the arithmetic task
    the first 1000 problems give the lengths: a prompt is its expression and "=", a completion the answer and
    an end-of-sequence token (what the warm start teaches), a character a token (the tiny tokenizer's rule,
    and that of tokenizers that split digits). Other tasks leave the lengths to the flags."""
    fields: dict[str, Any] = {"max_tokens": cfg.rollout.max_tokens, "seed": cfg.run.seed}
    if cfg.rollout.task.kind == "arithmetic":
        from rollout.tasks.arithmetic import ArithmeticTask

        task = ArithmeticTask.from_config(cfg.rollout.task)
        problems = [task.problem(i) for i in range(min(1000, len(task)))]
        fields["prompt_tokens"] = round(sum(len(p.prompt) for p in problems) / len(problems))
        fields["lengths"] = tuple(min(cfg.rollout.max_tokens, len(p.answer) + 1) for p in problems)
    return fields


def run_workload(run: RunMetrics, cfg: Config) -> dict[str, Any]:
    """The Workload fields a run measured: its completion lengths, its mean prompt tokens and, with dynamic
    sampling, the share of groups it dropped."""
    fields: dict[str, Any] = {"lengths": tuple(s.output_tokens for s in run.samples)}
    prompts = [s.prompt_tokens for s in run.samples if not math.isnan(s.prompt_tokens)]
    if prompts:
        fields["prompt_tokens"] = round(sum(prompts) / len(prompts))
    c = run.counters
    if c is not None and cfg.flow.dynamic_sampling and c.trained_prompts + c.dropped_groups:
        fields["uniform_group_rate"] = c.dropped_groups / (c.trained_prompts + c.dropped_groups)
    return fields


@dataclass
class Inputs:
    """One simulation's inputs, resolved from the layers; `simulate` runs a flow (the config's by default)."""

    cfg: Config
    steps: int
    num_prompts: int | None  # None: steps * prompts_per_step, or as many as dynamic sampling takes
    workload: Workload
    throughput: ThroughputModel
    costs: Costs
    episodes: EpisodeModel = dataclasses.field(default_factory=EpisodeModel)

    def simulate(self, flow: FlowConfig | None = None, throughput: ThroughputModel | None = None) -> SimResult:
        flow = flow or self.cfg.flow
        num_prompts = self.num_prompts
        if num_prompts is None and not flow.dynamic_sampling:
            num_prompts = self.steps * flow.prompts_per_step
        workload = dataclasses.replace(self.workload, num_prompts=num_prompts)
        policy = policy_from_config(flow, num_prompts=num_prompts, max_steps=self.steps)
        return simulate(policy, workload, throughput or self.throughput, self.costs, episodes=self.episodes)

    def describe(self) -> str:
        w, m, c = self.workload, self.throughput, self.costs
        if w.lengths:
            capped = [min(n, w.max_tokens) for n in w.lengths]
            lengths = f"drawn from {len(capped)} lengths (mean {sum(capped) / len(capped):.1f}, max {max(capped)})"
        else:
            lengths = f"lognormal (median {w.median_tokens:g}, sigma {w.sigma:g}) capped at {w.max_tokens}"
        text = (
            f"workload: {self.steps} steps; completions {lengths}; prompts {w.prompt_tokens} tokens\n"
            f"model: {m.workers} worker(s), peak {m.peak_tokens_per_s:.4g} tokens/s, half {m.half_concurrency:.3g}, "
            f"latency {m.latency_s * 1e3:.3g} ms; train {c.train_step_overhead_s:.3g} s + "
            f"{c.train_s_per_token:.3g} s/token; publish {c.sync_s:.3g} s (pause {c.publish_pause_s:.3g} s)"
        )
        return text + "\n" + describe_episodes(self.episodes) if self.episodes.multi_turn else text


def load_inputs(
    args: argparse.Namespace, config: str | Path | None, run: RunMetrics | None, model: SimModel | None
) -> Inputs:
    """The layers: defaults, the config, the run's measurements, the model file, the flags."""
    cfg = _config(args, config)
    layers = (args.steps, len(run.steps) if run else None, cfg.trainer.steps if config else None, 20)
    steps = next(s for s in layers if s is not None)
    fields: dict[str, Any] = {}
    if config:
        fields |= task_workload(cfg)
    if run is not None:
        fields |= run_workload(run, cfg)
    given = {
        k: v for k, v in vars(args).items() if k in {f.name for f in dataclasses.fields(Workload)} and v is not None
    }
    if any(k in given for k in LOGNORMAL):
        fields["lengths"] = ()  # the flags ask for the lognormal
    workload = Workload(**(fields | given))
    if not 0.0 <= workload.uniform_group_rate <= 1.0:
        raise ValueError(f"--uniform-group-rate must be within [0, 1], got {workload.uniform_group_rate}")
    throughput = model.throughput if model else ThroughputModel()
    throughput = dataclasses.replace(
        throughput, **{k: getattr(args, k) for k in THROUGHPUT if getattr(args, k) is not None}
    )
    costs = model.costs if model else Costs()
    costs = dataclasses.replace(costs, **{k: getattr(args, k) for k in COSTS if getattr(args, k) is not None})
    episodes = model.episodes if model else EpisodeModel()
    if run is not None:
        episodes = dataclasses.replace(episodes, turns=turns_histogram(run.samples))
    if args.turns is not None:
        if args.turns < 1:
            raise ValueError(f"--turns {args.turns}: an episode has at least one turn")
        episodes = dataclasses.replace(episodes, turns={args.turns: 1})
    given = {k: getattr(args, k) for k in EPISODES if getattr(args, k) is not None}
    for k, v in given.items():
        if v < 0:
            raise ValueError(f"--{k.replace('_', '-')} {v}: it must be >= 0")
    episodes = dataclasses.replace(episodes, **given)
    return Inputs(cfg, steps, args.num_prompts, workload, throughput, costs, episodes)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream simulate",
        description="Simulate flow-control strategies in simulated time; calibrate the model to a run, compare "
        "a run with its prediction, sweep settings.",
    )
    p.add_argument("--config", help="TOML config: its [flow], trainer.steps, seed and the workload its rollout implies")
    _flow_args(p)
    w, m, c = Workload(), ThroughputModel(), Costs()
    g = p.add_argument_group("workload (default: from --config or the compared run, else the values shown)")
    g.add_argument("--steps", type=int, help="optimizer steps (default: the run's, trainer.steps, else 20)")
    g.add_argument(
        "--num-prompts",
        type=int,
        help="prompts in the data (default: steps * prompts_per_step; with dynamic sampling, as many as it takes)",
    )
    g.add_argument(
        "--median-tokens", type=float, help=f"median completion length, lognormal (default {w.median_tokens:g})"
    )
    g.add_argument("--sigma", type=float, help=f"lognormal sigma of completion lengths (default {w.sigma:g})")
    g.add_argument("--prompt-sigma", type=float, help=f"lognormal sigma of prompt medians (default {w.prompt_sigma:g})")
    g.add_argument("--prompt-tokens", type=int, help=f"prompt length (default {w.prompt_tokens})")
    g.add_argument("--max-tokens", type=int, help=f"cap of a completion's length (default {w.max_tokens})")
    g.add_argument("--seed", type=int, help=f"seed of the lengths and rewards (default {w.seed})")
    g.add_argument(
        "--uniform-group-rate",
        type=float,
        help="fraction of prompts whose samples all get the same reward (default 0: every group has signal); a "
        "run's 1 - rl/groups_used / prompts_per_step estimates it",
    )
    g = p.add_argument_group("timing model (default: --model FILE, else the values shown; a flag overrides the file)")
    g.add_argument("--model", help=f"timing model file from --calibrate (--compare RUN_DIR: RUN_DIR/{MODEL_FILE})")
    g.add_argument("--peak-tokens-per-s", type=float, help=f"one worker's peak throughput ({m.peak_tokens_per_s:g})")
    g.add_argument("--half-concurrency", type=float, help=f"requests at half the peak ({m.half_concurrency:g})")
    g.add_argument("--latency-s", type=float, help=f"a request's time before its first token ({m.latency_s:g})")
    g.add_argument("--workers", type=int, help=f"generator workers, least-outstanding routing ({m.workers})")
    g.add_argument("--train-s-per-token", type=float, help=f"train time per token ({c.train_s_per_token:g})")
    g.add_argument(
        "--train-overhead-s",
        dest="train_step_overhead_s",
        type=float,
        help=f"a train step's time besides its tokens ({c.train_step_overhead_s:g})",
    )
    g.add_argument("--sync-s", type=float, help=f"a publish's time on the trainer ({c.sync_s:g})")
    g.add_argument("--pause-s", type=float, help="generation pause at the end of a publish (default: all of it)")
    g.add_argument(
        "--turns",
        type=int,
        help="turns (generation requests) of every episode (default: the model's histogram, else 1)",
    )
    g.add_argument("--tool-s", type=float, help="mean seconds of a tool call between two turns (default 0)")
    g.add_argument("--tool-sd", type=float, help="standard deviation of a tool call's seconds (default 0)")
    g.add_argument(
        "--env-tokens", type=float, help="tokens a tool call appends, which the trainer trains on (default 0)"
    )
    g = p.add_argument_group("modes (default: simulate and print the schedule)")
    modes = g.add_mutually_exclusive_group()
    modes.add_argument("--strategies", help="also simulate these strategies (comma-separated, or all) and tabulate")
    modes.add_argument(
        "--calibrate", metavar="RUN_DIR", help=f"fit the timing model to a run; writes RUN_DIR/{MODEL_FILE}"
    )
    modes.add_argument(
        "--compare", metavar="RUN_DIR", help="replay a run's config with the model; predicted vs measured"
    )
    modes.add_argument(
        "--sweep", metavar="KEY=V1,V2", action="append", help="sweep workers or a flow knob (repeatable: the grid)"
    )
    g = p.add_argument_group("output")
    g.add_argument("--width", type=int, default=100, help="columns of the ASCII timeline")
    g.add_argument(
        "--png", help="figure file (default: none; --compare: RUN_DIR/sim_compare.png; --sweep: sim_sweep.png)"
    )
    g.add_argument("--out", help=f"--calibrate: the model file to write (default RUN_DIR/{MODEL_FILE})")
    g.add_argument(
        "--max-mean-staleness",
        type=float,
        default=1.0,
        help="--sweep recommends the most samples/s with mean staleness within this (default %(default)s)",
    )
    return p


def cli_main(argv: list[str]) -> int:
    """`slipstream simulate`: run the simulator; returns the process exit code."""
    args = build_parser().parse_args(argv)
    try:
        if args.out and not args.calibrate:
            raise ValueError("--out names the model file --calibrate writes; give it with --calibrate RUN_DIR")
        if args.calibrate:
            return _calibrate(args)
        if args.compare:
            return _compare(args)
        inputs = load_inputs(args, args.config, None, load_model(args.model) if args.model else None)
        return _sweep(args, inputs) if args.sweep else _simulate(args, inputs)
    except (ConfigError, ValueError) as exc:  # CalibrationError is a ValueError
        print(f"slipstream simulate: {exc}", file=sys.stderr)
        return 2


def _simulate(args: argparse.Namespace, inputs: Inputs) -> int:
    flow = inputs.cfg.flow
    strategies = [flow.strategy]
    if args.strategies:
        names = list(STRATEGIES) if args.strategies == "all" else args.strategies.split(",")
        hint = typing.get_type_hints(FlowConfig)["strategy"]
        asked = [parse_value(name.strip(), hint, "--strategies") for name in names]
        strategies += [s for s in asked if s not in strategies]
    results = [inputs.simulate(dataclasses.replace(flow, strategy=s)) for s in strategies]
    print(inputs.describe() + "\n")
    for r in results:
        print(r.summary())
        print(ascii_timeline(r, args.width))
        print()
    if len(results) > 1:
        base = next((r for r in results if r.strategy == "on_policy"), results[0])
        print(compare_table([(r.strategy, r) for r in results], base))
    if args.png:
        save_png(results, args.png)
        print(f"timeline written to {args.png}")
    return 0


def _calibrate(args: argparse.Namespace) -> int:
    run = read_run(args.calibrate)
    model = calibrate(run)
    out = args.out or str(Path(args.calibrate) / MODEL_FILE)
    save_model(model, out)
    print(describe(model))
    print(f"model written to {out}")
    return 0


def _compare(args: argparse.Namespace) -> int:
    run_dir = Path(args.compare)
    run = read_run(run_dir)
    config = args.config or run_dir / "config.toml"
    if not Path(config).is_file():
        raise CalibrationError(f"{run_dir} has no config.toml; pass the run's config with --config FILE")
    inputs = load_inputs(args, config, run, load_model(args.model or run_dir / MODEL_FILE, run_dir))
    ran = load_config(config).flow
    measured = measured_result(run, ran, inputs.throughput)
    predicted = inputs.simulate()
    print(inputs.describe() + "\n")
    print(f"{run_dir}: {ran.strategy}, {len(run.steps)} steps, measured against predicted")
    changed = [f"{k} = {v!r}" for k, v in vars(inputs.cfg.flow).items() if getattr(ran, k) != v]
    if changed:
        print(f"(predicted with the flags' flow: {', '.join(changed)})")
    print(comparison_table(measured, predicted))
    png = args.png or str(run_dir / "sim_compare.png")
    save_png([measured, predicted], png, f"{run_dir}: measured and predicted", ["measured", "predicted"])
    print(f"figure written to {png}")
    return 0


def _sweep(args: argparse.Namespace, inputs: Inputs) -> int:
    axes = parse_axes(args.sweep, [f.name for f in _policy_knobs()])

    def run_one(setting: Setting) -> SimResult:
        knobs = {k: v for k, v in setting.items() if k != "workers"}
        cfg = dataclasses.replace(inputs.cfg, flow=dataclasses.replace(inputs.cfg.flow, **knobs))
        validate(cfg)
        workers = setting.get("workers", inputs.throughput.workers)
        return inputs.simulate(cfg.flow, dataclasses.replace(inputs.throughput, workers=workers))

    rows = run_sweep(axes, run_one)
    best = recommend(rows, args.max_mean_staleness)
    print(inputs.describe() + "\n")
    print(sweep_table(rows, best, args.max_mean_staleness))
    png = args.png or "sim_sweep.png"
    save_sweep_png(rows, best, args.max_mean_staleness, png)
    print(f"figure written to {png}")
    return 0


if __name__ == "__main__":  # pragma: no cover - `slipstream simulate` is the entry point
    raise SystemExit(cli_main(sys.argv[1:]))
