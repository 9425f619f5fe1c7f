"""MoE training speed on one GPU: the raw rates (dense bf16 matmul; the SwiGLU experts alone through
torch._grouped_mm, our CuTeDSL bf16 and FP8 backends, and torch._scaled_grouped_mm's FP8 forward) next to
our MoE layer (router, sort-based permutation, grouped GEMMs, combine; forward + backward, with bf16 and
with FP8 experts) for the four expert shapes of docs/h200.md, and moonlet end to end (tokens/s and
MFU, bf16 or FP8 experts).

    python bench/moe_bench.py [--out results.json] [--moonlet-precision both]   # on the GPU
    python bench/moe_bench.py --smoke                   # tiny shapes on the CPU, to debug the script

MoE-layer TFLOP/s count expert FLOPs only (3 GEMMs of 2*H*I per routed token-expert pair, x3 for
forward + backward) while the time includes routing and permutation. Model FLOPs of moonlet are
6 x active parameters x tokens plus causal attention (scores and values), over 989 TFLOP/s (H200
dense bf16 datasheet) and over the dense rate measured in the same run; with FP8 experts the FLOPs are
counted the same way (bf16-equivalent), so the MFU of the two precisions compares their times. A row that
names another (`vs`) gets its time ratio in the table: the FP8 compiled layer's target is <= 0.70x of the
bf16 one (issue 16). A backend that cannot run here gives a row "unavailable: <reason>", not a failed run.
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

import trainer.model.moe as moe_module  # noqa: E402
from common.config import ModelConfig, OptimConfig, load_config  # noqa: E402
from trainer.experts import (  # noqa: E402
    BACKENDS,
    BackendUnavailable,
    grouped_mm_experts,
    reference_experts,
    select_backend,
)
from trainer.experts.cutedsl import cutedsl_unavailable, grouped  # noqa: E402
from trainer.experts.fp8 import quantize_expert_weights  # noqa: E402
from trainer.model import attention_flops_per_token, build_model, compile_blocks, count_params  # noqa: E402
from trainer.model.moe import MoE  # noqa: E402
from trainer.model.permute import combine, permute, select_permute  # noqa: E402
from trainer.optim import Optimizer, autocast  # noqa: E402

H200_PEAK = 989e12
SHAPES = [  # (hidden, expert intermediate, experts, top-k): docs/h200.md
    (2048, 1408, 64, 6),
    (2048, 768, 128, 8),
    (1024, 512, 64, 8),
    (4096, 2048, 16, 2),
]
SMOKE_SHAPES = [(64, 32, 8, 2), (32, 16, 4, 1)]
VARIANTS = [
    "raw",
    "raw-cutedsl",
    "raw-scaled",
    "eager",
    "compiled",
    "compiled-fp8",
    "compiled-bf16w",
    "compiled-percall",
    "compiled-fp32router",
    "compiled-torchperm",
]
FP8_LAYER_TARGET = 0.70  # FP8 compiled layer fwd+bwd time over the bf16 one (issue 16)
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max
EXTRA = {
    "compiled-percall": "per-call cast",
    "compiled-fp32router": "fp32 router GEMM",
    "compiled-torchperm": "torch permute",
}


@dataclass
class Row:
    what: str
    tflops: float
    ms: float
    note: str = ""
    vs: str = ""
    """The `what` of the row (same shape) this one's time is compared to in the table; "" for none."""


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


