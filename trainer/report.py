"""The end-of-run report of an RL run: a table of reward and held-out accuracy per step, and a PNG.

Training figures come from the trainer's DuckDB metrics; held-out accuracy comes from the
evaluator's results on the experiment's `evals` stream (one entry per evaluated version; version v
is the policy after step v - 1, so it is drawn at step v).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import redis

from common.keys import Keys
from common.metrics import step_series

log = logging.getLogger(__name__)


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
    for _, fields in client.xrange(keys.evals):
        if fields.get("benchmark") == benchmark:
            scores[int(fields["version"])] = float(fields["score"])
    return scores


def wait_for_eval(client: redis.Redis, keys: Keys, version: int, benchmark: str, timeout_s: float) -> bool:
    """Block (on the stream, no polling) until `benchmark` has a result for `version` or a newer one,
    or the timeout. The blocking read continues from the last entry already seen, so a result that
    lands between the first read and the blocking one is not missed."""
    return not _wait_stream(
        client, keys, lambda f: f.get("benchmark") == benchmark and int(f["version"]) >= version, timeout_s, 1
    )


def wait_for_evals(client: redis.Redis, keys: Keys, versions: set[int], benchmark: str, timeout_s: float) -> set[int]:
    """Block until `benchmark` has a result for every one of `versions`, or the timeout; the versions
    still without one (an evaluator that pins each version backfills older ones after the newest)."""
    pending = set(versions)

    def answers(fields: dict[str, str]) -> bool:
        if fields.get("benchmark") == benchmark and int(fields["version"]) in pending:
            pending.discard(int(fields["version"]))
            return True
        return False

    _wait_stream(client, keys, answers, timeout_s, len(pending))
    return pending


def _wait_stream(
    client: redis.Redis, keys: Keys, answers: Callable[[dict[str, str]], bool], timeout_s: float, needed: int
) -> int:
    """Read the evals stream from its start, then block on it, until `needed` entries answered or the
    timeout; how many are still needed."""
    if needed <= 0:
        return 0
    last_id = "0-0"
    for entry_id, fields in client.xrange(keys.evals):
        needed -= answers(fields)
        if needed <= 0:
            return 0
        last_id = entry_id
    deadline = time.monotonic() + timeout_s
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        got = client.xread({keys.evals: last_id}, block=min(left_ms, 1000), count=100)
        for _, entries in got or []:
            for entry_id, fields in entries:
                needed -= answers(fields)
                if needed <= 0:
                    return 0
                last_id = entry_id
    return needed


def build_rows(run_dir: Path, heldout: dict[int, float]) -> list[ReportRow]:
    series = step_series(run_dir, ["rl/reward_mean", "rl/accuracy", "rl/staleness_max"], role="trainer")
    steps = sorted(set(series.get("rl/reward_mean", {})) | {v for v in heldout})
    return [
        ReportRow(
            step,
            series.get("rl/reward_mean", {}).get(step),
            series.get("rl/accuracy", {}).get(step),
            heldout.get(step),
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
    ax.set_xlabel("step (held-out: weight version)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
