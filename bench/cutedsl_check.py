"""The CuTeDSL expert backend on the H200 in one command: numerics against float64 (beside torch._grouped_mm's),
then each of the six grouped GEMMs of the SwiGLU experts timed alone for every tile config (ours beside
torch._grouped_mm), then the whole expert forward and forward + backward at the 128-expert shape of
bench/moe_bench.py (H2048 I768 E128 top-8, 16k tokens, pre-sorted balanced rows like its `raw` row), with the
best config per grouping of this run. Prints a table last; writes JSON and the log under $OUT.

    d=$(mktemp -d) && tar -C "$d" -xJf .cutedsl/cutedsl.tar.xz &&
    export PYTHONPATH="$d:$d/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
    PYTHONUNBUFFERED=1 python bench/cutedsl_check.py

FLOPs count 2*M*N*K per GEMM; the layer's forward is 3 GEMMs of 2*rows*H*I (gate, up, down), forward +
backward 3x that, as in moe_bench. Left out: FP8, fused permutation, the MoE layer with routing (moe_bench)."""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainer.experts import cutedsl_experts, grouped_mm_experts  # noqa: E402
from trainer.experts.cutedsl import cutedsl_unavailable, grouped  # noqa: E402
from trainer.experts.cutedsl.grouped import TileConfig  # noqa: E402
from trainer.experts.numerics import relative_errors  # noqa: E402

CONFIGS = {  # the safest first: a config that faults the GPU ends the run, so risky ones come last
    "128x128 s3 1wg": TileConfig((128, 128), 3, 1),
    "128x256 s3 2wg pairs": TileConfig((128, 256), 3, 2, pair_stores=True),
    "persistent 128x256 s4 pairs": TileConfig((128, 256), 4, 2, pair_stores=True, persistent=True),
    "persistent 128x256 s3 smem-epi": TileConfig(
        (128, 256), 3, 2, pair_stores=True, persistent=True, smem_epilogue=True
    ),
    "persistent 128x256 s4 smem-epi": TileConfig(
        (128, 256), 4, 2, pair_stores=True, persistent=True, smem_epilogue=True
    ),
}
STEP_S = 150.0  # one step (a numerics pass, a variant's compile + timing) longer than this is declared hung
_T0 = time.perf_counter()
_DEADLINE_S = [540.0]  # of the whole script (--deadline-s)


def guard(seconds: float = STEP_S) -> None:
    """A kernel that never finishes cannot be interrupted from Python: dump the stacks and exit after
    `seconds` (at most the script's deadline), so that a hung variant costs minutes, not the whole lease."""
    left = _DEADLINE_S[0] - (time.perf_counter() - _T0)
    faulthandler.dump_traceback_later(max(1.0, min(seconds, left)), exit=True)


DEVICE = torch.device("cuda")
NUMERICS_CASES = [  # (counts per expert, H, I)
    ([300, 0, 129, 64, 1, 511], 256, 128),
    ([0, 2000, 0], 128, 64),
    ([1024] * 16, 2048, 768),
]


