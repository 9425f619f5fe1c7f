"""The flow-control simulator: drives the same policy objects as the runtime (rollout/flow/policy.py)
through a discrete-event model of one generator pool and one trainer, in simulated time. Generation
is processor sharing: every in-flight request advances at `tokens_per_s(c) / c` tokens per second when
`c` requests are in flight (so the pool's throughput depends on concurrency), a publish pauses the pool
for the weight-sync time (keep mode: requests resume afterwards) and bumps its version, and a train
step occupies the trainer for `overhead + s_per_token * tokens`. Sample lengths come from a seeded
per-(prompt, sample, attempt) lognormal distribution, so a run is reproducible and a re-generated
sample draws a new length. Rewards are modelled only as far as dynamic sampling needs them: a seeded
fraction `uniform_group_rate` of prompts gets the same reward on every sample (a group with no
signal, which dynamic sampling drops and replaces), the others a spread of rewards. It reports
makespan, utilisations, throughput, the staleness histogram, dropped samples and groups, and renders
the schedule as ASCII and as a PNG. `cli_main` is `slipstream simulate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from common.config import Config, ConfigError, FlowConfig, load_config, validate
from rollout.flow.policy import (
    Abort,
    Action,
    Dispatch,
    Finish,
    FlowCounters,
    FlowPolicy,
    Publish,
    SampleDone,
    SampleKey,
    Train,
)


class SimulationError(RuntimeError):
    """The policy and the model reached a state with nothing left to happen (a policy bug)."""


# ----------------------------------------------------------------------------------------------
# Model inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The prompts and the lengths of their samples (seeded, lognormal with a cap like max_tokens), and
    which prompts' groups have zero reward variance (seeded, `uniform_group_rate` of them)."""

    num_prompts: int | None = 1280  # None: as many as the run asks for
    median_tokens: float = 1024.0
    sigma: float = 1.0
    prompt_sigma: float = 0.0
    prompt_tokens: int = 512
    max_tokens: int = 16384
    seed: int = 0
    uniform_group_rate: float = 0.0

    def reward(self, prompt_id: int, index: int) -> float:
        """A sample's reward: 0 on every sample of a uniform prompt (too hard or, alike for dynamic
        sampling, too easy), else alternating 0 and 1 over the group, so the group has signal. Per
        prompt, so a re-generated sample keeps its group's kind."""
        if random.Random(f"{self.seed}:uniform:{prompt_id}").random() < self.uniform_group_rate:
            return 0.0
        return float(index % 2)

    def tokens(self, prompt_id: int, index: int, attempt: int) -> int:
        """Generated tokens of one sample; `prompt_sigma` spreads the per-prompt median (hard prompts
        make every sample of their group long), `sigma` spreads the samples of one prompt."""
        median = self.median_tokens
        if self.prompt_sigma > 0:
            median *= math.exp(random.Random(f"{self.seed}:prompt:{prompt_id}").gauss(0.0, self.prompt_sigma))
        rng = random.Random(f"{self.seed}:{prompt_id}:{index}:{attempt}")
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(median), self.sigma))))


@dataclass
class ThroughputModel:
    """Generator pool throughput as a function of concurrency: tokens_per_s(c) = peak * c / (c + half).
    Decoding is memory-bound at low concurrency (one sequence gets peak / (1 + half) tokens/s) and
    saturates towards `peak_tokens_per_s` as the batch grows."""

    peak_tokens_per_s: float = 16000.0
    half_concurrency: float = 128.0

    def tokens_per_s(self, concurrency: int) -> float:
        return self.peak_tokens_per_s * concurrency / (concurrency + self.half_concurrency)

    def per_request(self, concurrency: int) -> float:
        return self.peak_tokens_per_s / (concurrency + self.half_concurrency)


@dataclass
class Costs:
    """Trainer costs: a step is `train_step_overhead_s + train_s_per_token * tokens` (prompt plus
    completion tokens of its samples); a publish takes `sync_s` on the trainer and pauses the pool."""

    train_s_per_token: float = 5e-5
    train_step_overhead_s: float = 2.0
    sync_s: float = 5.0

    def train_s(self, tokens: int) -> float:
        return self.train_step_overhead_s + self.train_s_per_token * tokens


