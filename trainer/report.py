"""The end-of-run report of an RL run: a table of reward and held-out accuracy per step, a PNG, and a few
summary lines, printed and written to the run dir's report.txt.

Built from what is recorded only: training figures from the trainer's DuckDB metrics, held-out accuracy
from the evaluator's results on the experiment's `evals` stream (one entry per evaluated version, drawn at
the step whose weights the version holds). It never waits for another role: the RL driver's bounded wait
for the evaluator's verdict (trainer/rl/verdict.py) comes before it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import redis

from common.keys import Keys
from common.metrics import step_series
from common.redis_client import entries
from common.roles import REPORT_FILE
from common.weights.lineage import Lineage


@dataclass(frozen=True)
class ReportRow:
    step: int
    reward: float | None
    train_accuracy: float | None
    heldout: float | None
    staleness_max: float | None


def held_out_scores(client: redis.Redis, keys: Keys, benchmark: str) -> dict[int, float]:
    """version -> score of one benchmark, from the evals stream."""
    scores: dict[int, float] = {}
    for _, fields in entries(client.xrange(keys.evals)):
        if fields.get("benchmark") == benchmark:
            scores[int(fields["version"])] = float(fields["score"])
    return scores


def build_rows(run_dir: Path, heldout_by_step: dict[int, float]) -> list[ReportRow]:
    series = step_series(run_dir, ["rl/reward_mean", "rl/accuracy", "rl/staleness_max"], role="trainer")
    steps = sorted(set(series.get("rl/reward_mean", {})) | set(heldout_by_step))
    return [
        ReportRow(
            step,
            series.get("rl/reward_mean", {}).get(step),
            series.get("rl/accuracy", {}).get(step),
            heldout_by_step.get(step),
            series.get("rl/staleness_max", {}).get(step),
        )
        for step in steps
    ]


def format_table(rows: list[ReportRow], every: int = 1) -> str:
    def cell(value: float | None, fmt: str = "{:.3f}") -> str:
        return "-" if value is None else fmt.format(value)

    lines = [f"{'step':>5} {'reward':>8} {'train acc':>10} {'held-out acc':>13} {'max stale':>10}"]
    last = rows[-1].step if rows else 0
    for r in rows:
        if r.step % every and r.step != last:
            continue
        lines.append(
            f"{r.step:>5} {cell(r.reward):>8} {cell(r.train_accuracy):>10} {cell(r.heldout):>13} "
            f"{cell(r.staleness_max, '{:.0f}'):>10}"
        )
    return "\n".join(lines)


def save_png(rows: list[ReportRow], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    train = [(r.step, r.reward) for r in rows if r.reward is not None]
    held = [(r.step, r.heldout) for r in rows if r.heldout is not None]
    if train:
        ax.plot(*zip(*train, strict=True), label="mean reward (train samples)", color="tab:blue", alpha=0.8)
    if held:
        ax.plot(*zip(*held, strict=True), label="held-out accuracy (greedy)", color="tab:red", marker="o")
    ax.set_xlabel("step (held-out: the step whose weights the version holds)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(
    client: redis.Redis,
    keys: Keys,
    run_dir: Path,
    title: str,
    benchmark: str | None,
    lineage: Lineage,
    mismatch: list[float],
) -> str:
    """Print the run's report and write it to `run_dir`/report.txt (the table by step, the held-out change of
    `benchmark` from its first to its last evaluated version, the trainer-vs-vLLM log-prob `mismatch` per
    step) and draw report.png; returns the text."""
    heldout = held_out_scores(client, keys, benchmark) if benchmark else {}
    # The table is by step: a version holds the weights of one step (several, after a resume).
    by_step = {lineage.step_of(v): score for v, score in sorted(heldout.items()) if v in lineage}
    rows = build_rows(run_dir, by_step)
    lines = [format_table(rows, every=max(1, len(rows) // 20))]
    png = save_png(rows, run_dir / "report.png", title)
    if heldout:
        first, final = min(heldout), max(heldout)
        lines.append(
            f"held-out {benchmark}: {heldout[first]:.3f} at version {first} -> {heldout[final]:.3f} at "
            f"version {final} ({100 * (heldout[final] - heldout[first]):+.1f} points)"
        )
    if mismatch:
        lines.append(
            f"trainer-vs-vLLM log-prob mismatch on fresh samples: mean "
            f"{sum(mismatch) / len(mismatch):.3g}, max {max(mismatch):.3g} nats per "
            f"token ({len(mismatch)} steps)"
        )
    lines.append(f"report: {png}; metrics: {run_dir / 'metrics'}")
    text = "\n".join(lines)
    print(text, flush=True)
    (run_dir / REPORT_FILE).write_text(text + "\n")
    return text
