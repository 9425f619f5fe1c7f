"""The CuTeDSL expert backend on the H200 in one command: numerics against float64 (bf16 beside
torch._grouped_mm's errors, FP8 against the bound of trainer/experts/fp8.py), then each grouped GEMM of the
SwiGLU experts timed alone (torch._grouped_mm, ours in bf16, ours in FP8 per FP8 tile config, the FP8 one
also with the 1x128 quantization of its input; the weight gradients also in FP8, k_grouped_scaled, alone and
with their operands' quantization), then the whole expert forward and forward + backward at the
128-expert shape of bench/moe_bench.py (H2048 I768 E128 top-8, 16k tokens, pre-sorted balanced rows like its
`raw` row), eager and compiled. Prints a table last; writes JSON and the log under $OUT.

    d=$(mktemp -d) && tar -C "$d" -xJf .cutedsl/cutedsl.tar.xz &&
    export PYTHONPATH="$d:$d/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH"
    PYTHONUNBUFFERED=1 python bench/cutedsl_check.py

FLOPs count 2*M*N*K per GEMM; the layer's forward is 3 GEMMs of 2*rows*H*I (gate, up, down), forward +
backward 3x that, as in moe_bench (bf16-equivalent FLOPs for FP8 too). The FP8 layer's time includes the
quantization of its activations; its weights are quantized once per optimizer step (Experts does), outside
the timed step, as their bf16 copies are for the other rows."""

from __future__ import annotations

import argparse
import contextlib
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

from trainer.experts import (  # noqa: E402
    cutedsl,
    cutedsl_experts,
    cutedsl_fp8_experts,
    grouped_mm_experts,
)
from trainer.experts.cutedsl import cutedsl_unavailable, grouped, quant  # noqa: E402
from trainer.experts.cutedsl.grouped import TileConfig  # noqa: E402
from trainer.experts.cutedsl.quant import (  # noqa: E402
    quantize_both_kernel,
    quantize_expert_weights_fast,
    quantize_rows_kernel,
    swiglu_both_kernel,
    swiglu_grad_both_kernel,
)
from trainer.experts.fp8 import (  # noqa: E402
    quantize_blocks,
    quantize_expert_weights,
    quantize_rows,
    quantize_tokens_t,
    swiglu,
    swiglu_grad,
    token_blocks,
)
from trainer.experts.grouped_mm import swiglu_backward  # noqa: E402
from trainer.experts.numerics import relative_errors  # noqa: E402

FP8_CONFIGS = {  # timed per GEMM; the module's FP8_CONFIG first
    "fp8 128x128 s5 cluster2 tma-scales": grouped.FP8_CONFIG,
    "fp8 128x128 s5 cluster2 global-scales": TileConfig((128, 128), 5, cluster_n=2),
    "fp8 128x128 s4 cluster2 tma-scales": TileConfig((128, 128), 4, cluster_n=2, tma_scales=True),
    "fp8 128x128 s5 tma-scales": TileConfig((128, 128), 5, tma_scales=True),
}
FP8_WGRAD_CONFIGS = {  # the k-grouped FP8 GEMM (cutedsl.FP8_WGRAD = "fp8"); the module's FP8_WGRAD_CONFIG first
    "fp8 wgrad 128x128 s4 cluster2 smem-epilogue": grouped.FP8_WGRAD_CONFIG,
    "fp8 wgrad 128x128 s5 cluster2 pair-stores": TileConfig((128, 128), 5, cluster_n=2, tma_scales=True),
}
BF16_CONFIGS = {  # the row-grouped (m) and the wgrad (k) GEMMs; the module's M_CONFIG first
    "bf16 128x256 s4 cluster2": grouped.M_CONFIG,
    "bf16 128x256 s4": TileConfig(),
    "bf16 128x256 s3 smem-epilogue": TileConfig(stages=3, smem_epilogue_fp32=True),  # fp32 wgrads staged too
}
FP8_BOUND = 0.10  # trainer/experts/fp8.py
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
PRECISIONS = {"bf16": cutedsl_experts, "fp8": cutedsl_fp8_experts}


def bench_ms(fn: Callable[[], object], rep_ms: int = 200) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))