# ----------------------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------------------


@dataclass
class StepRecord:
    """One optimizer step: when it ran, on which groups, how many tokens."""

    step: int
    start: float
    end: float
    prompt_ids: tuple[int, ...]
    tokens: int


@dataclass
class Span:
    """A trainer activity: `kind` is "train" (label = step) or "sync" (label = version)."""

    start: float
    end: float
    kind: str
    label: int


@dataclass
class TracePoint:
    """The generator pool from time `t` on: requests in flight, weight version, paused or not."""

    t: float
    concurrency: int
    version: int
    paused: bool


@dataclass
class SimResult:
    """Everything a simulated run produced."""

    strategy: str
    max_concurrent: int
    makespan: float
    steps: list[StepRecord]
    spans: list[Span]
    trace: list[TracePoint]
    counters: FlowCounters
    generated_tokens: float
    trained_completion_tokens: int
    generator_busy_s: float
    peak_tokens_per_s: float
    finish_reason: str

    @property
    def trainer_utilisation(self) -> float:
        """Fraction of the run the trainer is busy (train steps and weight syncs)."""
        return sum(s.end - s.start for s in self.spans) / self.makespan if self.makespan else 0.0

    @property
    def generator_utilisation(self) -> float:
        """Tokens generated over what the pool could generate at `max_concurrent` for the whole run."""
        return self.generated_tokens / (self.peak_tokens_per_s * self.makespan) if self.makespan else 0.0

    @property
    def generator_busy(self) -> float:
        """Fraction of the run with at least one request generating."""
        return self.generator_busy_s / self.makespan if self.makespan else 0.0

    @property
    def samples_per_s(self) -> float:
        """Trained samples per second of the run."""
        return self.counters.trained_samples / self.makespan if self.makespan else 0.0

    @property
    def wasted_fraction(self) -> float:
        """Generated tokens that were never trained on (stale, dropped, aborted or left in flight)."""
        if not self.generated_tokens:
            return 0.0
        return max(0.0, 1.0 - self.trained_completion_tokens / self.generated_tokens)

    def summary(self) -> str:
        c = self.counters
        hist = ", ".join(f"{k}: {v}" for k, v in sorted(c.staleness.items()))
        return "\n".join(
            [
                f"strategy {self.strategy}: {len(self.steps)} steps, {c.trained_samples} samples, finished by "
                f"{self.finish_reason}",
                f"makespan {self.makespan:.1f} s, {self.samples_per_s:.3f} samples/s, "
                f"{self.makespan / max(1, len(self.steps)):.1f} s/step",
                f"trainer utilisation {self.trainer_utilisation:.0%}, generator utilisation "
                f"{self.generator_utilisation:.0%} (busy {self.generator_busy:.0%}), wasted tokens "
                f"{self.wasted_fraction:.1%}",
                f"staleness histogram {{{hist}}}; stale samples {c.stale_samples}, requeued {c.requeued_samples}, "
                f"dropped {c.dropped_samples} samples ({c.dropped_prompts} prompts), aborted {c.aborted_samples}",
                f"dynamic sampling dropped {c.dropped_groups} zero-variance groups; generated "
                f"{self.generated_tokens:.0f} tokens, trained {self.trained_completion_tokens}",
            ]
        )


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class GeneratorPool:
    """The generator model: a processor-sharing pool. All in-flight requests advance equally, so a
    request is done when the pool's cumulative per-request service `level` passes its start level plus
    its length: completions are a heap on that finish level, O(log n) per event. Time is whatever the
    caller passes to `advance` (simulated seconds here; scaled wall-clock seconds in a fake backend)."""

    def __init__(self, model: ThroughputModel) -> None:
        self.model = model
        self.t = 0.0
        self.level = 0.0
        self.version = 0
        self.paused = False
        self.active: dict[SampleKey, tuple[float, int, int]] = {}  # -> (finish level, oldest version, seq)
        self.heap: list[tuple[float, int, SampleKey]] = []
        self.seq = 0
        self.generated = 0.0
        self.busy_s = 0.0

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0 and self.active and not self.paused:
            c = len(self.active)
            self.level += self.model.per_request(c) * dt
            self.generated += self.model.tokens_per_s(c) * dt
            self.busy_s += dt
        self.t = max(self.t, now)

    def add(self, key: SampleKey, tokens: int) -> None:
        self.seq += 1
        finish = self.level + tokens
        self.active[key] = (finish, self.version, self.seq)
        heapq.heappush(self.heap, (finish, self.seq, key))

    def remove(self, key: SampleKey) -> None:
        del self.active[key]  # its heap entry is skipped lazily

    def _top(self) -> tuple[float, int, SampleKey] | None:
        while self.heap:
            finish, seq, key = self.heap[0]
            entry = self.active.get(key)
            if entry is not None and entry[2] == seq:
                return self.heap[0]
            heapq.heappop(self.heap)
        return None

    def next_time(self) -> float:
        top = self._top()
        if top is None or self.paused:
            return math.inf
        return self.t + max(0.0, top[0] - self.level) / self.model.per_request(len(self.active))

    def pop_finished(self) -> list[tuple[SampleKey, int]]:
        """(key, oldest version) of every request whose finish level is reached, in finish order."""
        out = []
        eps = 1e-9 * max(1.0, self.level)
        while (top := self._top()) is not None and top[0] <= self.level + eps:
            heapq.heappop(self.heap)
            key = top[2]
            out.append((key, self.active.pop(key)[1]))
        return out