def balanced_offsets(device: torch.device, rows: int, E: int) -> torch.Tensor:
    """Running ends [E] int32 of `rows` pre-sorted rows spread as evenly as possible over E experts."""
    counts = torch.full((E,), rows // E, device=device)
    counts[: rows % E] += 1
    return torch.cumsum(counts, 0).to(torch.int32)


def raw_grouped(device, dtype, H, inter, E, k, tokens, reps, backend="grouped_mm", precision="bf16") -> Row:
    """An expert backend's SwiGLU (forward + backward) over pre-sorted, perfectly balanced rows: the ceiling
    of the MoE layer. `backend` and `precision` go through select_backend (BackendUnavailable: the reason).
    The weights are bf16; FP8 experts get their FP8 pack made beforehand, as `Experts` makes it once per
    optimizer step, so that no row times a weight cast or quantization."""
    name = select_backend(backend, device, dtype, precision=precision)
    experts = BACKENDS[name]
    N = tokens * k
    x = torch.randn(N, H, device=device, dtype=dtype, requires_grad=True)
    w1 = (torch.randn(E, 2 * inter, H, device=device, dtype=dtype) * 0.02).requires_grad_()
    w2 = (torch.randn(E, H, inter, device=device, dtype=dtype) * 0.02).requires_grad_()
    offs = balanced_offsets(device, N, E)
    grad = torch.randn(N, H, device=device, dtype=dtype)
    cast = quantize_expert_weights(w1, w2) if name == "cutedsl_fp8" else None

    def step():
        x.grad = w1.grad = w2.grad = None
        experts(x, offs, w1, w2, cast).backward(grad)

    ms = bench_ms(step, device, reps)
    vs = "" if name == "grouped_mm" else "raw grouped_mm"
    return Row(f"raw {name}", expert_flops(tokens, H, inter, k) / ms / 1e9, ms, vs=vs)


def launch_cost(device, calls: int = 400) -> Row:
    """Host time of one CuTeDSL grouped-GEMM launch (as grouped.LAUNCH is): `calls` back-to-back launches of a
    GEMM far too small to keep the GPU busy (256 rows, 256x256, 8 experts), so that the wall time per call is
    the host's: argument conversion and the launch. `ms` is per launch."""
    if (why := cutedsl_unavailable(device, torch.bfloat16)) is not None:
        raise BackendUnavailable(why)
    a = torch.randn(256, 256, device=device, dtype=torch.bfloat16)
    w = torch.randn(8, 256, 256, device=device, dtype=torch.bfloat16).permute(1, 2, 0)
    offs = balanced_offsets(device, 256, 8)
    items = grouped.work_items(offs, 256, grouped.M_CONFIG.tile_mn[0])
    for _ in range(20):
        grouped.m_grouped(a, w, offs, items)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        grouped.m_grouped(a, w, offs, items)
    host_ms = (time.perf_counter() - t0) * 1e3 / calls
    torch.cuda.synchronize()
    return Row("one cutedsl launch, host time", math.nan, host_ms, "ms per launch, host wall time")


def quantize_rowwise(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3: t [..., R, C] -> (e4m3 [..., R, C], fp32 scales [..., R]) with t ~= q * scale[..., None]."""
    amax = t.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    return (t.float() / scale).to(torch.float8_e4m3fn), scale.squeeze(-1)


def raw_scaled_forward(device, H, inter, E, k, tokens, reps) -> Row:
    """torch._scaled_grouped_mm SwiGLU experts, FORWARD ONLY, over the rows of `raw_grouped`: rowwise e4m3
    quantization of x (one fp32 scale per row; amax, scale, cast: one compiled kernel on GPUs), the gate_up
    GEMM (bf16 out), SwiGLU, rowwise quantization of the activation, the down GEMM (bf16 out), default (slow,
    promoted) accumulation. The weights are quantized per output row beforehand, as a per-optimizer-step copy
    would be, and not timed. The note holds torch._grouped_mm's bf16 forward of the same rows (time, ratio)
    and the FP8 output's relative error against it. FLOPs: the forward's 3 GEMMs of 2*H*I per row."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise BackendUnavailable(f"torch {torch.__version__} has no torch._scaled_grouped_mm (absent)")
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        raise BackendUnavailable(f"torch._scaled_grouped_mm runs on sm90+ GPUs only, not on {device.type}")
    N = tokens * k
    x = torch.randn(N, H, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(E, 2 * inter, H, device=device, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(E, H, inter, device=device, dtype=torch.bfloat16) * 0.02
    offs = balanced_offsets(device, N, E)
    torch._dynamo.reset()  # fresh compilations (x, activation) instead of piling onto the recompile limit
    quantize = torch.compile(quantize_rowwise)
    (w1q, w1s), (w2q, w2s) = quantize_rowwise(w1), quantize_rowwise(w2)  # [E, 2I, H], [E, 2I]; [E, H, I], [E, H]

    def fp8_forward() -> torch.Tensor:
        xq, xs = quantize(x)
        h = torch._scaled_grouped_mm(xq, w1q.transpose(-2, -1), xs, w1s, offs=offs, out_dtype=torch.bfloat16)
        gate, up = h.chunk(2, dim=-1)
        aq, as_ = quantize(F.silu(gate) * up)
        return torch._scaled_grouped_mm(aq, w2q.transpose(-2, -1), as_, w2s, offs=offs, out_dtype=torch.bfloat16)

    def bf16_forward() -> torch.Tensor:
        gate, up = torch._grouped_mm(x, w1.transpose(-2, -1), offs=offs).chunk(2, dim=-1)
        return torch._grouped_mm(F.silu(gate) * up, w2.transpose(-2, -1), offs=offs)

    ref = bf16_forward().float()
    err = float((fp8_forward().float() - ref).norm() / ref.norm())
    ms = bench_ms(fp8_forward, device, reps)
    ms_bf16 = bench_ms(bf16_forward, device, reps)
    flops = 2 * N * 3 * H * inter
    note = f"bf16 torch._grouped_mm forward {ms_bf16:.3f} ms ({ms / ms_bf16:.2f}x), rel err vs it {err:.1e}"
    return Row("raw torch._scaled_grouped_mm fp8 rowwise, forward only", flops / ms / 1e9, ms, note)


def moe_layer(device, H, inter, E, k, tokens, backend, compiled, bf16_weights, reps, variant="", profile=None) -> Row:
    """Our MoE layer (no shared experts) forward + backward under bf16 autocast. With fp32 weights the
    grouped GEMMs use the bf16 copy `Experts` keeps per optimizer step (no step is taken here, so this is
    the cost per micro-batch; `weight_refresh` times the copy). variant "per-call cast" makes no copy, so
    the weights are cast in every call (the layer before the copy), "fp32 router GEMM" computes the router logits with
    an fp32 GEMM instead of the split-bf16 one, "torch permute" permutes and combines with index_select
    (inductor's gathers) instead of the Triton row kernels. Compiled variants start from a reset dynamo
    cache, so that earlier shapes and moonlet cannot push this one over the recompile limit into eager."""
    cfg = ModelConfig(
        hidden_size=H, moe_intermediate_size=inter, n_routed_experts=E, num_experts_per_tok=k, n_shared_experts=0
    )
    layer = MoE(cfg, backend, permute="torch" if variant == "torch permute" else "auto").to(device).train()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.02)
    if bf16_weights:
        layer.experts.to(torch.bfloat16)
    if not bf16_weights and variant != "per-call cast":
        layer.experts.weight_copy(torch.bfloat16)  # what the first optimizer step would make
    restore = moe_module.router_logits
    if variant == "fp32 router GEMM":
        moe_module.router_logits = lambda x, w: F.linear(x.float(), w.float())
    # bf16 on the CPU too: torch.compile's shape rule for _grouped_mm accepts bf16 only.
    x = torch.randn(1, tokens, H, device=device, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(1, tokens, H, device=device, dtype=torch.bfloat16)
    if compiled:
        torch._dynamo.reset()
    fwd = torch.compile(layer) if compiled else layer

    def step():
        x.grad = None
        for p in layer.parameters():
            p.grad = None
        with autocast(device, "bfloat16"):
            out = fwd(x)
        out.backward(grad)
        layer.tokens_per_expert.zero_()

    try:
        ms = bench_ms(step, device, reps)
        if profile is not None:
            profile_step(step, device, profile, ms)
    finally:
        moe_module.router_logits = restore
    name = f"MoE layer {backend}{' compiled' if compiled else ''}{', bf16 weights' if bf16_weights else ''}"
    return Row(name + (f", {variant}" if variant else ""), expert_flops(tokens, H, inter, k) / ms / 1e9, ms)


def fp8_layer(device, H, inter, E, k, tokens, reps, profile=None) -> Row:
    """The compiled MoE layer (fp32 masters, their FP8 pack made beforehand as an optimizer step makes it) with
    the FP8 experts select_backend gives, compared to the compiled grouped_mm layer of the same shape (issue
    16's target: <= 0.70x its time)."""
    backend = select_backend("cutedsl", device, torch.bfloat16, precision="fp8")
    row = moe_layer(device, H, inter, E, k, tokens, backend, True, False, reps, profile=profile)
    row.vs = "MoE layer grouped_mm compiled"
    return row


def profile_step(step: Callable[[], object], device: torch.device, path: str, step_ms: float) -> None:
    """Kernel time table of 3 steps (torch.profiler), printed and written to `path`, headed by the GPU's busy
    share of a step: the kernels' time per step over `step_ms` (the step measured without the profiler). Far
    below 100%, the host's launches set the pace, not the kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    events = prof.key_averages()
    head = f"step {step_ms:.3f} ms (unprofiled)"
    if device.type == "cuda":
        kernel_ms = sum(e.self_device_time_total for e in events if e.device_type == DeviceType.CUDA) / 1e3 / 3
        head += f"; kernels {kernel_ms:.3f} ms per step: GPU busy {kernel_ms / step_ms:.0%}"
    key = "cuda_time_total" if device.type == "cuda" else "cpu_time_total"
    table = head + "\n" + events.table(sort_by=key, row_limit=30, max_name_column_width=70)
    Path(path).write_text(table)
    print(table, flush=True)


def weight_refresh(device, H, inter, E, reps) -> Row:
    """The once-per-optimizer-step refresh of the bf16 expert weight copy (fp32 -> bf16, in place)."""
    cfg = ModelConfig(hidden_size=H, moe_intermediate_size=inter, n_routed_experts=E, n_shared_experts=0)
    ex = MoE(cfg, "grouped_mm").to(device).experts
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.02)
    ex.weight_copy(torch.bfloat16)
    refresh = ex.refresh_weight_copy  # what the optimizer's post-step hook calls

    ms = bench_ms(refresh, device, reps)
    return Row("bf16 weight copy refresh (per optimizer step)", math.nan, ms)


def check_backends(device: torch.device) -> str:
    """Relative errors against a float64 reference on this device: grouped_mm experts (bf16 GEMMs on the
    bf16 weight copy, fp32 master gradients; fp32 on the CPU) and the split-bf16 router logits; and the
    weight copy following a (fused, on GPUs) optimizer step bitwise."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator(device="cpu").manual_seed(0)
    E, H, inter = 8, 256, 128
    x = torch.randn(1000, H, generator=g).to(device, dtype)
    w1 = (torch.randn(E, 2 * inter, H, generator=g) * 0.05).to(device)
    w2 = (torch.randn(E, H, inter, generator=g) * 0.05).to(device)
    offs = torch.tensor([100, 100, 250, 400, 700, 701, 900, 1000], device=device, dtype=torch.int32)
    grad = torch.randn(1000, H, generator=g).to(device, dtype)
    ref_in = [t.double().requires_grad_() for t in (x, w1, w2)]
    ref = reference_experts(ref_in[0], offs, ref_in[1], ref_in[2])
    ref.backward(grad.double())
    fast_in = [x.clone().requires_grad_(), w1.clone().requires_grad_(), w2.clone().requires_grad_()]
    out = grouped_mm_experts(fast_in[0], offs, fast_in[1], fast_in[2], (w1.to(dtype), w2.to(dtype)))
    out.backward(grad)

    def rel(a, b):
        return float((a.detach().double() - b.detach()).norm() / b.detach().norm())

    errs = [rel(out, ref)] + [rel(f.grad, r.grad) for f, r in zip(fast_in, ref_in, strict=True)]
    xr = torch.randn(4096, 2048, generator=g).to(device, torch.bfloat16)
    wr = (torch.randn(128, 2048, generator=g) * 0.02).to(device)
    router = rel(moe_module.router_logits(xr, wr), xr.double() @ wr.double().t())
    # The bf16 copy after a real optimizer step (fused AdamW on GPUs leaves version counters alone).
    cfg = ModelConfig(
        hidden_size=256, moe_intermediate_size=128, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=0
    )
    layer = MoE(cfg, "grouped_mm").to(device)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.05)
    opt = Optimizer(layer, OptimConfig(lr=1e-2, expert_lr=1e-2))
    xs = torch.randn(1, 512, 256, generator=g).to(device)
    with autocast(device, "bfloat16"):
        layer(xs).float().square().sum().backward()
    opt.step(512)
    with torch.no_grad(), autocast(device, "bfloat16"):
        cached = layer.experts(x[:, :256].to(device), offs)
        fresh = grouped_mm_experts(x[:, :256].bfloat16(), offs, layer.experts.gate_up_proj, layer.experts.down_proj)
    return (
        f"grouped_mm vs float64 reference on {device.type} {dtype}: rel err out {errs[0]:.2e}, grad x "
        f"{errs[1]:.2e}, grad gate_up {errs[2]:.2e}, grad down {errs[3]:.2e} (fp32 masters: "
        f"{fast_in[1].grad.dtype}); split-bf16 router logits rel err {router:.2e}; bf16 weight copy after a "
        f"{'fused ' if opt.adamw.defaults.get('fused') else ''}AdamW step equals a fresh cast: {torch.equal(cached, fresh)}"
    )


def check_permute(device: torch.device) -> str:
    """Triton permute + combine against the torch (index_select) implementation on this GPU, bf16 rows,
    fp32 router weights: forward and gradients, fresh random routing; every output element compared."""
    if select_permute("auto", device) != "triton":
        return f"triton permutation: not run on {device.type}"
    g = torch.Generator(device="cpu").manual_seed(1)
    T, k, H, E = 4096, 8, 2048, 128
    ids = torch.rand(T, E, generator=g).topk(k, dim=-1).indices.reshape(-1).to(device)
    order = torch.argsort(ids, stable=True)
    sorted_pos = torch.empty_like(order)
    sorted_pos[order] = torch.arange(order.numel(), device=device)
    x = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    w = torch.rand(T, k, generator=g).to(device)
    scale = torch.randn(T * k, 1, generator=g).to(device, torch.bfloat16)
    grad = torch.randn(T, H, generator=g).to(device, torch.bfloat16)
    res = {}
    for impl in ("torch", "triton"):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = combine(permute(xi, sorted_pos, order, k, impl) * scale, wi, sorted_pos, order, impl)
        out.backward(grad)
        res[impl] = (out.detach(), xi.grad, wi.grad)

    def rel(a, b):
        return float((a.double() - b.double()).norm() / b.double().norm())

    errs = [rel(a, b) for a, b in zip(res["triton"], res["torch"], strict=True)]
    finite = all(bool(t.isfinite().all()) for t in res["triton"])
    return (
        f"triton vs torch permutation (bf16, T{T} k{k} H{H}): rel diff out {errs[0]:.1e}, grad x {errs[1]:.1e}, "
        f"grad weights {errs[2]:.1e}, all finite: {finite}"
    )


def model_flops_per_token(mc: ModelConfig, seq: int) -> float:
    """Training FLOPs per token: 6 x active parameters plus causal attention (scores and values), the same
    bf16-equivalent count whatever precision the expert GEMMs run in."""
    return 6 * count_params(mc)[1] + attention_flops_per_token(mc, seq)


def moonlet(device, cfg_path, batch, seq, steps, compiled, dense_tflops, precision="bf16") -> dict:
    """Training steps of the config's model on random tokens: time per step, tokens/s, MFU. `precision` "fp8"
    takes the FP8 experts select_backend gives (the FLOPs stay counted as bf16-equivalent)."""
    cfg = load_config(cfg_path)
    mc = cfg.trainer.model
    dtype_name = cfg.trainer.dtype if device.type == "cuda" else "bfloat16"
    choice = cfg.trainer.experts.backend if device.type == "cuda" else "auto"
    if precision == "fp8":
        choice = "cutedsl"  # the FP8 experts are CuTeDSL's, whatever the config's bf16 backend is
    backend = select_backend(choice, device, torch.bfloat16, precision=precision)
    model = build_model(mc, backend, seed=None, device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if name.endswith("norm.weight") else p.normal_(0, 0.02)
    if compiled:
        torch._dynamo.reset()
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
    achieved = model_flops_per_token(mc, seq) * tok_s
    return {
        "precision": precision,
        "experts_backend": backend,
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
    ap.add_argument("--shapes", default="", help="only these expert shapes, e.g. '2048,768,128,8;1024,512,64,8'")
    ap.add_argument("--layer-only", action="store_true", help="skip moonlet")
    ap.add_argument(
        "--variants", default=",".join(VARIANTS), help=f"MoE-layer rows to measure, of {', '.join(VARIANTS)}"
    )
    ap.add_argument("--first-shape-variants", default="", help="extra variants measured for the first shape only")
    ap.add_argument("--moonlet-eager", action="store_true", help="also time moonlet without torch.compile")
    ap.add_argument(
        "--moonlet-precision",
        choices=["bf16", "fp8", "both"],
        default="bf16",
        help="moonlet's expert GEMMs: bf16 (the config's backend), fp8 (CuTeDSL FP8), or both, one row each",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="kernel tables of the compiled layers of the first shape (grouped_mm, and FP8 per launch), with the "
        "GPU's busy share of a step",
    )
    ap.add_argument(
        "--launch",
        default=grouped.LAUNCH,
        choices=[*grouped.LAUNCHES, "both"],
        help="how CuTeDSL kernels are launched (trainer/experts/cutedsl/grouped.py LAUNCH); both: every cutedsl row "
        "once per way, the second labelled, and a row of the host time of one launch each way",
    )
    args = ap.parse_args()
    launches = list(grouped.LAUNCHES) if args.launch == "both" else [args.launch]
    variants = args.variants.split(",")
    first_only = [v for v in args.first_shape_variants.split(",") if v and v not in variants]
    if unknown := set(variants + first_only) - set(VARIANTS):
        ap.error(f"unknown variants {sorted(unknown)}; pick from {', '.join(VARIANTS)}")
    t_start = time.perf_counter()
    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    smoke = device.type == "cpu"
    dtype = torch.bfloat16
    tokens = 64 if smoke else args.tokens
    reps = 3 if smoke else 10
    shapes = SMOKE_SHAPES if smoke else SHAPES
    if args.shapes:
        shapes = [tuple(int(v) for v in sh.split(",")) for sh in args.shapes.split(";")]
    results: dict = {"device": torch.cuda.get_device_name() if not smoke else "cpu", "torch": torch.__version__}
    results["check"] = check_backends(device) + "; " + check_permute(device)
    print(results["check"], flush=True)
    dense = dense_rate(device, dtype, 256 if smoke else 8192, reps)
    results["dense"] = asdict(dense)
    print(f"{dense.what}: {dense.tflops:.1f} TFLOP/s", flush=True)
    rows_of = {shape: [] for shape in shapes}
    results["shapes"] = [
        {"shape": f"H{H} I{i} E{E} top-{k}, {tokens} tokens", "rows": rows_of[(H, i, E, k)]} for H, i, E, k in shapes
    ]

    def save() -> None:
        Path(args.out).write_text(json.dumps(results, indent=2, default=lambda r: asdict(r)))

    def measure(shape, label, fn, *fn_args, launch: str = "") -> None:
        """One row; `launch` (a cutedsl row): under that grouped.LAUNCH, named in the row unless it is the first."""
        suffix = f", {launch} launch" if launch and launch != launches[0] else ""
        label += suffix
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipped {label} for {shape}: time budget spent", flush=True)
            return
        if launch:
            grouped.LAUNCH = launch
        try:
            row = fn(*fn_args)
            row.what += suffix
        except BackendUnavailable as exc:  # expected off Hopper or without the DSL: the reason, no traceback
            row = Row(label, math.nan, math.nan, f"unavailable: {exc}")
        except Exception as exc:  # report and keep measuring the other variants
            row = Row(label, math.nan, math.nan, repr(exc)[:200])
            traceback.print_exc()
        finally:
            grouped.LAUNCH = launches[0]
        rows_of[shape].append(row)
        print(
            f"{shape} | {row.what}: {row.tflops:.1f} TFLOP/s ({row.ms:.3f} ms), {row.tflops / dense.tflops:.0%} of "
            f"dense {row.note}",
            flush=True,
        )
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()

    def profile_path(sh, name: str) -> str | None:
        """Where --profile writes the kernel table of a compiled layer of the first shape (None: not profiled)."""
        if not args.profile or sh != shapes[0]:
            return None
        return os.path.join(os.path.dirname(args.out) or ".", f"profile-{name}.txt")

    def layer(sh, v):
        if v == "compiled-fp8":
            for launch in launches:
                prof = profile_path(sh, f"fp8-{launch}")
                label = "MoE layer cutedsl_fp8 compiled"
                measure(sh, label, fp8_layer, device, *sh, tokens, reps, prof, launch=launch)
            return
        compiled, bf16_w, extra = v.startswith("compiled"), v.endswith("bf16w"), EXTRA.get(v, "")
        prof = profile_path(sh, "grouped_mm") if compiled and not bf16_w and not extra else None
        measure(sh, v, moe_layer, device, *sh, tokens, "grouped_mm", compiled, bf16_w, reps, extra, prof)

    if len(launches) > 1:
        for launch in launches:
            measure(shapes[0], "one cutedsl launch", launch_cost, device, launch=launch)
    # Cheap measurements first, compiled ones (minutes of compile time) last, so a budget cut loses least.
    for sh in shapes:
        if "raw" in variants or (sh == shapes[0] and "raw" in first_only):
            measure(sh, "raw grouped_mm", raw_grouped, device, dtype, *sh, tokens, reps)
        if "raw-cutedsl" in variants or (sh == shapes[0] and "raw-cutedsl" in first_only):
            for precision, label in (("bf16", "raw cutedsl"), ("fp8", "raw cutedsl_fp8")):
                for launch in launches:
                    measure(
                        sh, label, raw_grouped, device, dtype, *sh, tokens, reps, "cutedsl", precision, launch=launch
                    )
        if "raw-scaled" in variants or (sh == shapes[0] and "raw-scaled" in first_only):
            label = "raw torch._scaled_grouped_mm fp8 rowwise, forward only"
            measure(sh, label, raw_scaled_forward, device, *sh, tokens, reps)
        measure(sh, "weight refresh", weight_refresh, device, *sh[:3], reps)
        for v in (v for v in variants + (first_only if sh == shapes[0] else []) if v.startswith("eager")):
            layer(sh, v)
    cfg_path = Path(__file__).resolve().parent.parent / "configs" / ("tiny.toml" if smoke else "moonlet.toml")
    results["moonlet"] = []
    moonlet_runs = (
        [] if args.layer_only else [False] if args.no_compile else [True, False] if args.moonlet_eager else [True]
    )
    precisions = ["bf16", "fp8"] if args.moonlet_precision == "both" else [args.moonlet_precision]
    for compiled, precision in [(c, p) for p in precisions for c in moonlet_runs]:
        if time.perf_counter() - t_start > args.budget_s:
            print(f"skipped moonlet compiled={compiled} {precision}: time budget spent", flush=True)
            continue
        try:
            b, s = (2, 32) if smoke else (args.moonlet_batch, args.moonlet_seq)
            steps = 2 if smoke else args.moonlet_steps
            m = moonlet(device, cfg_path, b, s, steps, compiled, dense.tflops, precision)
        except BackendUnavailable as exc:
            m = {"compiled": compiled, "precision": precision, "error": f"unavailable: {exc}"}
        except Exception as exc:
            m = {"compiled": compiled, "precision": precision, "error": repr(exc)[:300]}
            traceback.print_exc()
        results["moonlet"].append(m)
        print("moonlet", json.dumps(m), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        save()
    if not args.no_compile:
        # The first shape's extra variants last: the main rows of every shape come before the A/B rows.
        for sh, v in [(sh, v) for sh in shapes for v in variants] + [(shapes[0], v) for v in first_only]:
            if v.startswith("compiled"):
                layer(sh, v)
    print(f"total {time.perf_counter() - t_start:.0f} s")
    print(markdown(results))


def markdown(results: dict) -> str:
    dense = results["dense"]["tflops"]
    lines = [
        f"{results['dense']['what']} (bf16): {dense:.0f} TFLOP/s",
        "",
        "| shape | what | TFLOP/s | ms | % of dense | time vs | note |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s in results["shapes"]:
        rows = [asdict(r) if isinstance(r, Row) else r for r in s["rows"]]
        ms_of = {r["what"]: r["ms"] for r in rows}
        for r in rows:
            ratio = ""
            if r.get("vs") and r["vs"] in ms_of:
                x = r["ms"] / ms_of[r["vs"]]
                ratio = f"{x:.2f}x {r['vs']}"
                if r["what"].startswith("MoE layer cutedsl_fp8"):
                    ratio += f" ({'meets' if x <= FP8_LAYER_TARGET else 'misses'} <= {FP8_LAYER_TARGET}x)"
            lines.append(
                f"| {s['shape']} | {r['what']} | {r['tflops']:.0f} | {r['ms']:.2f} | {r['tflops'] / dense:.0%} | "
                f"{ratio} | {r['note'].replace('|', '/')} |"
            )
    for m in results.get("moonlet", []):
        if "error" in m:
            lines.append(f"\nmoonlet (compiled={m['compiled']}, {m.get('precision', 'bf16')}): error {m['error']}")
        else:
            lines.append(
                f"\nmoonlet ({m['params_total'] / 1e9:.2f}B total, {m['params_active'] / 1e9:.3f}B active), batch "
                f"{m['batch']}x{m['seq']}, compiled={m['compiled']}, {m['precision']} experts "
                f"({m['experts_backend']}): {m['tokens_per_s']:.0f} tokens/s, step "
                f"{m['step_ms']:.0f} ms, {m['model_tflops']:.0f} TFLOP/s, MFU {m['mfu_989']:.1%} of 989, "
                f"{m['mfu_measured_dense']:.1%} of measured dense, peak mem {m['peak_mem_gib']:.1f} GiB"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
