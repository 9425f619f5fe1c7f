"""The grouped-GEMM expert backend: `torch._grouped_mm` runs every expert's GEMM in one kernel launch
(CUTLASS on Hopper/Blackwell; PyTorch also ships a CPU implementation), forward and backward, with
no host sync: the group boundaries stay on the device as an offsets tensor. Gate and up projections
are one fused GEMM against the stacked [E, 2I, H] weight."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_mm_experts(
    x: torch.Tensor, offsets: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor
) -> torch.Tensor:
    """Same contract as `reference_experts`: x [N, H] sorted by expert, offsets [E] int32 running ends."""
    # Weights are fp32 masters; under bf16 compute the GEMM wants both operands in the compute dtype.
    # transpose() gives the column-major [E, H, 2I] view grouped_mm accepts without a copy.
    h = torch._grouped_mm(x, gate_up.to(x.dtype).transpose(-2, -1), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    return torch._grouped_mm(F.silu(gate) * up, down.to(x.dtype).transpose(-2, -1), offs=offsets)


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