def simulate(
    policy: FlowPolicy,
    workload: Workload,
    throughput: ThroughputModel,
    costs: Costs,
    *,
    max_events: int = 50_000_000,
) -> SimResult:
    """Run `policy` to its Finish against the model; deterministic for given inputs."""
    pool = GeneratorPool(throughput)
    spp = policy.samples_per_prompt
    attempts: dict[SampleKey, int] = {}
    lengths: dict[SampleKey, int] = {}
    steps: list[StepRecord] = []
    spans: list[Span] = []
    trace: list[TracePoint] = [TracePoint(0.0, 0, 0, False)]
    job: Train | Publish | None = None
    job_end = math.inf
    finish: Finish | None = None
    trained_completion_tokens = 0

    def mark() -> None:
        point = TracePoint(pool.t, len(pool.active), pool.version, pool.paused)
        last = trace[-1]
        if (last.concurrency, last.version, last.paused) == (point.concurrency, point.version, point.paused):
            return
        if last.t == point.t:
            trace[-1] = point
        else:
            trace.append(point)

    def apply(actions: list[Action]) -> None:
        nonlocal job, job_end, finish, trained_completion_tokens
        for a in actions:
            if isinstance(a, Dispatch):
                if pool.paused:
                    raise SimulationError(f"{policy.strategy} dispatched {a} during a weight sync")
                for s in a.samples:
                    key = (a.prompt_id, s)
                    n = attempts.get(key, 0)
                    attempts[key] = n + 1
                    lengths[key] = workload.tokens(a.prompt_id, s, n)
                    pool.add(key, lengths[key])
            elif isinstance(a, Abort):
                for key in a.keys:
                    pool.remove(key)
            elif isinstance(a, Train):
                completion = sum(lengths[(p, s)] for p in a.prompt_ids for s in range(spp))
                tokens = completion + workload.prompt_tokens * spp * len(a.prompt_ids)
                trained_completion_tokens += completion
                job, job_end = a, pool.t + costs.train_s(tokens)
                steps.append(StepRecord(a.step, pool.t, job_end, a.prompt_ids, tokens))
                spans.append(Span(pool.t, job_end, "train", a.step))
            elif isinstance(a, Publish):
                job, job_end = a, pool.t + costs.sync_s
                pool.paused = True
                spans.append(Span(pool.t, job_end, "sync", a.version))
            elif isinstance(a, Finish):
                finish = a
        mark()

    apply(policy.start())
    for _ in range(max_events):
        if finish is not None:
            break
        t_gen = pool.next_time()
        if t_gen == math.inf and job_end == math.inf:
            raise SimulationError(f"{policy.strategy}: nothing in flight and no trainer job at t={pool.t:.1f}s")
        if t_gen <= job_end:
            pool.advance(t_gen)
            for (p, s), oldest in pool.pop_finished():
                apply(policy.on_sample_done(SampleDone(p, s, oldest, pool.version, workload.reward(p, s))))
        else:
            pool.advance(job_end)
            ended, job, job_end = job, None, math.inf
            if isinstance(ended, Train):
                apply(policy.on_train_done(ended.step))
            else:
                pool.version = ended.version
                pool.paused = False
                apply(policy.on_published(ended.version))
    else:
        raise SimulationError(f"{policy.strategy}: no Finish after {max_events} events")
    return SimResult(
        strategy=policy.strategy,
        max_concurrent=policy.max_concurrent,
        makespan=pool.t,
        steps=steps,
        spans=spans,
        trace=trace,
        counters=policy.counters,
        generated_tokens=pool.generated,
        trained_completion_tokens=trained_completion_tokens,
        generator_busy_s=pool.busy_s,
        peak_tokens_per_s=throughput.tokens_per_s(policy.max_concurrent),
        finish_reason=finish.reason,
    )


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------

