"""The reference expert backend: one plain matmul chain per expert over its slice of the sorted
tokens. Slow (a host sync and 3 small GEMMs per expert) but obviously right, so it is the ground
truth the fast backends are tested against. Runs on any device and dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def reference_experts(
    x: torch.Tensor,
    offsets: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    cast_weights: tuple[torch.Tensor, ...] | None = None,
) -> torch.Tensor:
    """SwiGLU experts over x [N, H] sorted by expert; offsets [E] = running end of each expert's rows;
    gate_up [E, 2I, H] (gate rows first), down [E, H, I]. Returns [N, H]. `cast_weights` (the other backends'
    weight copy) is not used: the ground truth casts the masters itself."""
    ends = offsets.tolist()
    outs = []
    start = 0
    for e, end in enumerate(ends):
        rows = x[start:end]
        gate, up = F.linear(rows, gate_up[e].to(x.dtype)).chunk(2, dim=-1)
        outs.append(F.linear(F.silu(gate) * up, down[e].to(x.dtype)))
        start = end
    if start != x.shape[0]:
        raise ValueError(f"offsets end at {start} but there are {x.shape[0]} token rows")
    return torch.cat(outs) if outs else x.new_zeros(0, down.shape[1])
