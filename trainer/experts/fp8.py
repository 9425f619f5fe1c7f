"""FP8 e4m3 quantization with DeepSeek-V3's block scales, in plain torch (under torch.compile each function
fuses into one or two kernels): activations get one fp32 scale per row and 128 columns (1x128 tiles), weights
one per 128x128 block. A scale is the block's absolute maximum over 448 (e4m3's largest finite value), so the
block's largest element lands on 448 and none saturates. Shapes that are not multiples of 128 get partial
blocks at their ends (padded with zeros for the maximum, never stored).

Error bound (what the numerics tests and bench/cutedsl_check.py hold the FP8 backend to): e4m3 keeps 3
mantissa bits, so rounding an element to nearest moves it by at most half a unit in the last place, 2^-4 of
its magnitude, uniformly: at most 2^-4 / sqrt(3) = 3.6% rms (relative) per quantized value. Elements below
2^-6 of their block's maximum fall into e4m3's subnormals and lose relative precision, but their absolute
error stays within 2^-10 of the block maximum, small against the sum. In a dot product, independent
roundings add in quadrature alike in the sum and in its error, so a result relative error is about
sqrt(n) x 3.6% for n quantized roundings on its path: the SwiGLU output y goes through four (x, gate_up,
the activation, down: 7.2%), the deepest gradient, grad x, through six (8.8%). The bound is 10% for the
output and all three gradients; on random data they measure 5-7% (tests/unit/test_experts_cutedsl.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 128
E4M3_MAX = 448.0
TINY = 1e-12  # an all-zero block gets this maximum, so its scale is finite and its values quantize to zero


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] e4m3, scale [ceil(K/128), M] fp32) with x ~= q * scale[k // 128, row]. The scales
    are stored k-block-major so that a GEMM tile reads its rows' scales of one k-block contiguously."""
    M, K = x.shape
    kb = _blocks(K)
    xf = F.pad(x.float(), (0, kb * BLOCK - K)).view(M, kb, BLOCK)
    # Times the fp32 reciprocal: what CUDA torch computes for `/ 448` anyway, and what the kernel does (quant.py).
    scale = xf.abs().amax(dim=-1).clamp(min=TINY) * (1 / E4M3_MAX)  # [M, kb]
    q = (xf / scale.unsqueeze(-1)).view(M, kb * BLOCK)[:, :K].to(torch.float8_e4m3fn)
    return q.contiguous(), scale.t().contiguous()