_RAMP = " .:-=+*#%@"


def ascii_timeline(result: SimResult, width: int = 100) -> str:
    """Three rows over time: the trainer (step number mod 10 while training, '^' while syncing, '.'
    idle), the generator's mean concurrency relative to max_concurrent (' ' to '@', 'p' paused) and
    the generators' weight version (mod 10)."""
    width = max(10, width)
    dt = result.makespan / width if result.makespan else 1.0
    trainer, gen, ver = [], [], []
    spans = result.spans
    trace = result.trace + [TracePoint(result.makespan, 0, result.trace[-1].version, False)]
    si = ti = 0
    for col in range(width):
        lo, hi = col * dt, (col + 1) * dt
        best, best_overlap = ".", 0.0
        while si < len(spans) and spans[si].end <= lo:
            si += 1
        for span in spans[si:]:
            if span.start >= hi:
                break
            overlap = min(hi, span.end) - max(lo, span.start)
            if overlap > best_overlap:
                best_overlap = overlap
                best = str(span.label % 10) if span.kind == "train" else "^"
        trainer.append(best if best_overlap >= dt / 2 else ".")
        while ti + 1 < len(trace) and trace[ti + 1].t <= lo:
            ti += 1
        area = paused = 0.0
        j = ti
        while j + 1 < len(trace) and trace[j].t < hi:
            a, b = max(lo, trace[j].t), min(hi, trace[j + 1].t)
            if b > a:
                area += trace[j].concurrency * (b - a)
                paused += (b - a) if trace[j].paused else 0.0
            j += 1
        if paused >= dt / 2:
            gen.append("p")
        else:
            frac = area / dt / max(1, result.max_concurrent)
            gen.append(_RAMP[min(len(_RAMP) - 1, math.ceil(frac * (len(_RAMP) - 1)))])
        ver.append(str(trace[max(0, j - 1)].version % 10))
    scale = f"0 s{' ' * (width - 3 - len(f'{result.makespan:.0f} s'))}{result.makespan:.0f} s"
    return "\n".join(
        [
            f"{result.strategy} timeline ({dt:.1f} s per column)",
            f"trainer   |{''.join(trainer)}|",
            f"generator |{''.join(gen)}|",
            f"version   |{''.join(ver)}|",
            f"           {scale}",
        ]
    )


