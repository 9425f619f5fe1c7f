"""Activation checkpointing of the decoder blocks (`trainer.activation_checkpoint`).

- "none": autograd keeps every activation a block's backward needs.
- "full": a block keeps only its inputs; its forward runs again inside the backward (one more forward per step).
- "selective": a block keeps the results of its expensive operations and recomputes the cheap ones in the backward.
  Kept (`SAVED_OPS`): matrix products (mm, addmm, bmm, baddbmm, the grouped and scaled GEMMs of the experts,
  CuTeDSL's expert GEMMs) and attention (every SDPA kernel), whose recomputation would cost about as much as the
  forward; recomputed: norms, RoPE, activations, softmax/top-k routing, permutations, casts and every other
  elementwise or data-movement op, which are memory-bound and cheap to redo. Under expert parallelism the expert
  exchange runs again too (it is not an aten op the policy can keep): every rank recomputes its blocks in the same
  order, so the exchanges pair up as in the forward.

The recomputed forward must not count twice what a forward records: an MoE layer adds its expert load to
`tokens_per_expert` (the aux-loss-free bias update) only in the first forward (`MoE.recomputing`).
Where torch.compile compiles the blocks, the checkpoint wraps the compiled block; a compiled region is opaque to the
selective policy (its kernels are not aten ops), so there "selective" keeps what the compiler's own partitioner
keeps, and recomputes the rest of the block like "full" would.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts, noop_context_fn

from trainer.model.attention import attention_backends

Mode = Literal["none", "full", "selective"]
MODES: tuple[str, ...] = ("none", "full", "selective")


def _ops(*names: str) -> set[Any]:
    """The aten / slipstream ops of these names that this torch build has (a CPU build lacks some kernels)."""
    found = set()
    for name in names:
        namespace, _, op = name.partition("::")
        packet = getattr(getattr(torch.ops, namespace), op, None)
        if packet is not None:
            found.add(packet.default)
    return found


SAVED_OPS = _ops(
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
    "aten::baddbmm",
    "aten::_grouped_mm",
    "aten::_scaled_mm",
    "aten::_scaled_grouped_mm",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
    "slipstream::cutedsl_m_grouped",
    "slipstream::cutedsl_m_grouped_scaled",
    "slipstream::fused_saves_attention",
)


def _policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts() -> Any:
    return create_selective_checkpoint_contexts(_policy)


def _in_backward() -> bool:
    """True while autograd's engine runs a backward (the checkpoint's recomputation happens there)."""
    return torch._C._current_graph_task_id() != -1


def run_block(block: torch.nn.Module, mode: str, *args: Any) -> torch.Tensor:
    """block(*args) under the activation-checkpointing `mode`; plain when no gradient is being recorded."""
    if mode == "none" or not torch.is_grad_enabled():
        return block(*args)
    if mode not in MODES:
        raise ValueError(f"trainer.activation_checkpoint = {mode!r}: use one of {', '.join(MODES)}")
    moe: Any = getattr(block, "mlp", None)

    def forward(*inner: Any) -> torch.Tensor:
        again = _in_backward()
        if hasattr(moe, "recomputing"):
            moe.recomputing = again
        try:
            # The backward runs outside the forward's attention-kernel preference: the recomputation takes it again,
            # so it runs the forward's kernels (selective's saved attention results are found by their op).
            with attention_backends(inner[0].device):
                return block(*inner)
        finally:
            if hasattr(moe, "recomputing"):
                moe.recomputing = False

    context: Callable[[], Any] = _selective_contexts if mode == "selective" else noop_context_fn
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, preserve_rng_state=False)
