"""MoE training speed on one GPU: the raw rates (dense bf16 matmul, torch._grouped_mm SwiGLU experts)
next to our MoE layer (router, sort-based permutation, grouped GEMMs, combine; forward + backward)
for the four expert shapes of shared/notes/h200.md, and moonlet end to end (tokens/s and MFU).

    python bench/moe_bench.py [--out results.json]      # on the GPU
    python bench/moe_bench.py --smoke                   # tiny shapes on the CPU, to debug the script

MoE-layer TFLOP/s count expert FLOPs only (3 GEMMs of 2*H*I per routed token-expert pair, x3 for
forward + backward) while the time includes routing and permutation. Model FLOPs of moonlet are
6 x active parameters x tokens plus causal attention (scores and values), over 989 TFLOP/s (H200
dense bf16 datasheet) and over the dense rate measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import ModelConfig, load_config  # noqa: E402
from trainer.experts import grouped_mm_experts, reference_experts, select_backend  # noqa: E402
from trainer.model import attention_flops_per_token, build_model, compile_blocks, count_params  # noqa: E402
from trainer.model.moe import MoE  # noqa: E402
from trainer.optim import Optimizer, autocast  # noqa: E402

H200_PEAK = 989e12
SHAPES = [  # (hidden, expert intermediate, experts, top-k): shared/notes/h200.md
    (2048, 1408, 64, 6),
    (2048, 768, 128, 8),
    (1024, 512, 64, 8),
    (4096, 2048, 16, 2),
]
SMOKE_SHAPES = [(64, 32, 8, 2), (32, 16, 4, 1)]


@dataclass
class Row:
    what: str
    tflops: float
    ms: float
    note: str = ""


def bench_ms(fn: Callable[[], object], device: torch.device, reps: int) -> float:
    """Median milliseconds of fn after warm-up (CUDA events through triton's do_bench on GPUs)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=50, rep=max(reps * 20, 200), return_mode="median"))
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def dense_rate(device: torch.device, dtype: torch.dtype, n: int, reps: int) -> Row:
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    ms = bench_ms(lambda: a @ b, device, reps)
    return Row(f"dense matmul {n}^3", 2 * n**3 / ms / 1e9, ms)


def expert_flops(tokens: int, H: int, inter: int, k: int) -> float:
    return 3 * (2 * tokens * k * 3 * H * inter)  # forward + backward


def raw_grouped(device, dtype, H, inter, E, k, tokens, reps) -> Row:
    """torch._grouped_mm SwiGLU over pre-sorted, perfectly balanced rows: the ceiling of the MoE layer."""
    N = tokens * k
    x = torch.randn(N, H, device=device, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(E, 2 * inter, H, device=device, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, inter, device=device, dtype=dtype) * 0.02).requires_grad_()
    counts = torch.full((E,), N // E, device=device)
    counts[: N % E] += 1
    offs = torch.cumsum(counts, 0).to(torch.int32)
    grad = torch.randn(N, H, device=device, dtype=dtype)

    def step():
        x.grad = w1.grad = w2.grad = None
        grouped_mm_experts(x, offs, w1, w2).backward(grad)

    ms = bench_ms(step, device, reps)
    return Row("raw grouped_mm", expert_flops(tokens, H, inter, k) / ms / 1e9, ms)


def moe_layer(device, H, inter, E, k, tokens, backend, compiled, bf16_weights, reps) -> Row:
    """Our MoE layer (no shared experts) forward + backward under bf16 autocast."""
    cfg = ModelConfig(hidden_size=H, moe_intermediate_size=inter, n_routed_experts=E, num_experts_per_tok=k,
                      n_shared_experts=0)  # fmt: skip
    layer = MoE(cfg, backend).to(device).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    if bf16_weights:
        layer.experts.to(torch.bfloat16)
    # bf16 on the CPU too: torch.compile's shape rule for _grouped_mm accepts bf16 only.
    x = torch.randn(1, tokens, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, tokens, H, device=device, dtype=torch.bfloat16)
    fwd = torch.compile(layer) if compiled else layer

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        with autocast(device, "bfloat16"):
            out = fwd(x)
        out.backward(grad)
        layer.tokens_per_expert.zero_()

    ms = bench_ms(step, device, reps)
    name = f"MoE layer {backend}{' compiled' if compiled else ''}{', bf16 weights' if bf16_weights else ''}"
    return Row(name, expert_flops(tokens, H, inter, k) / ms / 1e9, ms)


def check_backends(device: torch.device) -> str:
    """Relative error of grouped_mm against the reference on this device (bf16 on GPUs)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    E, H, inter = 8, 256, 128
    x = torch.randn(1000, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(device, dtype)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(device, dtype)
    offs = torch.tensor([100, 100, 250, 400, 700, 701, 900, 1000], device=device, dtype=torch.int32)
    ref = reference_experts(x.double(), offs, w1.double(), w2.double())
    out = grouped_mm_experts(x, offs, w1, w2).double()
    return f"grouped_mm vs float64 reference on {device.type} {dtype}: rel err {float((out - ref).norm() / ref.norm()):.2e}"


def moonlet(device, cfg_path, batch, seq, steps, compiled, dense_tflops) -> dict:
    cfg = load_config(cfg_path)
    mc = cfg.trainer.model
    dtype_name = cfg.trainer.dtype if device.type == "cuda" else "bfloat16"
    backend = select_backend(cfg.trainer.experts.backend if device.type == "cuda" else "auto", device, torch.bfloat16)
    model = build_model(mc, backend, seed=None, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    if compiled:
        compile_blocks(model)
    opt = Optimizer(model, cfg.trainer.optim)
    tokens = torch.randint(0, mc.vocab_size, (batch, seq + 1), device=device)

    def train_step() -> float:
        with autocast(device, dtype_name):
            logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step(batch * seq)
        return float(loss.detach())

    t0 = time.perf_counter()
    for _ in range(3):
        train_step()
    warm_s = time.perf_counter() - t0
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        train_step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / steps
    total, active = count_params(mc)
    tok_s = batch * seq / dt
    flops_per_token = 6 * active + attention_flops_per_token(mc, seq)
    achieved = flops_per_token * tok_s
    return {
        "params_total": total,
        "params_active": active,
        "batch": batch,
        "seq": seq,
        "compiled": compiled,
        "step_ms": dt * 1e3,
        "warmup_s": warm_s,
        "tokens_per_s": tok_s,
        "model_tflops": achieved / 1e12,
        "mfu_989": achieved / H200_PEAK,
        "mfu_measured_dense": achieved / (dense_tflops * 1e12),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else math.nan,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (debugging the script)")
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per MoE-layer call")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--moonlet-batch", type=int, default=8)
    ap.add_argument("--moonlet-seq", type=int, default=4096)
    ap.add_argument("--moonlet-steps", type=int, default=10)
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip sections that would start after this")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_bench.json"))
    args = ap.parse_args()
    t_start = time.perf_counter()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    smoke = device.type == "cpu"
    dtype = torch.bfloat16
    tokens = 64 if smoke else args.tokens
    reps = 3 if smoke else 10
    shapes = SMOKE_SHAPES if smoke else SHAPES
    results: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu", "torch": torch.__version__}
    results["check"] = check_backends(device)
    print(results["check"], flush=True)
    dense = dense_rate(device, dtype, 256 if smoke else 8192, reps)
    results["dense"] = asdict(dense)
    print(f"{dense.what}: {dense.tflops:.1f} TFLOP/s", flush=True)
    rows_of = {shape: [] for shape in shapes}
    results["shapes"] = [{"shape": f"H{H} I{i} E{E} top-{k}, {tokens} tokens", "rows": rows_of[(H, i, E, k)]}
                         for H, i, E, k in shapes]  # fmt: skip

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=2, default=lambda r: asdict(r)))

    def measure(shape, label, fn, *fn_args) -> None:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipped {label} for {shape}: time budget spent", flush=True)
            return
        try:
            row = fn(*fn_args)
        except Exception as exc:  # report and keep measuring the other variants
            row = Row(label, math.nan, math.nan, repr(exc)[:200])
            traceback.print_exc()
        rows_of[shape].append(row)
        print(f"{shape} | {row.what}: {row.tflops:.1f} TFLOP/s ({row.ms:.3f} ms), {row.tflops / dense.tflops:.0%} of "
              f"dense {row.note}", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()

    # Cheap measurements first, compiled ones (minutes of compile time) last, so a budget cut loses least.
    for H, i, E, k in shapes:
        sh = (H, i, E, k)
        measure(sh, "raw grouped_mm", raw_grouped, device, dtype, H, i, E, k, tokens, reps)
        measure(sh, "MoE eager", moe_layer, device, H, i, E, k, tokens, "grouped_mm", False, False, reps)
        measure(sh, "MoE eager bf16 w", moe_layer, device, H, i, E, k, tokens, "grouped_mm", False, True, reps)
    cfg_path = Path(__file__).resolve().parent.parent / "configs" / ("tiny.toml" if smoke else "moonlet.toml")
    results["moonlet"] = []
    for compiled in [False] if args.no_compile else [False, True]:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipped moonlet compiled={compiled}: time budget spent", flush=True)
            continue
        try:
            b, s = (2, 32) if smoke else (args.moonlet_batch, args.moonlet_seq)
            m = moonlet(device, cfg_path, b, s, 2 if smoke else args.moonlet_steps, compiled, dense.tflops)
        except Exception as exc:
            m = {"compiled": compiled, "error": repr(exc)[:300]}
            traceback.print_exc()
        results["moonlet"].append(m)
        print("moonlet", json.dumps(m), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    if not args.no_compile:
        for H, i, E, k in shapes:
            sh = (H, i, E, k)
            measure(sh, "MoE compiled", moe_layer, device, H, i, E, k, tokens, "grouped_mm", True, False, reps)
            measure(sh, "MoE compiled bf16 w", moe_layer, device, H, i, E, k, tokens, "grouped_mm", True, True, reps)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print(markdown(results))


def markdown(results: dict) -> str:
    dense = results["dense"]["tflops"]
    lines = [f"{results['dense']['what']} (bf16): {dense:.0f} TFLOP/s", "", "| shape | what | TFLOP/s | ms | % of dense |",
             "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for s in results["shapes"]:
        for r in (asdict(r) if isinstance(r, Row) else r for r in s["rows"]):
            lines.append(
                f"| {s['shape']} | {r['what']} | {r['tflops']:.0f} | {r['ms']:.2f} | {r['tflops'] / dense:.0%} |"
            )
    for m in results.get("moonlet", []):
        if "error" in m:
            lines.append(f"\nmoonlet (compiled={m['compiled']}): error {m['error']}")
        else:
            lines.append(
                f"\nmoonlet ({m['params_total'] / 1e9:.2f}B total, {m['params_active'] / 1e9:.3f}B active), batch "
                f"{m['batch']}x{m['seq']}, compiled={m['compiled']}: {m['tokens_per_s']:.0f} tokens/s, step "
                f"{m['step_ms']:.0f} ms, {m['model_tflops']:.0f} TFLOP/s, MFU {m['mfu_989']:.1%} of 989, "
                f"{m['mfu_measured_dense']:.1%} of measured dense, peak mem {m['peak_mem_gib']:.1f} GiB"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
