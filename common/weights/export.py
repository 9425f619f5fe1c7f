"""One name per expert, the form every transport sends: vLLM's loaders want `...experts.{e}.gate_proj.weight`,
transformers keeps routed experts fused in memory (`...experts.gate_up_proj` [E, 2I, H]). `per_expert_views`
splits fused tensors and passes everything else through, so a publisher takes either a transformers state
dict or the trainer's own export (trainer/hf.py's `hf_tensors(model)`, already one name per expert).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from common.weights.base import PublishError

if TYPE_CHECKING:
    import torch

# transformers keeps routed experts fused in memory: [E, 2I, H] gate|up and [E, H, I] down.
_FUSED_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(.*\.experts)\.down_proj$")


def per_expert_views(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with one name per expert, as views (no copies); see `per_expert_tensors`."""
    for name, t in tensors.items():
        t = t.detach()
        if (m := _FUSED_GATE_UP.match(name)) and t.dim() == 3:
            if t.shape[1] % 2:
                raise PublishError(f"{name}: fused gate_up_proj of shape {tuple(t.shape)} has an odd middle dim")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                yield f"{m[1]}.{e}.gate_proj.weight", gate[e]
                yield f"{m[1]}.{e}.up_proj.weight", up[e]
        elif (m := _FUSED_DOWN.match(name)) and t.dim() == 3:
            for e in range(t.shape[0]):
                yield f"{m[1]}.{e}.down_proj.weight", t[e]
        else:
            yield name, t


def per_expert_tensors(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with one name per expert: fused transformers expert tensors are split.

    `...experts.gate_up_proj` [E, 2I, H] becomes `...experts.{e}.gate_proj.weight` [I, H] and
    `...experts.{e}.up_proj.weight` [I, H]; `...experts.down_proj` [E, H, I] becomes
    `...experts.{e}.down_proj.weight`. Everything else passes through; all come out contiguous on CPU.
    """
    for name, t in per_expert_views(tensors):
        yield name, t.contiguous().cpu()
