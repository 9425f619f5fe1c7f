"""Compare bench/moe_bench.py's moonlet row with a ROLE=trainer pretraining run of the same shape
(bench/h200_role_pretrain.sh runs both): prints one table and writes it as JSON.

    python bench/h200_role_summary.py --bench-json OUT/moe_bench.json --run-dir RUN_DIR \\
        --config configs/moonlet.toml --seq 4096 --skip 3 [--out OUT/summary.json]

Role-path figure: the trainer's per-step `train/tokens_per_s` from DuckDB, the first `--skip` steps
(compile, the recompile when the bf16 expert copy appears) left out, median of the rest; moe_bench
likewise runs 3 warm-up steps and times the following ones. Also given: the wall rate between the
first and last kept steps' DuckDB timestamps (it includes what happens between steps: metrics logging,
the step log line), and MFU by moe_bench's count (6 x active parameters + causal attention, over 989).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import load_config  # noqa: E402
from common.metrics import read_metrics  # noqa: E402
from trainer.model import attention_flops_per_token, count_params  # noqa: E402

H200_PEAK = 989e12


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bench-json", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--config", default="configs/moonlet.toml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], help="the role run's model overrides")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--skip", type=int, default=3)
    ap.add_argument("--threshold", type=float, default=0.95)
    ap.add_argument("--out", default="")
    args = ap.parse_args()

    bench = json.loads(Path(args.bench_json).read_text())
    rows = [m for m in bench.get("moonlet", []) if m.get("compiled") and "error" not in m]
    b = rows[0] if rows else None
    points = read_metrics(args.run_dir, ["train/tokens_per_s"], role="trainer")
    steps = sorted(points, key=lambda p: p.step)
    kept = [p for p in steps if p.step > args.skip]
    mc = load_config(args.config, args.overrides).trainer.model
    _, active = count_params(mc)
    flops_per_token = 6 * active + attention_flops_per_token(mc, args.seq)

    out: dict = {"bench": b, "role_steps": [(p.step, round(p.value, 1), p.ts_ms) for p in steps]}
    role = None
    if kept:
        vals = [p.value for p in kept]
        role = statistics.median(vals)
        wall = None
        if len(kept) >= 2:
            dt_s = (kept[-1].ts_ms - kept[0].ts_ms) / 1e3
            wall = args.batch * args.seq * (len(kept) - 1) / dt_s if dt_s > 0 else None
        out["role"] = {
            "median_tokens_per_s": role,
            "mean_tokens_per_s": statistics.fmean(vals),
            "min": min(vals),
            "max": max(vals),
            "steps_kept": len(kept),
            "steps_total": len(steps),
            "wall_tokens_per_s_from_timestamps": wall,
            "mfu_989": flops_per_token * role / H200_PEAK,
            "step_ms_median": args.batch * args.seq / role * 1e3,
        }
    ratio = role / b["tokens_per_s"] if (role and b) else None
    out["ratio"] = ratio
    out["within_5pct"] = ratio is not None and ratio >= args.threshold

    print("\nper-step train/tokens_per_s (role path):")
    print("  " + ", ".join(f"{p.step}:{p.value:,.0f}" for p in steps))
    print("\n| what | tokens/s | step ms | MFU of 989 |")
    print("| --- | --- | --- | --- |")
    if b:
        print(
            f"| moe_bench moonlet row (compiled, {b['batch']}x{b['seq']}, 3 warm-up + timed steps, mean) | "
            f"{b['tokens_per_s']:,.0f} | {b['step_ms']:.0f} | {b['mfu_989']:.1%} |"
        )
    else:
        print("| moe_bench moonlet row | missing | | |")
    if role:
        r = out["role"]
        print(
            f"| role path ROLE=trainer pretrain (median of steps {args.skip + 1}..{steps[-1].step}) | {role:,.0f} | "
            f"{r['step_ms_median']:.0f} | {r['mfu_989']:.1%} |"
        )
        if r["wall_tokens_per_s_from_timestamps"]:
            w = r["wall_tokens_per_s_from_timestamps"]
            print(
                f"| role path, wall rate between kept steps' DuckDB timestamps | {w:,.0f} | "
                f"{args.batch * args.seq / w * 1e3:.0f} | {flops_per_token * w / H200_PEAK:.1%} |"
            )
    else:
        print("| role path | no steps after warm-up in DuckDB | | |")
    if ratio is not None:
        verdict = "within 5%: met" if out["within_5pct"] else "MORE than 5% slower: missed"
        print(f"\nratio role / moe_bench = {ratio:.4f} ({verdict})")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"RATIO={ratio if ratio is not None else 'nan'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
