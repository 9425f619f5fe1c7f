"""The CuTeDSL expert backend: the SwiGLU experts on our own Hopper grouped GEMM (kernel.py, written with
nvidia-cutlass-dsl, the `gpu` extra), bf16 operands and fp32 accumulation. Forward: gate|up = x @ W1[e]^T and
y = act @ W2[e]^T over tokens sorted by expert (rows grouped); backward: the dgrad GEMMs (rows grouped, the
weights read transposed) and the wgrad GEMMs (the reduction grouped over each expert's rows, written in
the masters' dtype straight from the fp32 accumulators). The SwiGLU elementwise part is the same torch code
as the grouped_mm backend, so the two differ only in the GEMMs. The weight gradients run on our kernel where the
masters are fp32 and on torch._grouped_mm where they are bf16 (`WGRAD` "auto").

The GEMMs are torch custom ops (grouped.py), so torch.compile keeps them opaque. `cutlass` is imported on
first use, so this module imports on any machine; `cutedsl_unavailable` says why the backend cannot run
(not a Hopper GPU, not bf16, no DSL installed).

`cutedsl_fp8_experts` runs the forward and dgrad GEMMs in FP8 e4m3 with DeepSeek-V3's block scales: the
tokens quantized 1x128 on the way in by our kernel (quant.py, bit for bit trainer/experts/fp8.py's
`quantize_rows`), the weights 128x128 once per optimizer step by the caller (the Experts module, through
quant.py's one-pass kernel). The wgrad GEMMs run in FP8 where the masters are fp32 (`FP8_WGRAD` "auto"), from
both operands quantized per feature and 128-token block of one expert (each expert's tokens from a multiple of
128), each activation quantized both ways in one pass, the SwiGLU's activation and its gradient computed inside
that pass (`SWIGLU_QUANT`); in bf16 from the bf16 activations otherwise. Left out for now: the permutation gather
fused into the A load, a Blackwell (sm100) kernel."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.experts.cutedsl import grouped, quant
from trainer.experts.fp8 import quantize_expert_weights_op, token_blocks
from trainer.experts.grouped_mm import swiglu_backward

# Which kernel computes the weight gradients (the GEMMs whose reduction runs over each expert's rows), in both
# precisions. "grouped_mm": torch._grouped_mm, its bf16 result cast to the masters' dtype (what the grouped_mm
# backend does); "cutedsl": our k-grouped kernel, which writes the masters' dtype straight from fp32; "auto": ours
# where the masters are fp32 (training's case), torch's where they are bf16. As GEMMs alone ours runs at
# 0.81-0.88x torch's speed, but torch's bf16 result then costs a cast, a second pass over a gradient as large as
# the weights: on an H100 at H2048 I768 E128 over fp32 masters the compiled expert layer took 7.72 ms with ours
# against 8.37 with torch's (bf16), 6.92 against 7.52 (FP8) (bench/RESULTS.md "Weight gradients in the masters'
# dtype", 2026-12-07).
WGRAD = "auto"
WGRADS = ("auto", "grouped_mm", "cutedsl")


# How the FP8 backend computes its weight gradients: "bf16" by WGRAD, from the bf16 activations the forward keeps;
# "fp8" by grouped.k_grouped_scaled from both operands quantized per feature and 128-token block of one expert
# (DeepSeek-V3's recipe), each of the four activations quantized both ways in one pass (quant.quantize_both_op);
# "auto": "fp8" where the masters are fp32 (training's case), "bf16" where they are bf16. On an H100 at H2048 I768
# E128 the compiled expert layer took 6.70 ms with FP8 weight gradients against 6.91 with ours in bf16 over fp32
# masters, 6.53 against 6.40 (torch's, no cast) over bf16 weights; moonlet trained 300 steps with them to within
# 0.03% of the bf16 experts' loss (bench/RESULTS.md "FP8 weight gradients that pay", 2026-12-07).
FP8_WGRAD = "auto"
FP8_WGRADS = ("auto", "bf16", "fp8")

# With FP8 weight gradients, how the SwiGLU meets its quantization: "fused" computes the activation (forward) and
# grad_h (backward) in fp32 inside the two-way quantizer's pass (quant.swiglu_both_op, swiglu_grad_both_op), so
# neither is written to memory nor rounded to bf16; "torch" computes them in bf16 with torch (fused by Inductor
# when compiled), then quantizes them (quant.quantize_both_op): the same arithmetic up to those roundings.
SWIGLU_QUANT = "fused"
SWIGLU_QUANTS = ("fused", "torch")


def _wgrad(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """[E, M, N] = a[rows of e]^T @ b[rows of e] per expert e (a [R, M], b [R, N] token-major), by WGRAD."""
    if WGRAD not in WGRADS:
        raise ValueError(f"cutedsl.WGRAD = {WGRAD!r} is not one of {WGRADS}")
    if WGRAD == "grouped_mm" or (WGRAD == "auto" and out_dtype == a.dtype):
        return torch._grouped_mm(a.t(), b, offs=offsets).to(out_dtype)
    return grouped.k_grouped_op(a, b, offsets, out_dtype)


class _CuteSwiGLU(torch.autograd.Function):
    """y = grouped(silu(gate) * up) with gate|up = grouped(x, gate_up); weights as (masters, compute copies)."""

    @staticmethod
    def forward(ctx, x, offsets, gate_up, down, gate_up_c, down_c):
        items = grouped.work_items(offsets, x.shape[0], grouped.M_CONFIG.tile_mn[0])
        h = grouped.m_grouped_op(x, gate_up_c, offsets, *items, False)  # [N, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = grouped.m_grouped_op(F.silu(gate) * up, down_c, offsets, *items, False)  # [N, H]
        ctx.save_for_backward(x, offsets, h, gate_up_c, down_c, *items)
        ctx.master_dtypes = (gate_up.dtype, down.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, offsets, h, gate_up_c, down_c, *items = ctx.saved_tensors
        gate_up_dtype, down_dtype = ctx.master_dtypes
        need_x, _, need_gate_up, need_down = ctx.needs_input_grad[:4]
        grad_y = grad_y.contiguous()
        gate, up = h.chunk(2, dim=-1)
        silu_gate = F.silu(gate)
        grad_act = grouped.m_grouped_op(grad_y, down_c, offsets, *items, True)  # [N, I]: down read transposed
        grad_down = _wgrad(grad_y, silu_gate * up, offsets, down_dtype) if need_down else None
        grad_h = swiglu_backward(grad_act, gate, up, silu_gate)
        grad_gate_up = _wgrad(grad_h, x, offsets, gate_up_dtype) if need_gate_up else None  # [E, 2I, H]
        grad_x = grouped.m_grouped_op(grad_h, gate_up_c, offsets, *items, True) if need_x else None
        return grad_x, None, grad_gate_up, grad_down, None, None


def cutedsl_experts(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    cast_weights: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Same contract as `grouped_mm_experts`: x [N, H] bf16 sorted by expert, offsets [E] int32 running ends,
    gate_up [E, 2I, H], down [E, H, I]; `cast_weights` an up-to-date bf16 copy of (gate_up, down). H and I
    must be multiples of 8 (16-byte rows for TMA)."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the cutedsl expert backend runs bf16 tokens, got {x.dtype}")
    H, inter = down.shape[1], down.shape[2]
    if H % 8 or inter % 8:
        raise ValueError(f"the cutedsl expert backend needs H and I divisible by 8, got H={H} I={inter}")
    if cast_weights is None:
        cast_weights = (gate_up.to(x.dtype), down.to(x.dtype))
    gate_up_c, down_c = (w.detach().contiguous() for w in cast_weights)
    if gate_up_c.dtype != x.dtype or down_c.dtype != x.dtype:
        raise TypeError(f"cast_weights are {gate_up_c.dtype}/{down_c.dtype} but the tokens are {x.dtype}")
    return _CuteSwiGLU.apply(x.contiguous(), offsets.int(), gate_up, down, gate_up_c, down_c)


class _CuteFP8SwiGLU(torch.autograd.Function):
    """_CuteSwiGLU with the forward and dgrad GEMMs in FP8: weights as (masters, their FP8 pack). With FP8 weight
    gradients (FP8_WGRAD, read once per forward) each of the four activations is quantized both ways in one
    pass (quant.quantize_both_op): 1x128 along its features for its row-grouped GEMM, per feature and 128-token
    block for the wgrad GEMM; the forward keeps the transposed FP8 copies of x and of the activation instead of
    x in bf16 and a recompute of the activation."""

    @staticmethod
    def forward(ctx, x, offsets, gate_up, down, *pack):
        gu_q, gu_s, gu_t_q, gu_t_s, dn_q, dn_s, dn_t_q, dn_t_s = pack
        if FP8_WGRAD not in FP8_WGRADS:
            raise ValueError(f"cutedsl.FP8_WGRAD = {FP8_WGRAD!r} is not one of {FP8_WGRADS}")
        fp32_masters = gate_up.dtype == down.dtype == torch.float32
        fp8_wgrad = (FP8_WGRAD == "fp8" or (FP8_WGRAD == "auto" and fp32_masters)) and any(ctx.needs_input_grad[2:4])
        if SWIGLU_QUANT not in SWIGLU_QUANTS:
            raise ValueError(f"cutedsl.SWIGLU_QUANT = {SWIGLU_QUANT!r} is not one of {SWIGLU_QUANTS}")
        ctx.fused = SWIGLU_QUANT == "fused"
        items = grouped.work_items(offsets, x.shape[0], grouped.FP8_CONFIG.tile_mn[0])
        if fp8_wgrad:
            # The padded 128-token blocks of the four tensors' transposed copies: their rows are the same.
            ends, *blocks, _ = token_blocks(offsets, x.shape[0])
            x_q, x_s, *x_t = quant.quantize_both_op(x, *blocks)  # x_t: (q_t, scale_t)
        else:
            x_q, x_s = quant.quantize_rows_op(x)
        h = grouped.m_grouped_scaled_op(x_q, x_s, gu_q, gu_s, offsets, *items)  # [N, 2I] bf16
        if fp8_wgrad:
            if ctx.fused:  # the activation silu(gate) * up computed and quantized in one pass over h, never written
                act_q, act_s, act_t, act_t_s = quant.swiglu_both_op(h, *blocks)
            else:
                gate, up = h.chunk(2, dim=-1)
                act_q, act_s, act_t, act_t_s = quant.quantize_both_op(F.silu(gate) * up, *blocks)
            y = grouped.m_grouped_scaled_op(act_q, act_s, dn_q, dn_s, offsets, *items)
            saved = (*x_t, act_t, act_t_s, ends, *blocks)
            ctx.save_for_backward(offsets, h, gu_t_q, gu_t_s, dn_t_q, dn_t_s, *saved, *items)
        else:
            gate, up = h.chunk(2, dim=-1)
            act = F.silu(gate) * up
            y = grouped.m_grouped_scaled_op(*quant.quantize_rows_op(act), dn_q, dn_s, offsets, *items)
            ctx.save_for_backward(offsets, h, gu_t_q, gu_t_s, dn_t_q, dn_t_s, x, *items)
        ctx.fp8_wgrad = fp8_wgrad
        ctx.master_dtypes = (gate_up.dtype, down.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        offsets, h, gu_t_q, gu_t_s, dn_t_q, dn_t_s, *rest = ctx.saved_tensors
        gate_up_dtype, down_dtype = ctx.master_dtypes
        need_x, _, need_gate_up, need_down = ctx.needs_input_grad[:4]
        grad_y = grad_y.contiguous()
        if ctx.fp8_wgrad:
            x_t, x_t_s, act_t, act_t_s, ends, *rest = rest
            blocks, items = rest[:2], rest[2:]
            grad_y_q, grad_y_s, grad_y_t, grad_y_t_s = quant.quantize_both_op(grad_y, *blocks)
        else:
            x, *items = rest
            grad_y_q, grad_y_s = quant.quantize_rows_op(grad_y)
        grad_act = grouped.m_grouped_scaled_op(grad_y_q, grad_y_s, dn_t_q, dn_t_s, offsets, *items)  # [N, I]
        grad_down = None
        if ctx.fp8_wgrad:
            if need_down:
                grad_down = grouped.k_grouped_scaled_op(grad_y_t, grad_y_t_s, act_t, act_t_s, ends, down_dtype)
            if ctx.fused:  # grad_h = (grad gate, grad up) computed and quantized in one pass over grad_act and h
                grad_h_q, grad_h_s, grad_h_t, grad_h_t_s = quant.swiglu_grad_both_op(grad_act, h, *blocks)
            else:
                gate, up = h.chunk(2, dim=-1)
                grad_h = swiglu_backward(grad_act, gate, up, F.silu(gate))
                grad_h_q, grad_h_s, grad_h_t, grad_h_t_s = quant.quantize_both_op(grad_h, *blocks)
        else:
            gate, up = h.chunk(2, dim=-1)
            silu_gate = F.silu(gate)
            if need_down:
                grad_down = _wgrad(grad_y, silu_gate * up, offsets, down_dtype)
            grad_h = swiglu_backward(grad_act, gate, up, silu_gate)
            if need_x:
                grad_h_q, grad_h_s = quant.quantize_rows_op(grad_h)
        grad_gate_up = None
        if need_gate_up:
            if ctx.fp8_wgrad:
                grad_gate_up = grouped.k_grouped_scaled_op(grad_h_t, grad_h_t_s, x_t, x_t_s, ends, gate_up_dtype)
            else:
                grad_gate_up = _wgrad(grad_h, x, offsets, gate_up_dtype)  # [E, 2I, H]
        grad_x = None
        if need_x:
            grad_x = grouped.m_grouped_scaled_op(grad_h_q, grad_h_s, gu_t_q, gu_t_s, offsets, *items)  # [N, H]
        return (grad_x, None, grad_gate_up, grad_down) + (None,) * 8


def cutedsl_fp8_experts(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    cast_weights: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """cutedsl_experts with FP8 forward and dgrad GEMMs: x [N, H] bf16 sorted by expert, offsets [E] int32
    running ends, gate_up [E, 2I, H], down [E, H, I]; `cast_weights` an up-to-date FP8 pack of the weights
    (`trainer.experts.fp8.quantize_expert_weights`), else they are quantized here, on every call. H and I must
    be multiples of 16 (16-byte e4m3 rows for TMA); y comes back in bf16."""
    if x.dtype != torch.bfloat16:
        raise TypeError(f"the cutedsl FP8 expert backend takes bf16 tokens, got {x.dtype}")
    H, inter = down.shape[1], down.shape[2]
    if H % 16 or inter % 16:
        raise ValueError(f"the cutedsl FP8 expert backend needs H and I divisible by 16, got H={H} I={inter}")
    pack = cast_weights if cast_weights is not None else quantize_expert_weights_op(gate_up.detach(), down.detach())
    if len(pack) != 8 or pack[0].dtype != torch.float8_e4m3fn:
        raise TypeError("cast_weights of the FP8 backend must be the 8 tensors of quantize_expert_weights")
    return _CuteFP8SwiGLU.apply(x.contiguous(), offsets.int(), gate_up, down, *(t.detach() for t in pack))


def _import_error() -> str | None:
    return grouped.import_error(
        "cutlass.cute",
        "nvidia-cutlass-dsl",
        "install the `gpu` extra (pip install -e '.[gpu]') or, on a machine without an index, unpack a CuTeDSL "
        "bundle onto PYTHONPATH (docs/h200.md says how to build one)",
    )


def cutedsl_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the CuTeDSL grouped GEMMs (bf16, and FP8 from bf16 tokens) can run here, else the reason."""
    if device.type != "cuda":
        return f"it runs on NVIDIA Hopper GPUs (sm90a), not on {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major != 9:
        # sm100 (tcgen05) is named in issue 16 but has no kernel yet: the wgmma kernel is sm90a only.
        return f"the kernel is built for Hopper (sm90a); this GPU is sm{major}{minor}"
    if dtype != torch.bfloat16:
        return f"it computes in bf16 only, not {dtype}"
    return _import_error() or (grouped._tvm_ffi_error() if grouped.LAUNCH == "tvm-ffi" else None)
