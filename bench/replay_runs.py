"""Rollout routing replay on the demo: the same run (seed, config) with trainer.rl.routing_replay = none
and = rollout, side by side. Per run: held-out accuracy of version 0 and the mean of the last LAST
versions (and the rise), and the per-step mismatch telemetry from the run's metrics (DuckDB), averaged
over the steps: routing disagreement (token-layer pairs where the trainer's own top-k differs from the
rollout's), |log p_trainer - log p_behaviour| mean / p99 / max, the k3 estimate of KL(behaviour ||
proximal), the mismatch on fresh samples, the tokens masked by the corrections; and the run's step time.

    .venv/bin/python bench/replay_runs.py --steps 15
    .venv/bin/python bench/replay_runs.py --steps 15 --set trainer.rl.token_mask_band=[0.5,2.0]

Runs are serial (this machine has 2 cores), 3-5 minutes each at 15 steps.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, for common/
from chaos import HELDOUT, LAST, Run, heldout_figures  # noqa: E402  (bench/ itself is on sys.path)

from common.metrics import step_series  # noqa: E402

FIGURES = {  # column -> metric tag (mean over steps; _max columns take the max)
    "disagree": "loss/routing_disagreement",
    "gap mean": "loss/behaviour_proximal_abs_logp_diff",
    "gap p99": "loss/behaviour_proximal_abs_logp_diff_p99",
    "gap max": "loss/behaviour_proximal_abs_logp_diff_max",
    "k3": "loss/behaviour_proximal_k3",
    "fresh gap": "loss/fresh_logprob_mismatch",
    "masked": "loss/token_masked_fraction",
    "step s": "perf/step_s",
}


def figures(run_dir: Path) -> dict[str, float | None]:
    series = step_series(run_dir, FIGURES.values(), role="trainer")
    out: dict[str, float | None] = {}
    for column, tag in FIGURES.items():
        values = list(series.get(tag, {}).values())
        out[column] = (max(values) if column.endswith("max") else sum(values) / len(values)) if values else None
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--set", action="append", default=[], help="extra config override for both runs")
    ap.add_argument("--keep", action="store_true", help="keep the run dirs (printed)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ss-r3-"))
    rows = []
    try:
        for mode in ("none", "rollout"):
            exp = f"r3-{mode}"
            run = Run(root, exp, args.steps, args.seed, [f"trainer.rl.routing_replay={mode}", *args.set])
            code = run.proc.wait(timeout=3600)
            if code != 0:
                print(run.log()[-4000:], file=sys.stderr)
                raise SystemExit(f"{exp}: launch exited {code}")
            first = {int(v): float(a) for v, a in HELDOUT.findall(run.log())}.get(0)
            _, _, last_mean = heldout_figures(run.log())
            rows.append((mode, first, last_mean, figures(run.run_dir)))
    finally:
        if args.keep:
            print(f"run dirs under {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    cols = list(FIGURES)
    print(f"| replay | held-out v0 | last {LAST} mean | rise | " + " | ".join(cols) + " |")
    print("|" + "---|" * (4 + len(cols)))
    for mode, first, last, figs in rows:
        rise = None if first is None or last is None else last - first
        cells = [f"{figs[c]:.3g}" if figs[c] is not None else "-" for c in cols]
        held = [f"{v:.3f}" if v is not None else "-" for v in (first, last)] + [
            f"{rise:+.3f}" if rise is not None else "-"
        ]
        print("| " + " | ".join([mode, *held, *cells]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
