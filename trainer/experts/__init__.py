"""Expert compute backends: functions that run the SwiGLU of every routed expert over tokens already
sorted by expert. `reference` is pure PyTorch (the ground truth); `grouped_mm` is torch._grouped_mm;
`cutedsl` is our own Hopper grouped GEMM (trainer/experts/cutedsl, nvidia-cutlass-dsl from the `gpu` extra).
`select_backend` turns the config's choice into a function: `auto` takes the fastest that runs on the
device and dtype, an explicit choice that cannot run raises with the reason (no silent downshift). `auto`
does not pick `cutedsl`: on the H200 it measured 0.99x of torch._grouped_mm (expert SwiGLU forward +
backward at the 128-expert shape, bench/cutedsl_check.py, bench/RESULTS.md), i.e. not faster."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from trainer.experts.cutedsl import cutedsl_experts, cutedsl_unavailable
from trainer.experts.grouped_mm import grouped_mm_experts, grouped_mm_unavailable
from trainer.experts.reference import reference_experts

ExpertsFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x sorted [N, H], offsets [E] int32, gate_up [E, 2I, H], down [E, H, I]) -> [N, H]."""

BACKENDS: dict[str, ExpertsFn] = {
    "reference": reference_experts,
    "grouped_mm": grouped_mm_experts,
    "cutedsl": cutedsl_experts,
}


class BackendUnavailable(RuntimeError):
    """An explicitly chosen expert backend cannot run on this device/dtype; the message says why."""


@functools.cache
def _why_not(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if name == "reference":
        return None
    if name == "grouped_mm":
        return grouped_mm_unavailable(device, dtype)
    if name == "cutedsl":
        return cutedsl_unavailable(device, dtype)
    raise ValueError(f"unknown expert backend {name!r}; use one of auto, {', '.join(BACKENDS)}")


def select_backend(name: str, device: torch.device | str, dtype: torch.dtype = torch.float32) -> str:
    """Resolve `auto | reference | grouped_mm | cutedsl` to a backend name that runs on (device, dtype)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if name == "auto":
        return "grouped_mm" if _why_not("grouped_mm", device, dtype) is None else "reference"
    reason = _why_not(name, device, dtype)
    if reason is not None:
        raise BackendUnavailable(
            f"trainer.experts.backend = {name!r} cannot run here: {reason}; set trainer.experts.backend = 'auto' "
            f"or 'reference'"
        )
    return name
