"""The grouped-GEMM expert backend: `torch._grouped_mm` runs every expert's GEMM in one kernel launch
(CUTLASS on Hopper/Blackwell; PyTorch also ships a CPU implementation), forward and backward, with
no host sync: the group boundaries stay on the device as an offsets tensor. Gate and up projections
are one fused GEMM against the stacked [E, 2I, H] weight. The SwiGLU chain is one autograd function
with a hand-written backward, so that (1) the GEMMs can run on weights already cast to the compute
dtype by the caller (a copy kept per optimizer step instead of a cast per call) while the gradients
land on the fp32 masters in their own layout (AccumulateGrad then takes them without a copy), and
(2) under torch.compile the SwiGLU forward and backward fuse into the GEMMs' neighbours."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_backward(grad_act, gate, up, silu_gate) -> torch.Tensor:
    """grad_h = (grad gate, grad up) [N, 2I] of silu(gate) * up, in their dtype: the two ops autograd runs for
    it, so eager numerics are autograd's (shared by the grouped_mm and cutedsl backends)."""
    return torch.cat([torch.ops.aten.silu_backward(grad_act * up, gate), grad_act * silu_gate], dim=-1)


class _GroupedSwiGLU(torch.autograd.Function):
    """y = grouped(silu(gate) * up) with gate|up = grouped(x, gate_up); weights as (masters, compute copies)."""

    @staticmethod
    def forward(ctx, x, offsets, gate_up, down, gate_up_c, down_c):
        # transpose() gives the column-major [E, H, 2I] view grouped_mm accepts without a copy.
        h = torch._grouped_mm(x, gate_up_c.transpose(-2, -1), offs=offsets)  # [N, 2I]
        gate, up = h.chunk(2, dim=-1)
        y = torch._grouped_mm(F.silu(gate) * up, down_c.transpose(-2, -1), offs=offsets)  # [N, H]
        # The activation is recomputed from h in the backward (elementwise, fused there when compiled)
        # rather than saved: [N, I] less memory per layer.
        ctx.save_for_backward(x, offsets, h, gate_up_c, down_c)
        ctx.master_dtypes = (gate_up.dtype, down.dtype)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        x, offsets, h, gate_up_c, down_c = ctx.saved_tensors
        gate_up_dtype, down_dtype = ctx.master_dtypes
        need_x, _, need_gate_up, need_down = ctx.needs_input_grad[:4]
        grad_y = grad_y.contiguous()
        gate, up = h.chunk(2, dim=-1)
        silu_gate = F.silu(gate)
        grad_act = torch._grouped_mm(grad_y, down_c, offs=offsets)  # [N, I]
        grad_down = None
        if need_down:
            # Per expert grad_y^T @ act, written as [E, H, I] (the parameter's layout). grouped_mm has no fp32
            # output on the fast path (sm90: bf16 only), so the master gradient is one cast of the result.
            grad_down = torch._grouped_mm(grad_y.t(), silu_gate * up, offs=offsets).to(down_dtype)
        grad_h = swiglu_backward(grad_act, gate, up, silu_gate)
        grad_gate_up = None
        if need_gate_up:
            grad_gate_up = torch._grouped_mm(grad_h.t(), x, offs=offsets).to(gate_up_dtype)  # [E, 2I, H]
        grad_x = torch._grouped_mm(grad_h, gate_up_c, offs=offsets) if need_x else None  # [N, H]
        return grad_x, None, grad_gate_up, grad_down, None, None


def grouped_mm_experts(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    cast_weights: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """Same contract as `reference_experts`: x [N, H] sorted by expert, offsets [E] int32 running ends.

    `cast_weights` = (gate_up, down) already in x.dtype, for callers that keep such a copy fresh
    (`Experts` does, per optimizer step); the GEMMs use it and the gradients still go to `gate_up` and
    `down` in their dtype. Without it the weights are cast here, on every call."""
    if cast_weights is None:
        cast_weights = (gate_up.to(x.dtype), down.to(x.dtype))
    gate_up_c, down_c = cast_weights
    if gate_up_c.dtype != x.dtype or down_c.dtype != x.dtype:
        raise TypeError(f"cast_weights are {gate_up_c.dtype}/{down_c.dtype} but the tokens are {x.dtype}")
    return _GroupedSwiGLU.apply(x, offsets, gate_up, down, gate_up_c.detach(), down_c.detach())


def grouped_mm_unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if torch._grouped_mm runs forward and backward here, else the reason it does not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm (needs torch >= 2.8)"
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if major < 9:
            return f"torch._grouped_mm needs a Hopper or newer GPU (sm90+), this one is sm{major}{minor}"
    try:
        x = torch.randn(8, 16, device=device, dtype=dtype, requires_grad=True)
        w = torch.randn(2, 32, 16, device=device, dtype=dtype, requires_grad=True)
        d = torch.randn(2, 16, 16, device=device, dtype=dtype, requires_grad=True)
        offs = torch.tensor([3, 8], device=device, dtype=torch.int32)
        grouped_mm_experts(x, offs, w, d).square().sum().backward()
    except RuntimeError as exc:  # the op exists but has no kernel for this device/dtype
        return f"torch._grouped_mm fails on {device.type} {dtype}: {str(exc).splitlines()[0]}"
    return None