def bench_ms(fn: Callable[[], object], rep_ms: int = 200) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def first_call_s(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def numerics(log: list[str]) -> list[dict]:
    """Every config on the small cases (partial tiles, empty experts, long wgrad tails), the module's default
    config also at the bench shape; torch._grouped_mm's errors on the same inputs beside them."""
    rows = []
    default = (grouped.M_CONFIG, grouped.K_CONFIG)
    for cname, cfg in CONFIGS.items():
        for counts, H, inter in NUMERICS_CASES if cfg == default[0] else NUMERICS_CASES[:2]:
            case = f"E{len(counts)} rows {sum(counts)} H{H} I{inter}"
            guard()
            grouped.POISON_OUTPUTS, grouped.M_CONFIG, grouped.K_CONFIG = True, cfg, cfg
            try:
                ours = relative_errors(cutedsl_experts, counts, H, inter, seed=len(counts), device=DEVICE)
            except Exception as exc:
                traceback.print_exc()
                ours = {"error": repr(exc)[:300]}
            finally:
                grouped.POISON_OUTPUTS, (grouped.M_CONFIG, grouped.K_CONFIG) = False, default
            theirs = relative_errors(grouped_mm_experts, counts, H, inter, seed=len(counts), device=DEVICE)
            rows.append({"case": case, "config": cname, "cutedsl": ours, "grouped_mm": theirs})
            line = f"numerics {cname} | {case}: " + ", ".join(
                f"{k} {ours.get(k, float('nan')):.2e} (grouped_mm {v:.2e})" for k, v in theirs.items()
            )
            print(line + (f" ERROR {ours['error']}" if "error" in ours else ""), flush=True)
            log.append(line)
    return rows


def numerics_ok(rows: list[dict], cname: str) -> bool:
    """A config passes when every error it has is finite and within max(5e-3, 1.5x torch._grouped_mm's)."""
    mine = [r for r in rows if r["config"] == cname]
    return bool(mine) and all(
        "error" not in r["cutedsl"] and all(r["cutedsl"][k] < max(5e-3, 1.5 * v) for k, v in r["grouped_mm"].items())
        for r in mine
    )


def gemm_rows(
    H: int, inter: int, E: int, rows: int, log: list[str], passed: set[str]
) -> tuple[list[dict], dict[str, str]]:
    """The six GEMMs alone: torch._grouped_mm and ours per config. Returns rows and the best config per grouping."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    counts = torch.full((E,), rows // E, device="cuda")
    counts[: rows % E] += 1
    offs = counts.cumsum(0).int()
    x, act, grad_y, grad_h = rnd(rows, H), rnd(rows, inter), rnd(rows, H), rnd(rows, 2 * inter)
    w1, w2 = rnd(E, 2 * inter, H, scale=0.02), rnd(E, H, inter, scale=0.02)
    items = grouped.work_items(offs, rows, 128)
    gemms = {  # name: (flops, torch fn, grouping, ours(config))
        "fwd gate_up": (
            2 * rows * H * 2 * inter,
            lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
            "m",
            lambda c: grouped.m_grouped(x, w1.permute(1, 2, 0), offs, items, c),
        ),
        "fwd down": (
            2 * rows * inter * H,
            lambda: torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs),
            "m",
            lambda c: grouped.m_grouped(act, w2.permute(1, 2, 0), offs, items, c),
        ),
        "dgrad act": (
            2 * rows * H * inter,
            lambda: torch._grouped_mm(grad_y, w2, offs=offs),
            "m",
            lambda c: grouped.m_grouped(grad_y, w2.permute(2, 1, 0), offs, items, c),
        ),
        "dgrad x": (
            2 * rows * 2 * inter * H,
            lambda: torch._grouped_mm(grad_h, w1, offs=offs),
            "m",
            lambda c: grouped.m_grouped(grad_h, w1.permute(2, 1, 0), offs, items, c),
        ),
        "wgrad down (ours fp32 out)": (
            2 * rows * H * inter,
            lambda: torch._grouped_mm(grad_y.t(), act, offs=offs),
            "k",
            lambda c: grouped.k_grouped(grad_y, act, offs, torch.float32, c),
        ),
        "wgrad gate_up (ours fp32 out)": (
            2 * rows * 2 * inter * H,
            lambda: torch._grouped_mm(grad_h.t(), x, offs=offs),
            "k",
            lambda c: grouped.k_grouped(grad_h, x, offs, torch.float32, c),
        ),
    }
    total = {(g, n): 0.0 if n in passed else float("inf") for g in ("m", "k") for n in CONFIGS}
    out = []
    for name, (flops, torch_fn, grouping, ours) in gemms.items():
        ref = torch_fn()
        ms = bench_ms(torch_fn)
        out.append({"gemm": name, "impl": "torch._grouped_mm", "ms": ms, "tflops": flops / ms / 1e9})
        print(f"{name}: torch._grouped_mm {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s", flush=True)
        for cname, cfg in CONFIGS.items():
            if cname not in passed:
                continue
            row = {"gemm": name, "impl": f"cutedsl {cname}"}
            guard()
            try:
                row["compile_s"] = first_call_s(lambda cfg=cfg, ours=ours: ours(cfg))
                got = ours(cfg).float()
                row["rel_diff_vs_torch"] = float((got - ref.float()).norm() / ref.float().norm())
                row["ms"] = bench_ms(lambda cfg=cfg, ours=ours: ours(cfg))
                row["tflops"] = flops / row["ms"] / 1e9
                total[(grouping, cname)] += row["ms"]
            except Exception as exc:
                traceback.print_exc()
                row["error"] = repr(exc)[:300]
                total[(grouping, cname)] = float("inf")
            out.append(row)
            line = f"{name}: cutedsl {cname} " + " ".join(
                f"{k}={v}" for k, v in row.items() if k not in ("gemm", "impl")
            )
            print(line, flush=True)
            log.append(line)
    best = {gr: min(CONFIGS, key=lambda n, gr=gr: total[(gr, n)]) for gr in ("m", "k")}
    return out, {gr: n for gr, n in best.items() if total[(gr, n)] < float("inf")}


def layer_rows(H: int, inter: int, E: int, k: int, tokens: int) -> list[dict]:
    """The expert SwiGLU forward and forward + backward, bf16 weights, balanced pre-sorted rows (moe_bench's raw row)."""
    rows = tokens * k
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w1 = (torch.randn(E, 2 * inter, H, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, inter, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
    counts = torch.full((E,), rows // E, device="cuda")
    counts[: rows % E] += 1
    offs = counts.cumsum(0).to(torch.int32)
    grad = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 2 * rows * 3 * H * inter
    res = []
    # torch again at the end: the spread of its two rows says how much of a difference is noise.
    impls = (
        ("torch._grouped_mm", grouped_mm_experts),
        ("cutedsl", cutedsl_experts),
        ("torch._grouped_mm again", grouped_mm_experts),
    )
    for name, fn in impls:

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(x, offs, w1, w2)

        def step(fn=fn):
            x.grad = w1.grad = w2.grad = None
            fn(x, offs, w1, w2).backward(grad)

        try:
            step()
            f_ms, s_ms = bench_ms(fwd, 1000), bench_ms(step, 1000)
            res.append(
                {
                    "impl": name,
                    "fwd_ms": f_ms,
                    "fwd_tflops": fwd_flops / f_ms / 1e9,
                    "step_ms": s_ms,
                    "step_tflops": 3 * fwd_flops / s_ms / 1e9,
                }
            )
        except Exception as exc:
            traceback.print_exc()
            res.append({"impl": name, "error": repr(exc)[:300]})
        print("layer", json.dumps(res[-1]), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048,768,128,8", help="H,I,E,top-k (moe_bench's 128-expert shape)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--skip-gemms", action="store_true", help="no per-GEMM config sweep (uses the module's configs)")
    ap.add_argument("--deadline-s", type=float, default=540.0, help="exit (with a traceback) after this")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "cutedsl_check.json"))
    args = ap.parse_args()
    _DEADLINE_S[0] = args.deadline_s
    guard()
    H, inter, E, k = (int(v) for v in args.shape.split(","))
    device = torch.device("cuda")
    reason = cutedsl_unavailable(device, torch.bfloat16)
    import cutlass

    results: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cutlass_dsl": getattr(cutlass, "__version__", "?"),
        "unavailable": reason,
        "shape": f"H{H} I{inter} E{E} top-{k}, {args.tokens} tokens ({args.tokens * k} rows)",
    }
    print(json.dumps(results), flush=True)
    if reason:
        raise SystemExit(f"cutedsl cannot run here: {reason}")

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=2))

    log: list[str] = []
    results["numerics"] = numerics(log)
    save()
    guard()
    # The expert layer with the module's configs before the sweep, so that its numbers survive a late fault;
    # if those failed the numerics, with the first config that passed instead.
    default = next((n for n, c in CONFIGS.items() if c == grouped.M_CONFIG == grouped.K_CONFIG), None)
    if default is None or not numerics_ok(results["numerics"], default):
        fallback = next((n for n in CONFIGS if numerics_ok(results["numerics"], n)), None)
        print(f"module config {default} failed the numerics; layer timed with {fallback}", flush=True)
        if fallback is not None:
            grouped.M_CONFIG = grouped.K_CONFIG = CONFIGS[fallback]
        default = fallback
    results["layer_config"] = default
    results["layer"] = layer_rows(H, inter, E, k, args.tokens)
    save()
    print(table(results), flush=True)
    if not args.skip_gemms:
        passed = {c for c in CONFIGS if numerics_ok(results["numerics"], c)}
        results["configs_passing_numerics"] = sorted(passed)
        print(f"configs within the numerics bound: {sorted(passed)}", flush=True)
        results["gemms"], best = gemm_rows(H, inter, E, args.tokens * k, log, passed)
        results["best_config"] = best
        save()
        print(f"best configs of this run (fastest summed over each grouping's GEMMs): {best}", flush=True)
        if len(best) == 2 and (CONFIGS[best["m"]], CONFIGS[best["k"]]) != (grouped.M_CONFIG, grouped.K_CONFIG):
            grouped.M_CONFIG, grouped.K_CONFIG = CONFIGS[best["m"]], CONFIGS[best["k"]]
            guard()
            results["layer_best"] = layer_rows(H, inter, E, k, args.tokens)
            save()
    print(table(results))


def table(results: dict) -> str:
    lines = [f"{results['device']}, torch {results['torch']}, CuTeDSL {results['cutlass_dsl']}, {results['shape']}", ""]
    lines += [
        "rel. error vs float64, cutedsl (torch._grouped_mm): out, grad x, grad gate_up, grad down",
        "| config | case | out | grad x | grad gate_up | grad down |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["numerics"]:
        ours, theirs = r["cutedsl"], r["grouped_mm"]
        cells = " | ".join(
            (f"{ours[n]:.1e}" if n in ours else "err") + f" ({theirs[n]:.1e})"
            for n in ("out", "grad_x", "grad_gate_up", "grad_down")
        )
        lines.append(f"| {r['config']} | {r['case']} | {cells} |")
    if "gemms" in results:
        lines += ["", "| GEMM | impl | ms | TFLOP/s | compile s |", "| --- | --- | --- | --- | --- |"]
        for r in results["gemms"]:
            if "error" in r:
                lines.append(f"| {r['gemm']} | {r['impl']} | error: {r['error'][:80]} | | |")
            else:
                lines.append(
                    f"| {r['gemm']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r.get('compile_s', 0):.1f} |"
                )
    lines += [
        "",
        f"expert SwiGLU: module config {results.get('layer_config')}; best configs {results.get('best_config')}",
        "| expert SwiGLU | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for suffix, rows in (("", results["layer"]), (" (best configs)", results.get("layer_best", []))):
        base = next((r for r in rows if r["impl"] == "torch._grouped_mm" and "error" not in r), None)
        for r in rows:
            if "error" in r:
                lines.append(f"| {r['impl']}{suffix} | error: {r['error'][:100]} | | | |")
                continue
            lines.append(
                f"| {r['impl']}{suffix} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {r['step_ms']:.3f} | "
                f"{r['step_tflops']:.0f} |"
            )
            if base is not None and r["impl"] == "cutedsl":
                lines.append(
                    f"| ratio cutedsl / torch{suffix} | | {r['fwd_tflops'] / base['fwd_tflops']:.2f}x | | "
                    f"{r['step_tflops'] / base['step_tflops']:.2f}x |"
                )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