def save_png(results: Sequence[SimResult], path: str, title: str = "", labels: Sequence[str] | None = None) -> None:
    """One panel per result (generator concurrency over time above, trainer activity below), plus the
    staleness histograms; written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    names = list(labels) if labels is not None else [r.strategy for r in results]
    fig, axes = plt.subplots(n + 1, 1, figsize=(12, 2.2 * n + 2.6), squeeze=False)
    horizon = max(r.makespan for r in results)
    for ax, r, name in zip(axes[:-1, 0], results, names, strict=True):
        ts = [p.t for p in r.trace] + [r.makespan]
        conc = [p.concurrency / r.max_concurrent for p in r.trace] + [0.0]
        ax.fill_between(ts, [1.0 + c for c in conc], 1.0, step="post", color="tab:green", alpha=0.6, lw=0)
        for p, q in zip(r.trace, r.trace[1:] + [TracePoint(r.makespan, 0, 0, False)], strict=True):
            if p.paused:
                ax.axvspan(p.t, q.t, ymin=0.5, ymax=1.0, color="tab:red", alpha=0.3, lw=0)
        train = [(s.start, s.end - s.start) for s in r.spans if s.kind == "train"]
        sync = [(s.start, s.end - s.start) for s in r.spans if s.kind == "sync"]
        ax.broken_barh(train, (0.1, 0.8), color="tab:blue")
        ax.broken_barh(sync, (0.1, 0.8), color="tab:orange")
        ax.set_xlim(0, horizon)
        ax.set_ylim(0, 2.05)
        ax.set_yticks([0.5, 1.5], ["trainer", "generator"])
        ax.set_title(
            f"{name}: {r.samples_per_s:.2f} samples/s, trainer {r.trainer_utilisation:.0%}, "
            f"generator {r.generator_utilisation:.0%}",
            fontsize=9,
            loc="left",
        )
    axes[-2, 0].set_xlabel("time (s); green: requests in flight / max_concurrent; blue: train; orange: sync")
    hist_ax = axes[-1, 0]
    width = 0.8 / n
    for i, r in enumerate(results):
        total = max(1, sum(r.counters.staleness.values()))
        ks = sorted(r.counters.staleness)
        offset = (i - (n - 1) / 2) * width
        hist_ax.bar([k + offset for k in ks], [r.counters.staleness[k] / total for k in ks], width, label=names[i])
    hist_ax.set_xticks(sorted({k for r in results for k in r.counters.staleness}))
    hist_ax.set_xlabel("staleness at consumption (versions)")
    hist_ax.set_ylabel("fraction of samples")
    hist_ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------------------------
# `slipstream simulate`
# ----------------------------------------------------------------------------------------------


def _flow_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("flow (default: the config's [flow] section, or FlowConfig defaults)")
    g.add_argument("--strategy", choices=["on_policy", "one_step_off", "fully_async"])
    g.add_argument("--prompts-per-step", type=int)
    g.add_argument("--samples-per-prompt", type=int)
    g.add_argument("--max-concurrent", type=int)
    g.add_argument("--max-untrained-prompts", type=int)
    g.add_argument("--max-staleness", type=int)
    g.add_argument("--stale-policy", choices=["drop", "requeue"])
    g.add_argument("--partial-rollout", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--end-of-data", choices=["train_partial", "drop"])
    g.add_argument("--dynamic-sampling", action=argparse.BooleanOptionalAction, default=None)
    g.add_argument("--max-dynamic-refills-per-step", type=int)


def flow_from_args(args: argparse.Namespace) -> FlowConfig:
    """The flow section: from --config (or defaults), then the explicit flags; validated like a config."""
    cfg = load_config(args.config) if args.config else Config()
    flow = dataclasses.replace(
        cfg.flow,
        **{
            f.name: getattr(args, f.name)
            for f in dataclasses.fields(FlowConfig)
            if getattr(args, f.name, None) is not None
        },
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


def compare_table(rows: Sequence[tuple[str, SimResult]], base: SimResult) -> str:
    """A text table of (name, result) rows, throughput relative to `base`."""
    head = f"{'strategy':<28}{'s/step':>8}{'samples/s':>11}{'vs base':>9}{'trainer':>9}{'generator':>11}{'wasted':>8}"
    lines = [head]
    for name, r in rows:
        lines.append(
            f"{name:<28}{r.makespan / max(1, len(r.steps)):>8.1f}{r.samples_per_s:>11.3f}"
            f"{r.samples_per_s / base.samples_per_s:>8.2f}x{r.trainer_utilisation:>9.0%}"
            f"{r.generator_utilisation:>11.0%}{r.wasted_fraction:>8.1%}"
        )
    return "\n".join(lines)


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
            policy = FlowPolicy.from_config(
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


__all__ = [
    "Costs",
    "SimResult",
    "SimulationError",
    "StepRecord",
    "GeneratorPool",
    "ThroughputModel",
    "Workload",
    "ascii_timeline",
    "cli_main",
    "save_png",
    "simulate",
]

if __name__ == "__main__":  # pragma: no cover - `slipstream simulate` is the entry point
    raise SystemExit(cli_main(sys.argv[1:]))