def quantize_blocks(
    w: torch.Tensor, experts_per_chunk: int = 8, out: tuple[torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (q [E, N, K] e4m3, scale [E, ceil(N/128), ceil(K/128)] fp32), one scale per 128x128 block,
    written into `out` when given. Works through `experts_per_chunk` experts at a time, so the fp32 temporaries
    stay a few hundred MB."""
    E, N, K = w.shape
    nb, kb = _blocks(N), _blocks(K)
    if out is None:
        out = (
            torch.empty(E, N, K, device=w.device, dtype=torch.float8_e4m3fn),
            torch.empty(E, nb, kb, device=w.device, dtype=torch.float32),
        )
    q, scale = out
    for e0 in range(0, E, experts_per_chunk):
        chunk = w[e0 : e0 + experts_per_chunk].float()
        c = chunk.shape[0]
        blocks = F.pad(chunk, (0, kb * BLOCK - K, 0, nb * BLOCK - N)).view(c, nb, BLOCK, kb, BLOCK)
        s = blocks.abs().amax(dim=(2, 4)).clamp(min=TINY) * (1 / E4M3_MAX)  # [c, nb, kb]
        scale[e0 : e0 + c] = s
        q[e0 : e0 + c] = (blocks / s[:, :, None, :, None]).view(c, nb * BLOCK, kb * BLOCK)[:, :N, :K]
    return q, scale


def token_blocks(offsets: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """The padded token order of the FP8 weight gradients: each expert's rows (offsets [E], running ends) start
    at a multiple of 128, zeros between, so that every 128-token block (one scale per feature) holds one
    expert's tokens. Returns (ends [E] int32: running ends of the experts' padded rows; block_src and block_rows
    [P / 128] int32: the first source row and the count of real rows of each padded block; P, the padded row
    count the buffers are sized for without a host sync: 128 x (ceil(rows / 128) + E), the tail past ends[-1]
    empty blocks). Device ops only."""
    E = offsets.numel()
    ends = offsets.long()
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    padded = (counts + BLOCK - 1) // BLOCK * BLOCK
    pad_ends = padded.cumsum(0)
    P = (_blocks(rows) + E) * BLOCK
    first = torch.arange(0, P, BLOCK, device=offsets.device)
    e = torch.searchsorted(pad_ends, first, right=True)
    live = e < E
    e = e.clamp(max=E - 1)
    into = first - (pad_ends[e] - padded[e])  # the block's offset within its expert's padded rows
    src = ends[e] - counts[e] + into
    n = torch.where(live, (counts[e] - into).clamp(min=0, max=BLOCK), 0)
    return pad_ends.int(), torch.where(live, src, 0).int(), n.int(), P


def quantize_tokens_t(x: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight-gradient operand of DeepSeek-V3's recipe: x [R, F] token-major, rows grouped by expert
    (offsets [E]) -> (q_t [F, P] e4m3, scale [P / 128, F] fp32, ends [E] int32) in token_blocks' padded order:
    q_t[f, t] * scale[t // 128, f] ~= x[row of padded token t, f], one scale per feature and 128-token block of
    one expert (1x128 tiles along the tokens), the tokens contiguous (the reduction of the wgrad GEMM runs over
    them, and FP8 wgmma reads both operands K-contiguous). Padding tokens are zeros."""
    ends, src, n, _ = token_blocks(offsets, x.shape[0])
    return (*quantize_token_blocks(x, src, n), ends)


def quantize_token_blocks(
    x: torch.Tensor, block_src: torch.Tensor, block_rows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_tokens_t's (q_t, scale) from the padded blocks token_blocks gives (their first source rows and
    real row counts), for callers that quantize several tensors over the same rows."""
    R, Fdim = x.shape
    nb = block_src.shape[0]
    pos = torch.arange(BLOCK, device=x.device)
    rows = block_src.long()[:, None] + pos  # [nb, 128] source rows of each padded token
    real = pos < block_rows.long()[:, None]
    xf = x.float()[rows.clamp(max=max(R - 1, 0)).view(-1)] if R else x.new_zeros(nb * BLOCK, Fdim, dtype=torch.float)
    xf = torch.where(real.view(-1, 1), xf, 0.0).view(nb, BLOCK, Fdim)
    scale = xf.abs().amax(dim=1).clamp(min=TINY) * (1 / E4M3_MAX)  # [nb, F]
    q = (xf / scale[:, None, :]).view(nb * BLOCK, Fdim).to(torch.float8_e4m3fn)
    return q.t().contiguous(), scale


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """The activation silu(gate) * up of h = gate|up [R, 2I], in fp32 from h's values and never rounded to h's
    dtype: what the FP8 backend quantizes in its forward (cutedsl quant.swiglu_both_kernel fuses the two)."""
    gate, up = h.float().chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_grad(grad_act: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """grad_h [R, 2I] = (grad gate, grad up) of the activation's gradient grad_act [R, I] through h = gate|up, in
    fp32, never rounded: grad_act up sig (1 + gate (1 - sig)) and grad_act gate sig, with sig = sigmoid(gate)
    (cutedsl quant.swiglu_grad_both_kernel computes it in the pass that quantizes it)."""
    gate, up = h.float().chunk(2, dim=-1)
    grad = grad_act.float()
    sig = torch.sigmoid(gate)
    return torch.cat([grad * up * sig * (1 + gate * (1 - sig)), grad * (gate * sig)], dim=-1)


def dequantize_tokens_t(q_t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_tokens_t's output stands for, [F, P]."""
    return q_t.float() * scale.t().repeat_interleave(BLOCK, dim=1)


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_rows' output stands for."""
    return q.float() * scale.t().repeat_interleave(BLOCK, dim=1)[:, : q.shape[1]]


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values quantize_blocks' output stands for."""
    E, N, K = q.shape
    full = scale.repeat_interleave(BLOCK, dim=1).repeat_interleave(BLOCK, dim=2)
    return q.float() * full[:, :N, :K]


def quantize_expert_weights(
    gate_up: torch.Tensor, down: torch.Tensor, out: tuple[torch.Tensor, ...] | None = None
) -> tuple[torch.Tensor, ...]:
    """The FP8 copy of the expert weights the GEMMs read, made once per optimizer step: gate_up [E, 2I, H] and
    down [E, H, I] as stored (forward) and transposed (dgrad; FP8 wgmma reads both operands K-contiguous), each
    with its block scales. A 128x128 block is the same block transposed, so the transposes share the values and
    scales of the forward copies. Returns (gate_up q, s, gate_up^T q, s, down q, s, down^T q, s); `out`, a pack
    made before, is rewritten in place and returned (no second pack in memory)."""
    if out is None:
        pack: list[torch.Tensor] = []
        for w in (gate_up, down):
            q, s = quantize_blocks(w.detach())
            # Copies even where the transpose is already contiguous (one block row): no tensor aliases another.
            pack += [
                q,
                s,
                q.mT.clone(memory_format=torch.contiguous_format),
                s.mT.clone(memory_format=torch.contiguous_format),
            ]
        return tuple(pack)
    for i, w in enumerate((gate_up, down)):
        q, s, q_t, s_t = out[4 * i : 4 * i + 4]
        quantize_blocks(w.detach(), out=(q, s))
        q_t.copy_(q.mT)
        s_t.copy_(s.mT)
    return out


# The same as a torch custom op, for a forward that finds no per-step FP8 copy (the first one, before the
# Experts module makes it): torch.compile runs it as an opaque eager call instead of generating e4m3 code (the
# Triton of torch 2.11 on the H200 failed to build the fused cast).
@torch.library.custom_op("slipstream::fp8_quantize_expert_weights", mutates_args=())
def quantize_expert_weights_op(gate_up: torch.Tensor, down: torch.Tensor) -> list[torch.Tensor]:
    """quantize_expert_weights as an op."""
    return list(quantize_expert_weights(gate_up, down))


@quantize_expert_weights_op.register_fake
def _(gate_up, down):
    out = []
    for w in (gate_up, down):
        E, N, K = w.shape
        nb, kb = _blocks(N), _blocks(K)
        out += [
            w.new_empty(E, N, K, dtype=torch.float8_e4m3fn),
            w.new_empty(E, nb, kb, dtype=torch.float32),
            w.new_empty(E, K, N, dtype=torch.float8_e4m3fn),
            w.new_empty(E, kb, nb, dtype=torch.float32),
        ]
    return out
