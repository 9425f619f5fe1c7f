"""What a simulated run produced and how it is shown: the records of a run (`StepRecord`, `Span`,
`TracePoint`, `SampleRecord`, `SimResult` with its summary and utilisations), the ASCII timeline, the PNG
figure and the table that compares strategies. The simulator (simulator.py) makes these, and
compare.py makes one from a real run's metrics to set beside a prediction; `slipstream simulate`
(cli.py) and bench/flow_bench.py print them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout.flow.events import FlowCounters


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
    """A trainer activity: `kind` is "train" (label = the optimizer step) or "sync" (label = the weights step
    published)."""

    start: float
    end: float
    kind: str
    label: int


@dataclass
class TracePoint:
    """The generator pool from time `t` on: requests in flight, the weights step served, paused or not."""

    t: float
    concurrency: int
    weights_step: int
    paused: bool


@dataclass
class SampleRecord:
    """One completed episode, as a run's gen/* metrics record it: attempt `attempt` of sample `index` of
    `prompt_id`, its first request sent at `start` and its last done at `end` (seconds), `tokens` generated
    by the policy over its `turns` turns, served by `worker`, with `concurrency` requests in flight when it
    was sent (itself included), `tool_s` seconds in tool calls between its turns and `env_tokens` tokens
    those calls appended."""

    prompt_id: int
    index: int
    attempt: int
    start: float
    end: float
    tokens: int
    worker: int
    concurrency: int
    turns: int = 1
    tool_s: float = 0.0
    env_tokens: int = 0


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
    samples: list[SampleRecord] = field(default_factory=list)

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
    def turns_per_episode(self) -> float:
        """Turns (generation requests) per completed episode, on average; nan without episodes."""
        return sum(s.turns for s in self.samples) / len(self.samples) if self.samples else math.nan

    @property
    def tool_s_per_episode(self) -> float:
        """Seconds a completed episode spent in tool calls, on average; nan without episodes."""
        return sum(s.tool_s for s in self.samples) / len(self.samples) if self.samples else math.nan

    @property
    def staleness_mean(self) -> float:
        """Mean staleness of the trained samples, in steps."""
        n = sum(self.counters.staleness.values())
        return sum(k * v for k, v in self.counters.staleness.items()) / n if n else 0.0

    @property
    def wasted_fraction(self) -> float:
        """Generated tokens that were never trained on (stale, dropped, aborted or left in flight)."""
        if not self.generated_tokens:
            return 0.0
        return max(0.0, 1.0 - self.trained_completion_tokens / self.generated_tokens)

    def summary(self) -> str:
        c = self.counters
        hist = ", ".join(f"{k}: {v}" for k, v in sorted(c.staleness.items()))
        episodes = []
        if any(s.turns > 1 for s in self.samples):  # a single-turn run's summary is as it always was
            episodes.append(
                f"episodes: {self.turns_per_episode:.2f} turns and {self.tool_s_per_episode:.2f} s of tool calls "
                f"each on average ({len(self.samples)} completed)"
            )
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
                *episodes,
            ]
        )


# ----------------------------------------------------------------------------------------------
# Rendering
# ----------------------------------------------------------------------------------------------

_RAMP = " .:-=+*#%@"


def ascii_timeline(result: SimResult, width: int = 100) -> str:
    """Three rows over time: the trainer (step number mod 10 while training, '^' while syncing, '.'
    idle), the generator's mean concurrency relative to max_concurrent (' ' to '@', 'p' paused) and
    the weights step the generators serve (mod 10)."""
    width = max(10, width)
    dt = result.makespan / width if result.makespan else 1.0
    trainer, gen, served = [], [], []
    spans = result.spans
    trace = result.trace + [TracePoint(result.makespan, 0, result.trace[-1].weights_step, False)]
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
        served.append(str(trace[max(0, j - 1)].weights_step % 10))
    scale = f"0 s{' ' * (width - 3 - len(f'{result.makespan:.0f} s'))}{result.makespan:.0f} s"
    return "\n".join(
        [
            f"{result.strategy} timeline ({dt:.1f} s per column)",
            f"trainer   |{''.join(trainer)}|",
            f"generator |{''.join(gen)}|",
            f"weights   |{''.join(served)}|",
            f"           {scale}",
        ]
    )


def save_png(results: Sequence[SimResult], path: str, title: str = "", labels: Sequence[str] | None = None) -> None:
    """One panel per result on one time axis (requests in flight above, on the right-hand scale, red while
    generation is paused; the trainer's steps and publishes below), plus the staleness histograms; a
    legend names every colour. Written to `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    n = len(results)
    names = list(labels) if labels is not None else [r.strategy for r in results]
    fig, axes = plt.subplots(n + 1, 1, figsize=(12, 2.4 * n + 3.2), squeeze=False)
    horizon = max(r.makespan for r in results)
    for ax, r, name in zip(axes[:-1, 0], results, names, strict=True):
        cap = max(1, r.max_concurrent)
        ts = [p.t for p in r.trace] + [r.makespan]
        conc = [p.concurrency / cap for p in r.trace] + [0.0]
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
        ax.set_ylabel("activity")
        ax.set_xlabel("time since the flow started (s)")
        # The generator lane [1, 2.05] read as requests in flight [0, 1.05 * max_concurrent].
        scale = ax.twinx()
        scale.set_ylim(-cap, 1.05 * cap)
        scale.set_yticks([0, cap // 2, cap])
        scale.set_ylabel("requests in flight", fontsize=8)
        ax.set_title(
            f"{name}: {r.samples_per_s:.2f} samples/s, trainer {r.trainer_utilisation:.0%}, "
            f"generator {r.generator_utilisation:.0%}",
            fontsize=9,
            loc="left",
        )
    hist_ax = axes[-1, 0]
    width = 0.8 / n
    bar_colours = ["tab:purple", "tab:olive", "tab:cyan", "tab:brown", "tab:pink", "tab:gray"]  # none of the above
    for i, r in enumerate(results):
        total = max(1, sum(r.counters.staleness.values()))
        ks = sorted(r.counters.staleness)
        offset = (i - (n - 1) / 2) * width
        shares = [r.counters.staleness[k] / total for k in ks]
        hist_ax.bar([k + offset for k in ks], shares, width, label=names[i], color=bar_colours[i % len(bar_colours)])
    hist_ax.set_xticks(sorted({k for r in results for k in r.counters.staleness}))
    hist_ax.set_xlabel("staleness at consumption (steps)")
    hist_ax.set_ylabel("fraction of trained samples")
    hist_ax.legend(fontsize=8, title="staleness of", title_fontsize=8)
    colours = [
        Patch(color="tab:green", alpha=0.6, label="requests in flight (right-hand scale)"),
        Patch(color="tab:red", alpha=0.3, label="generation paused by a publish"),
        Patch(color="tab:blue", label="train step"),
        Patch(color="tab:orange", label="publish (trainer's time)"),
    ]
    fig.legend(handles=colours, loc="lower center", ncol=4, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title)
    fig.tight_layout(rect=(0.0, 0.04, 1.0, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)


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
