"""Expert compute backends: functions that run the SwiGLU of every routed expert over tokens already
sorted by expert. `reference` is pure PyTorch (the ground truth); `grouped_mm` is torch._grouped_mm;
`cutedsl` is our own Hopper grouped GEMM (trainer/experts/cutedsl, nvidia-cutlass-dsl from the `gpu` extra);
`cutedsl_fp8` the same with FP8 block-scaled forward and dgrad GEMMs (`trainer.experts.precision = "fp8"`).
`select_backend` turns the config's (backend, precision) into a backend name: `auto` takes the fastest that
runs on the device and dtype, an explicit choice that cannot run raises with the reason (no silent
downshift). In bf16 on a CUDA GPU `auto` takes `cutedsl` where it measured faster than torch._grouped_mm for
the GPU and the expert shape (the table of measured.py; so far nowhere: bench/RESULTS.md), else grouped_mm,
and logs which measurement decided. FP8 runs on `cutedsl` only, since torch._scaled_grouped_mm is slower than bf16
grouped_mm at MoE shapes (docs/h200.md), so `auto` with fp8 picks it or fails with the reason."""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch

from common.config import ModelConfig
from trainer.experts.cutedsl import cutedsl_experts, cutedsl_fp8_experts, cutedsl_unavailable
from trainer.experts.grouped_mm import grouped_mm_experts, grouped_mm_unavailable
from trainer.experts.measured import auto_bf16
from trainer.experts.reference import reference_experts

log = logging.getLogger(__name__)


class ExpertsFn(Protocol):
    """(x sorted [N, H], offsets [E] int32, gate_up [E, 2I, H], down [E, H, I], weight copy) -> [N, H]. The
    copy is what `ExpertWeights` keeps fresh per step: (gate_up, down) in x's dtype, or for `cutedsl_fp8` the
    FP8 pack; None: the backend casts per call (the reference ignores it: it computes from the masters)."""

    def __call__(
        self,
        x: torch.Tensor,
        offsets: torch.Tensor,
        gate_up: torch.Tensor,
        down: torch.Tensor,
        cast_weights: tuple[torch.Tensor, ...] | None = None,
        /,
    ) -> torch.Tensor: ...


BACKENDS: dict[str, ExpertsFn] = {
    "reference": reference_experts,
    "grouped_mm": grouped_mm_experts,
    "cutedsl": cutedsl_experts,
    "cutedsl_fp8": cutedsl_fp8_experts,
}
PRECISIONS = ("bf16", "fp8")


def expert_shape(model: ModelConfig) -> tuple[int, int, int, int]:
    """(H, I, E, top-k) of a model's routed experts: the key of the measured speeds `auto` reads."""
    return (model.hidden_size, model.moe_intermediate_size, model.n_routed_experts, model.num_experts_per_tok)


class BackendUnavailable(RuntimeError):
    """An explicitly chosen expert backend cannot run on this device/dtype; the message says why."""


@functools.cache
def _why_not(name: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if name == "reference":
        return None
    if name == "grouped_mm":
        return grouped_mm_unavailable(device, dtype)
    if name in ("cutedsl", "cutedsl_fp8"):
        return cutedsl_unavailable(device, dtype)
    raise ValueError(f"unknown expert backend {name!r}; use one of auto, {', '.join(BACKENDS)}")


def select_backend(
    name: str,
    device: torch.device | str,
    dtype: torch.dtype = torch.float32,
    precision: str = "bf16",
    shape: tuple[int, int, int, int] | None = None,
) -> str:
    """Resolve `trainer.experts.backend` (`auto | reference | grouped_mm | cutedsl`) and
    `trainer.experts.precision` (`bf16 | fp8`) to a backend name that runs on (device, dtype); `shape` (H, I,
    E, top-k) of the experts lets `auto` read the measured speeds (measured.py)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.experts.precision = {precision!r}; use one of {', '.join(PRECISIONS)}")
    if precision == "fp8":
        if name not in ("auto", "cutedsl"):
            raise BackendUnavailable(
                f"trainer.experts.precision = 'fp8' runs on the cutedsl backend only, not {name!r}; set "
                "trainer.experts.backend = 'cutedsl' (or 'auto'), or precision = 'bf16'"
            )
        reason = _why_not("cutedsl_fp8", device, dtype)
        if reason is not None:
            raise BackendUnavailable(
                f"trainer.experts.precision = 'fp8' cannot run here (the cutedsl backend: {reason}); set "
                "trainer.experts.precision = 'bf16'"
            )
        if name == "auto":
            log.info("trainer.experts.backend = 'auto' with precision 'fp8' picked cutedsl_fp8 on %s", device)
        return "cutedsl_fp8"
    if name == "auto":
        reason = _why_not("grouped_mm", device, dtype)
        picked = "grouped_mm" if reason is None else "reference"
        why = "" if reason is None else f" (grouped_mm: {reason})"
        if picked == "grouped_mm" and device.type == "cuda" and dtype == torch.bfloat16:
            picked, measured = auto_bf16(torch.cuda.get_device_name(device), shape, _why_not("cutedsl", device, dtype))
            why = f" ({measured})"
        log.info("trainer.experts.backend = 'auto' picked %s on %s %s%s", picked, device, dtype, why)
        return picked
    reason = _why_not(name, device, dtype)
    if reason is not None:
        raise BackendUnavailable(
            f"trainer.experts.backend = {name!r} cannot run here: {reason}; set trainer.experts.backend = 'auto' "
            f"or 'reference'"
        )
    return name