def quant_timing(log: list[str], label: str, gbytes: float, fn: Callable[[], object], note=lambda: "") -> None:
    """One quantizer row: `label`, its time and bandwidth and `note()` (a bit check), or the error; printed and
    appended to `log`."""
    guard()
    try:
        ms = bench_ms(fn)
        line = f"{label}: {ms:.4f} ms, {gbytes / ms * 1e3:.0f} GB/s{note()}"
    except Exception as exc:
        line = f"{label}: error {str(exc)[:200]}"
    print(line, flush=True)
    log.append(line)


def same_bits(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> bool:
    """A quantizer's (e4m3 values, scales) equal another's bit for bit."""
    return torch.equal(ours[0].view(torch.uint8), theirs[0].view(torch.uint8)) and torch.equal(ours[1], theirs[1])


def first_call_s(fn: Callable[[], object]) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def numerics(log: list[str]) -> list[dict]:
    """Both precisions on every case (partial tiles, empty experts, long wgrad tails, the bench's H and I), with
    torch._grouped_mm's errors on the same inputs beside them."""
    rows = []
    for precision, fn in PRECISIONS.items():
        for counts, H, inter in NUMERICS_CASES:
            case = f"E{len(counts)} rows {sum(counts)} H{H} I{inter}"
            guard()
            grouped.POISON_OUTPUTS = True
            try:
                ours = relative_errors(fn, counts, H, inter, seed=len(counts), device=DEVICE)
            except Exception as exc:
                traceback.print_exc()
                ours = {"error": repr(exc)[:300]}
            finally:
                grouped.POISON_OUTPUTS = False
            theirs = relative_errors(grouped_mm_experts, counts, H, inter, seed=len(counts), device=DEVICE)
            rows.append({"case": case, "precision": precision, "cutedsl": ours, "grouped_mm": theirs})
            line = f"numerics {precision} | {case}: " + ", ".join(
                f"{k} {ours.get(k, float('nan')):.2e} (grouped_mm {v:.2e})" for k, v in theirs.items()
            )
            print(line + (f" ERROR {ours['error']}" if "error" in ours else ""), flush=True)
            log.append(line)
    return rows


def numerics_ok(rows: list[dict], precision: str) -> bool:
    """bf16 passes within max(5e-3, 1.5x torch._grouped_mm's errors), FP8 within FP8_BOUND, all finite."""
    mine = [r for r in rows if r["precision"] == precision]

    def within(err: float, theirs: float) -> bool:
        return err < (FP8_BOUND if precision == "fp8" else max(5e-3, 1.5 * theirs))

    return bool(mine) and all(
        "error" not in r["cutedsl"] and all(within(r["cutedsl"][k], v) for k, v in r["grouped_mm"].items())
        for r in mine
    )


def codes_off(ours: tuple[torch.Tensor, ...], theirs: tuple[torch.Tensor, ...]) -> str:
    """How many e4m3 codes of a two-way quantizer's q and q_t differ from another's, and by how many codes at most."""
    counts = []
    for a, b in ((ours[0], theirs[0]), (ours[2], theirs[2])):
        diff = (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs()
        counts.append(f"{int((diff > 0).sum())} of {a.numel()} (max {int(diff.max()) if diff.numel() else 0})")
    return "q " + counts[0] + ", q_t " + counts[1]


@contextlib.contextmanager
def setting(module, attr: str, value):
    """module.attr = value inside the block, its old value restored after."""
    old = getattr(module, attr)
    setattr(module, attr, value)
    try:
        yield
    finally:
        setattr(module, attr, old)


def swiglu_rows(inter: int, rows: int, src: torch.Tensor, n: torch.Tensor, log: list[str], rnd) -> None:
    """The SwiGLU's activation and its gradient quantized both ways: computed in bf16 by torch (compiled), then
    quantize_both (cutedsl.SWIGLU_QUANT "torch"), against the fused kernels ("fused") with each sigmoid
    (quant.SIGMOID), with how many codes the fused ones' differ from quantize_both of the fp32 torch values."""
    h = torch.cat([rnd(rows, inter, scale=3.0), rnd(rows, inter)], dim=-1)  # gate | up
    grad_act = rnd(rows, inter)

    @torch.compile(dynamic=False)
    def act_bf16(h):
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @torch.compile(dynamic=False)
    def grad_h_bf16(grad_act, h):
        gate, up = h.chunk(2, dim=-1)
        return swiglu_backward(grad_act, gate, up, torch.nn.functional.silu(gate))

    act_bytes = rows * inter * 6 / 1e9  # h read, q and q_t written (the fused kernel's traffic)
    grad_bytes = rows * inter * 10 / 1e9  # grad_act and h read, q and q_t of grad_h written
    cases = (
        (
            f"swiglu act {tuple(h.shape)}",
            act_bytes,
            lambda: quantize_both_kernel(act_bf16(h), src, n),
            lambda: swiglu_both_kernel(h, src, n),
            lambda: quantize_both_kernel(swiglu(h), src, n),
        ),
        (
            f"swiglu grad_h {tuple(grad_act.shape)}",
            grad_bytes,
            lambda: quantize_both_kernel(grad_h_bf16(grad_act, h), src, n),
            lambda: swiglu_grad_both_kernel(grad_act, h, src, n),
            lambda: quantize_both_kernel(swiglu_grad(grad_act, h), src, n),
        ),
    )
    for label, gbytes, unfused, fused, reference in cases:
        quant_timing(log, f"{label}: torch.compile + quantize_both", gbytes, unfused)
        for sigmoid in quant.SIGMOIDS:  # the kernels' sigmoid by IEEE division, and by the reciprocal estimate
            with setting(quant, "SIGMOID", sigmoid):
                quant_timing(
                    log,
                    f"{label}: fused, sigmoid {sigmoid}",
                    gbytes,
                    fused,
                    lambda fused=fused, ref=reference: (
                        f" (codes off the fp32 torch values': {codes_off(fused(), ref())})"
                    ),
                )


def gemm_rows(H: int, inter: int, E: int, rows: int, log: list[str], fp8: bool, quant_only: bool = False) -> list[dict]:
    """The GEMMs alone: torch._grouped_mm, ours in bf16, and (the four row-grouped ones) ours in FP8 per config,
    from operands quantized beforehand, and the module's FP8 config with the input's quantization timed too. The
    quantizers first (into `log`); with quant_only, only they."""
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).bfloat16()

    counts = torch.full((E,), rows // E, device="cuda")
    counts[: rows % E] += 1
    offs = counts.cumsum(0).int()
    x, act, grad_y, grad_h = rnd(rows, H), rnd(rows, inter), rnd(rows, H), rnd(rows, 2 * inter)
    w1, w2 = rnd(E, 2 * inter, H, scale=0.02), rnd(E, H, inter, scale=0.02)
    items = grouped.work_items(offs, rows, 128)
    quantize = quantize_rows_kernel
    q = {name: quantize(t) for name, t in (("x", x), ("act", act), ("grad_y", grad_y), ("grad_h", grad_h))}
    compiled_quantize = torch.compile(quantize_rows, dynamic=False)
    for name, t in (("x", x), ("act", act), ("grad_h", grad_h)):
        eager = quantize_rows(t)
        note = f" (cutedsl bits == torch eager: {same_bits(q[name], eager)})"
        gbytes = (t.numel() * (t.element_size() + 1) + eager[1].numel() * 4) / 1e9
        for impl, fn in (
            ("torch eager", lambda t=t: quantize_rows(t)),
            ("torch.compile", lambda t=t: compiled_quantize(t)),
            ("cutedsl", lambda t=t: quantize_rows_kernel(t)),
        ):
            quant_timing(log, f"quantize {name} {tuple(t.shape)}: {impl}", gbytes, fn, lambda note=note: note)
    masters = (w1.float(), w2.float())  # the weight pack is made from the fp32 masters once per optimizer step
    gbytes = sum(m.numel() * (4 + 2) for m in masters) / 1e9  # read fp32, write e4m3 and its transpose
    for impl, fn in (
        ("torch", lambda: quantize_expert_weights(*masters)),
        ("cutedsl", lambda: quantize_expert_weights_fast(*masters)),
    ):
        quant_timing(log, f"quantize weights (pack) fp32 {tuple(w1.shape)} + {tuple(w2.shape)}: {impl}", gbytes, fn)
    # Both at once (quantize_both, what the FP8 weight gradients need of each): the tensor read once, both copies
    # written, over padded blocks made once for all four (as the backend does).
    ends, src, n, _ = token_blocks(offs, rows)

    def both_bits(t: torch.Tensor) -> bool:
        got = (*quantize_both_kernel(t, src, n), ends)
        return same_bits(got[:2], quantize_rows(t)) and same_bits(got[2:], quantize_tokens_t(t, offs))

    for name, t in (("x", x), ("act", act), ("grad_y", grad_y), ("grad_h", grad_h)):
        quant_timing(
            log,
            f"quantize_both {name} {tuple(t.shape)}: cutedsl",
            t.numel() * (t.element_size() + 2) / 1e9,
            lambda t=t: quantize_both_kernel(t, src, n),
            lambda t=t: f" (bits == torch: {both_bits(t)})",
        )
    swiglu_rows(inter, rows, src, n, log, rnd)
    if quant_only:
        return []
    w = {
        "w1": quantize_blocks(w1),
        "w2": quantize_blocks(w2),
        "w1t": quantize_blocks(w1.transpose(1, 2).contiguous()),
        "w2t": quantize_blocks(w2.transpose(1, 2).contiguous()),
    }
    gemms = {  # name: (flops, torch fn, ours bf16, FP8 operands (input, bf16 input, weight) or None)
        "fwd gate_up": (
            2 * rows * H * 2 * inter,
            lambda: torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs),
            lambda cfg: grouped.m_grouped(x, w1.permute(1, 2, 0), offs, items, cfg),
            ("x", x, "w1"),
        ),
        "fwd down": (
            2 * rows * inter * H,
            lambda: torch._grouped_mm(act, w2.transpose(-2, -1), offs=offs),
            lambda cfg: grouped.m_grouped(act, w2.permute(1, 2, 0), offs, items, cfg),
            ("act", act, "w2"),
        ),
        "dgrad act": (
            2 * rows * H * inter,
            lambda: torch._grouped_mm(grad_y, w2, offs=offs),
            lambda cfg: grouped.m_grouped(grad_y, w2.permute(2, 1, 0), offs, items, cfg),
            ("grad_y", grad_y, "w2t"),
        ),
        "dgrad x": (
            2 * rows * 2 * inter * H,
            lambda: torch._grouped_mm(grad_h, w1, offs=offs),
            lambda cfg: grouped.m_grouped(grad_h, w1.permute(2, 1, 0), offs, items, cfg),
            ("grad_h", grad_h, "w1t"),
        ),
        "wgrad down (ours fp32 out)": (
            2 * rows * H * inter,
            lambda: torch._grouped_mm(grad_y.t(), act, offs=offs),
            lambda cfg: grouped.k_grouped(grad_y, act, offs, torch.float32, cfg),
            None,
        ),
        "wgrad gate_up (ours fp32 out)": (
            2 * rows * 2 * inter * H,
            lambda: torch._grouped_mm(grad_h.t(), x, offs=offs),
            lambda cfg: grouped.k_grouped(grad_h, x, offs, torch.float32, cfg),
            None,
        ),
    }
    out = []

    def run(name: str, impl: str, flops: float, fn: Callable[[], torch.Tensor], ref: torch.Tensor | None) -> None:
        row: dict = {"gemm": name, "impl": impl}
        guard(60.0)  # one compile and a 200 ms timing: a schedule that deadlocks is named within a minute
        print(f"{name}: {impl} ...", flush=True)
        try:
            row["first_call_s"] = first_call_s(fn)
            if ref is not None:
                got = fn().float()
                row["rel_diff_vs_torch"] = float((got - ref.float()).norm() / ref.float().norm())
            row["ms"] = bench_ms(fn)
            row["tflops"] = flops / row["ms"] / 1e9
        except Exception as exc:
            traceback.print_exc()
            row["error"] = repr(exc)[:300]
        out.append(row)
        line = f"{name}: {impl} " + " ".join(f"{k}={v}" for k, v in row.items() if k not in ("gemm", "impl"))
        print(line, flush=True)
        log.append(line)

    for name, (flops, torch_fn, ours, fp8_ops) in gemms.items():
        ref = torch_fn()
        run(name, "torch._grouped_mm", flops, torch_fn, None)
        for cname, cfg in BF16_CONFIGS.items():
            run(name, f"cutedsl {cname}", flops, lambda cfg=cfg, ours=ours: ours(cfg), ref)
        if fp8_ops is None or not fp8:
            continue
        qname, raw, wname = fp8_ops
        for cname, cfg in FP8_CONFIGS.items():
            run(
                name,
                f"cutedsl {cname}",
                flops,
                lambda cfg=cfg, qname=qname, wname=wname: grouped.m_grouped_scaled(
                    *q[qname], *w[wname], offs, items, cfg
                ),
                ref,
            )
        run(
            name,
            "cutedsl fp8 + input quantization",
            flops,
            lambda raw=raw, wname=wname: grouped.m_grouped_scaled(*quantize(raw), *w[wname], offs, items),
            ref,
        )
    # The FP8 weight gradients (cutedsl.FP8_WGRAD = "fp8"): both operands quantized per feature and 128-token
    # block of one expert (the transposed half of quantize_both), then the k-grouped FP8 GEMM; fp32 out, as ours
    # in bf16.
    for name, a, b in (("wgrad down (ours fp32 out)", grad_y, act), ("wgrad gate_up (ours fp32 out)", grad_h, x)):
        flops = gemms[name][0]
        ref = gemms[name][1]()
        guard()
        try:
            (a_t, sa), (b_t, sb) = quantize_both_kernel(a, src, n)[2:], quantize_both_kernel(b, src, n)[2:]
        except Exception as exc:
            traceback.print_exc()
            out.append({"gemm": name, "impl": "cutedsl fp8 wgrad", "error": repr(exc)[:300]})
            continue
        for config_name, config in FP8_WGRAD_CONFIGS.items():
            run(
                name,
                f"cutedsl {config_name}",
                flops,
                lambda a_t=a_t, sa=sa, b_t=b_t, sb=sb, ends=ends, config=config: grouped.k_grouped_scaled(
                    a_t, sa, b_t, sb, ends, torch.float32, config
                ),
                ref,
            )
        # The same with a bf16 output (its 16-byte shared-memory epilogue): how much the fp32 stores cost.
        run(
            name,
            "cutedsl fp8 wgrad, bf16 out",
            flops,
            lambda a_t=a_t, sa=sa, b_t=b_t, sb=sb, ends=ends: grouped.k_grouped_scaled(
                a_t, sa, b_t, sb, ends, torch.bfloat16
            ),
            ref,
        )
        run(
            name,
            "cutedsl fp8 wgrad + two-way quantization",
            flops,
            lambda a=a, b=b: grouped.k_grouped_scaled(
                *quantize_both_kernel(a, src, n)[2:], *quantize_both_kernel(b, src, n)[2:], ends, torch.float32
            ),
            ref,
        )
    return out


M_GEMMS = ("fwd gate_up", "fwd down", "dgrad act", "dgrad x")
K_GEMMS = ("wgrad down (ours fp32 out)", "wgrad gate_up (ours fp32 out)")
MAX_REL_DIFF = {"bf16": 0.01, "fp8": 0.08}  # against torch's bf16 result: a config beyond it computes wrong


def choose_configs(rows: list[dict]) -> dict:
    """The fastest config of each kind over the GEMMs it runs (summed milliseconds; every GEMM timed and within
    MAX_REL_DIFF), set as the module's config for the layer rows; and the expert GEMMs' forward + backward
    totals: torch._grouped_mm's six, ours in bf16, ours with the four row-grouped GEMMs in FP8."""

    def total(impl: str, gemms: tuple[str, ...], bound: float) -> float | None:
        got = [r for r in rows if r["impl"] == impl and r["gemm"] in gemms]
        ok = len(got) == len(gemms) and all("ms" in r and r.get("rel_diff_vs_torch", 0.0) < bound for r in got)
        return sum(r["ms"] for r in got) if ok else None

    chosen: dict = {}
    for kind, configs, gemms, bound, attr in (
        ("m", BF16_CONFIGS, M_GEMMS, MAX_REL_DIFF["bf16"], "M_CONFIG"),
        ("k", BF16_CONFIGS, K_GEMMS, MAX_REL_DIFF["bf16"], "K_CONFIG"),
        ("fp8", FP8_CONFIGS, M_GEMMS, MAX_REL_DIFF["fp8"], "FP8_CONFIG"),
        ("fp8 wgrad", FP8_WGRAD_CONFIGS, K_GEMMS, MAX_REL_DIFF["fp8"], "FP8_WGRAD_CONFIG"),
    ):
        times = {name: t for name in configs if (t := total(f"cutedsl {name}", gemms, bound)) is not None}
        if times:
            best = min(times, key=times.__getitem__)
            setattr(grouped, attr, configs[best])
            chosen[kind] = {"config": best, "ms": times[best], "all_ms": times}
    torch_ms = total("torch._grouped_mm", M_GEMMS + K_GEMMS, float("inf"))
    torch_wgrad_ms = total("torch._grouped_mm", K_GEMMS, float("inf"))
    if torch_ms and torch_wgrad_ms and "m" in chosen and "k" in chosen:
        # The weight gradients as the backend computes them (cutedsl.WGRAD) for bf16 weights, the output these GEMM
        # rows compare: torch's kernel ("auto" takes it there) or ours.
        wgrad_ms = torch_wgrad_ms if cutedsl.WGRAD in ("grouped_mm", "auto") else chosen["k"]["ms"]
        chosen["wgrad"] = {"by": cutedsl.WGRAD, "ms": wgrad_ms}
        bf16_ms = chosen["m"]["ms"] + wgrad_ms
        chosen["fwd+bwd ms"] = {"torch._grouped_mm": torch_ms, "cutedsl bf16": bf16_ms}
        if "fp8" in chosen:
            chosen["fwd+bwd ms"]["cutedsl fp8 (bf16 wgrad)"] = chosen["fp8"]["ms"] + wgrad_ms
            if "fp8 wgrad" in chosen:
                chosen["fwd+bwd ms"]["cutedsl fp8 (fp8 wgrad)"] = chosen["fp8"]["ms"] + chosen["fp8 wgrad"]["ms"]
        chosen["speedup over torch"] = {k: torch_ms / v for k, v in chosen["fwd+bwd ms"].items()}
    return chosen


def layer_rows(H: int, inter: int, E: int, k: int, tokens: int, fp8: bool, eager: bool) -> list[dict]:
    """The expert SwiGLU forward and forward + backward, balanced pre-sorted rows (moe_bench's raw row), each
    backend under torch.compile (eager too with `eager`), in two settings: bf16 weights, and fp32 masters with the
    per-step copy the GEMMs read (bf16, or the FP8 pack), as training runs (trainer.model.moe.ExpertWeights). With
    fp32 masters torch's weight gradients are cast from its bf16 result (cutedsl.WGRAD "grouped_mm"), ours are
    written in fp32 (our kernels' "auto" there); rows name which."""
    rows = tokens * k
    x = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.full((E,), rows // E, device="cuda")
    counts[: rows % E] += 1
    offs = counts.cumsum(0).to(torch.int32)
    grad = torch.randn(rows, H, device="cuda", dtype=torch.bfloat16)
    fwd_flops = 2 * rows * 3 * H * inter
    res = []
    for masters in (torch.float32, torch.bfloat16):  # training's case first
        w1 = (torch.randn(E, 2 * inter, H, device="cuda", dtype=masters) * 0.02).requires_grad_()
        w2 = (torch.randn(E, H, inter, device="cuda", dtype=masters) * 0.02).requires_grad_()
        tag = "" if masters == torch.bfloat16 else ", fp32 masters"
        impls = layer_impls(x, offs, w1, w2, fp8)
        compiled = [(f"{name} compiled", torch.compile(fn), sets) for name, fn, sets in impls]
        impls = (impls if eager else []) + compiled
        impls.append(("torch._grouped_mm again", compiled[0][1], {}))  # its spread says how much is noise
        for name, fn, sets in impls:

            def fwd(fn=fn):
                with torch.no_grad():
                    return fn()

            def step(fn=fn, sets=sets, w1=w1, w2=w2):
                x.grad = w1.grad = w2.grad = None
                with contextlib.ExitStack() as settings:
                    for attr, value in sets.items():  # quant's SIGMOID, or cutedsl's settings
                        settings.enter_context(setting(quant if attr == "SIGMOID" else cutedsl, attr, value))
                    fn().backward(grad)

            guard()
            try:
                step()
                f_ms, s_ms = bench_ms(fwd, 1000), bench_ms(step, 1000)
                res.append(
                    {
                        "impl": name + tag,
                        "fwd_ms": f_ms,
                        "fwd_tflops": fwd_flops / f_ms / 1e9,
                        "step_ms": s_ms,
                        "step_tflops": 3 * fwd_flops / s_ms / 1e9,
                    }
                )
            except Exception as exc:
                traceback.print_exc()
                res.append({"impl": name + tag, "error": repr(exc)[:300]})
            print("layer", json.dumps(res[-1]), flush=True)
        del w1, w2, impls, compiled
    return res


def layer_impls(x: torch.Tensor, offs: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, fp8: bool) -> list:
    """layer_rows' rows for one pair of masters: (name, fn, module settings for the whole step: the backward
    reads them when it runs or is traced). Each row its own function: torch.compile caches its graph per code
    object, settings unseen. The weight copy (bf16, or the FP8 pack) is made once, as per optimizer step in
    training; for bf16 masters the bf16 copy is the weights themselves. The unnamed rows take the defaults
    (WGRAD and FP8_WGRAD "auto"); the others name what they change."""
    pack = quantize_expert_weights_fast(w1.detach(), w2.detach())
    copy = (w1.detach().bfloat16(), w2.detach().bfloat16())
    torch_wgrad = {"WGRAD": "grouped_mm", "FP8_WGRAD": "bf16"}
    impls: list[tuple[str, Callable, dict]] = [
        ("torch._grouped_mm", lambda: grouped_mm_experts(x, offs, w1, w2, copy), {}),
        ("cutedsl bf16", lambda: cutedsl_experts(x, offs, w1, w2, copy), {}),
    ]
    fp32 = w1.dtype == torch.float32
    if fp32:
        impls.append(("cutedsl bf16, torch wgrad", lambda: cutedsl_experts(x, offs, w1, w2, copy), torch_wgrad))
    if not fp8:
        return impls
    impls.append(("cutedsl fp8", lambda: cutedsl_fp8_experts(x, offs, w1, w2, pack), {}))
    unfused = {"SWIGLU_QUANT": "torch"}
    if fp32:
        impls += [
            ("cutedsl fp8, unfused SwiGLU", lambda: cutedsl_fp8_experts(x, offs, w1, w2, pack), unfused),
            ("cutedsl fp8, rcp sigmoid", lambda: cutedsl_fp8_experts(x, offs, w1, w2, pack), {"SIGMOID": "rcp"}),
            ("cutedsl fp8, bf16 wgrad", lambda: cutedsl_fp8_experts(x, offs, w1, w2, pack), {"FP8_WGRAD": "bf16"}),
        ]
    else:
        impls += [
            ("cutedsl fp8, fp8 wgrad", lambda: cutedsl_fp8_experts(x, offs, w1, w2, pack), {"FP8_WGRAD": "fp8"}),
            (
                "cutedsl fp8, fp8 wgrad, unfused SwiGLU",
                lambda: cutedsl_fp8_experts(x, offs, w1, w2, pack),
                {"FP8_WGRAD": "fp8", **unfused},
            ),
        ]
    return impls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="2048,768,128,8", help="H,I,E,top-k (moe_bench's 128-expert shape)")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--skip-gemms", action="store_true", help="no per-GEMM timings")
    ap.add_argument("--skip-layer", action="store_true", help="no expert layer rows")
    ap.add_argument("--layer-eager", action="store_true", help="the expert layer eager too, not only compiled")
    ap.add_argument("--quant-only", action="store_true", help="only the quantizers' timings, then exit")
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
    if args.quant_only:  # no numerics pass: the quantizers' bits are checked against torch's in their rows
        gemm_rows(H, inter, E, args.tokens * k, log, True, quant_only=True)
        results["quantizers"] = log
        save()
        return
    results["numerics"] = numerics(log)
    results["numerics_ok"] = {p: numerics_ok(results["numerics"], p) for p in PRECISIONS}
    print(f"within the bounds: {results['numerics_ok']}", flush=True)
    save()
    fp8 = results["numerics_ok"]["fp8"]  # an FP8 kernel that computes wrong is not worth timing
    if not args.skip_gemms:
        results["gemms"] = gemm_rows(H, inter, E, args.tokens * k, log, fp8)
        results["chosen"] = choose_configs(results["gemms"])
        print("chosen for the layer rows:", json.dumps(results["chosen"]), flush=True)
        save()
    if not args.skip_layer:
        results["layer"] = layer_rows(H, inter, E, k, args.tokens, fp8, args.layer_eager)
        save()
    print(table(results))


def table(results: dict) -> str:
    lines = [f"{results['device']}, torch {results['torch']}, CuTeDSL {results['cutlass_dsl']}, {results['shape']}", ""]
    lines += [
        "rel. error vs float64, cutedsl (torch._grouped_mm): out, grad x, grad gate_up, grad down",
        "| precision | case | out | grad x | grad gate_up | grad down |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["numerics"]:
        ours, theirs = r["cutedsl"], r["grouped_mm"]
        cells = " | ".join(
            (f"{ours[n]:.1e}" if n in ours else "err") + f" ({theirs[n]:.1e})"
            for n in ("out", "grad_x", "grad_gate_up", "grad_down")
        )
        lines.append(f"| {r['precision']} | {r['case']} | {cells} |")
    if "gemms" in results:
        lines += [
            "",
            "| GEMM | impl | ms | TFLOP/s | x torch | rel diff vs torch |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        base: dict[str, float] = {}
        for r in results["gemms"]:
            if "error" in r:
                lines.append(f"| {r['gemm']} | {r['impl']} | error: {r['error'][:80]} | | | |")
                continue
            base.setdefault(r["gemm"], r["ms"])
            lines.append(
                f"| {r['gemm']} | {r['impl']} | {r['ms']:.3f} | {r['tflops']:.0f} | {base[r['gemm']] / r['ms']:.2f}x | "
                f"{r.get('rel_diff_vs_torch', 0):.1e} |"
            )
    chosen = results.get("chosen", {})
    if "fwd+bwd ms" in chosen:
        lines += ["", "| the six expert GEMMs, fwd+bwd | ms | speedup over torch._grouped_mm |", "| --- | --- | --- |"]
        for impl, ms in chosen["fwd+bwd ms"].items():
            lines.append(f"| {impl} | {ms:.3f} | {chosen['speedup over torch'][impl]:.2f}x |")
        lines.append("chosen configs: " + ", ".join(f"{k} {v['config']}" for k, v in chosen.items() if "config" in v))
        lines.append(f"weight gradients by cutedsl.WGRAD = {chosen['wgrad']['by']!r} for bf16 weights")
    lines += [
        "",
        "| expert SwiGLU | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s | fwd+bwd time / torch compiled |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    rows = results.get("layer", [])
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['impl']} | error: {r['error'][:100]} | | | | |")
            continue
        tag = ", fp32 masters" if r["impl"].endswith(", fp32 masters") else ""
        ref = next((t for t in rows if t["impl"] == f"torch._grouped_mm compiled{tag}" and "error" not in t), None)
        ratio = f"{r['step_ms'] / ref['step_ms']:.2f}x" if ref else ""
        lines.append(
            f"| {r['impl']} | {r['fwd_ms']:.3f} | {r['fwd_tflops']:.0f} | {r['step_ms']:.3f} | "
            f"{r['step_tflops']:.0f} | {ratio} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
