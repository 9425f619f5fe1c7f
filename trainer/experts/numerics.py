"""How close an expert backend is to the float64 truth: output and the three gradients of the SwiGLU experts
on fresh random bf16 inputs, as relative errors ||fast - ref|| / ||ref||. Shared by the GPU tests
(tests/unit/test_experts_cutedsl.py) and the H200 check (bench/cutedsl_check.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.experts.reference import reference_experts


def relative_errors(
    fn: Callable[..., torch.Tensor], counts: list[int], H: int, inter: int, seed: int, device: torch.device
) -> dict[str, float]:
    """{out, grad_x, grad_gate_up, grad_down}: fn (bf16 tokens, fp32 master weights) against the reference in
    float64 on the same (bf16-representable) values. NaN anywhere makes the error NaN, so it fails any bound."""
    g = torch.Generator().manual_seed(seed)
    N, E = sum(counts), len(counts)
    x = torch.randn(N, H, generator=g).bfloat16()
    gate_up = (torch.randn(E, 2 * inter, H, generator=g) / H**0.5).bfloat16().float()
    down = (torch.randn(E, H, inter, generator=g) / inter**0.5).bfloat16().float()
    grad = torch.randn(N, H, generator=g).bfloat16()
    offsets = torch.tensor(counts).cumsum(0).to(device, torch.int32)

    ref_in = [t.double().to(device).requires_grad_() for t in (x, gate_up, down)]
    ref = reference_experts(ref_in[0], offsets, ref_in[1], ref_in[2])
    ref.backward(grad.double().to(device))
    fast_in = [t.to(device).requires_grad_() for t in (x, gate_up, down)]
    out = fn(*fast_in[:1], offsets, *fast_in[1:])
    out.backward(grad.to(device))

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        b = b.detach()
        return float((a.detach().double() - b).norm() / b.norm().clamp_min(1e-30))

    def grad_of(t: torch.Tensor, name: str) -> torch.Tensor:
        if t.grad is None:
            raise RuntimeError(f"the backward gave no {name}: the expert function does not reach that input")
        return t.grad

    names = ("grad_x", "grad_gate_up", "grad_down")
    return {"out": rel(out, ref)} | {
        n: rel(grad_of(f, n), grad_of(r, n)) for n, f, r in zip(names, fast_in, ref_in, strict=True)
    }
