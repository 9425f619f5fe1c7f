"""Rotary position embedding: the cos/sin tables, their application to query/key heads, and YaRN.

Two layouts exist in the checkpoints we interoperate with. Qwen3 rotates the two halves of a head
against each other; DeepSeek-V3 rotates adjacent pairs (x0, x1), (x2, x3), ... and HF returns the
result with the even and odd members gathered into the two halves. Both forms compute the same dot
products between rotated queries and keys, and we reproduce HF's exact layout so logits match.

YaRN (Peng et al. 2023) extends a model pretrained on `original_max_len` positions by `factor`: a
frequency that turns many times over the original context (fast, short wavelength) already saw every
phase and is kept; one that turns less than once would see new phases at long range, so its position
is divided by `factor` (interpolated). Between the two bounds (beta_fast, beta_slow rotations) a linear
ramp over the frequency index blends them. Interpolation flattens attention, so YaRN sharpens it again
by a magnitude m(s) = 1 + 0.1 s ln(factor): cos/sin are scaled by m(mscale) / m(mscale_all_dim), and
DeepSeek's MLA multiplies its softmax scale by m(mscale_all_dim)^2 (released DeepSeek-V3 / Kimi-K2
set both to 1, so all the sharpening lands in the softmax).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from common.config import ModelConfig


@dataclass(frozen=True)
class Yarn:
    """YaRN's parameters (ModelConfig's rope_* fields; HF's rope_parameters names in comments)."""

    factor: float  # factor
    original_max_len: int  # original_max_position_embeddings
    beta_fast: float  # beta_fast
    beta_slow: float  # beta_slow
    mscale: float  # mscale
    mscale_all_dim: float  # mscale_all_dim

    @property
    def cos_sin_scale(self) -> float:
        """The factor on cos and sin, hence on every rotated query and key component."""
        return magnitude(self.factor, self.mscale) / magnitude(self.factor, self.mscale_all_dim)

    @property
    def softmax_scale(self) -> float:
        """The factor MLA applies to its softmax scale, on top of head_dim ** -0.5."""
        m = magnitude(self.factor, self.mscale_all_dim)
        return m * m


def yarn_of(cfg: ModelConfig) -> Yarn | None:
    """The model's YaRN parameters, or None when its RoPE is not scaled."""
    if cfg.rope_scaling == "none":
        return None
    return Yarn(
        factor=cfg.rope_factor,
        original_max_len=cfg.rope_original_max_len,
        beta_fast=cfg.rope_beta_fast,
        beta_slow=cfg.rope_beta_slow,
        mscale=cfg.rope_mscale,
        mscale_all_dim=cfg.rope_mscale_all_dim,
    )


def magnitude(factor: float, mscale: float) -> float:
    """YaRN's attention magnitude correction m = 1 + 0.1 * mscale * ln(factor); 1 when nothing is extended."""
    if factor <= 1.0:
        return 1.0
    return 1.0 + 0.1 * mscale * math.log(factor)


def inverse_frequencies(dim: int, theta: float, device: torch.device | None = None) -> torch.Tensor:
    """theta ** (-2i / dim) for i < dim // 2 (float32): the angle each rotated pair advances per position."""
    if dim % 2:
        raise ValueError(f"rotary dimension must be even, got {dim}")
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def yarn_ramp(dim: int, theta: float, yarn: Yarn) -> torch.Tensor:
    """Per frequency index i < dim // 2 (float32): 0 keeps the frequency, 1 interpolates it, linear between.

    The index whose wavelength 2 pi theta^(2i/dim) fits r turns into the original context solves
    i = dim ln(L / (2 pi r)) / (2 ln theta); the ramp runs from that index for beta_fast (rounded down) to
    the one for beta_slow (rounded up), both computed with the full `dim` and clamped to [0, dim - 1] as
    DeepSeek's reference code does (so the ramp may end past the last index, dim // 2 - 1)."""

    def index_of(turns: float) -> float:
        return dim * math.log(yarn.original_max_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    start = max(math.floor(index_of(yarn.beta_fast)), 0)
    end = min(math.ceil(index_of(yarn.beta_slow)), dim - 1)
    width = end - start if end != start else 0.001  # one bound for both: a step, not a division by zero
    i = torch.arange(dim // 2, dtype=torch.float32)
    return ((i - start) / width).clamp(0.0, 1.0)


def yarn_inverse_frequencies(dim: int, theta: float, yarn: Yarn, device: torch.device | None = None) -> torch.Tensor:
    """Inverse frequencies under YaRN: kept where the ramp is 0, divided by the factor where it is 1."""
    if dim % 2:
        raise ValueError(f"rotary dimension must be even, got {dim}")
    wavelength_steps = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)
    extrapolated = 1.0 / wavelength_steps
    interpolated = 1.0 / (yarn.factor * wavelength_steps)
    keep = 1 - yarn_ramp(dim, theta, yarn).to(device)
    # This blend order (not extrapolated + ramp * (interpolated - extrapolated)) gives transformers' and vLLM's
    # float32 frequencies bit for bit; one ulp of a frequency near 1 moves the angle at position 1e5 by 6e-3 rad.
    return interpolated * (1 - keep) + extrapolated * keep


def rope_tables(
    dim: int, max_len: int, theta: float, device: torch.device | None = None, yarn: Yarn | None = None
) -> torch.Tensor:
    """Angles table [max_len, dim // 2] (float32): position times inverse frequency (YaRN's when given)."""
    if yarn is None:
        inv_freq = inverse_frequencies(dim, theta, device)
    else:
        inv_freq = yarn_inverse_frequencies(dim, theta, yarn, device)
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
