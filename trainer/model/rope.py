"""Rotary position embedding: the cos/sin tables and their application to query/key heads.

Two layouts exist in the checkpoints we interoperate with. Qwen3 rotates the two halves of a head
against each other; DeepSeek-V3 rotates adjacent pairs (x0, x1), (x2, x3), ... and HF returns the
result with the even and odd members gathered into the two halves. Both forms compute the same dot
products between rotated queries and keys, and we reproduce HF's exact layout so logits match.
"""

from __future__ import annotations

import torch


def rope_tables(dim: int, max_len: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """Angles table [max_len, dim // 2] (float32): position times inverse frequency."""
    if dim % 2:
        raise ValueError(f"rotary dimension must be even, got {dim}")
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    pos = torch.arange(max_len, dtype=torch.float32, device=device)
    return torch.outer(pos, inv_freq)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate x [B, S, heads, dim] by cos/sin [B or 1, S, dim // 2]; interleaved = DeepSeek pair layout."""
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
    cos = cos.unsqueeze(2).to(x.dtype)
    sin = sin.unsqueeze(2).to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
