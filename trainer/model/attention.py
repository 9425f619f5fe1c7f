"""Causal self-attention in the two shapes we train: MLA (DeepSeek-V3: low-rank compressed keys and
values, a rotary part shared by all heads, q/k head = nope + rope dims, v head separate) and GQA
(grouped key/value heads; Qwen3-MoE adds RMSNorm on each query and key head, Mixtral has none). Both end in
`attend`: causal `F.scaled_dot_product_attention` for rows of one sample (the kernel chosen from outside, see
`attention_backends`), or, for packed rows of several samples, attention that never crosses a sample's boundary
(`DocumentMask`: a block-diagonal causal mask for SDPA on the CPU, flex attention's block mask on CUDA)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from common.config import ModelConfig
from trainer.model.norm import RMSNorm
from trainer.model.rope import apply_rope, yarn_of

# DeepSeek's reference code builds the latent norms with the default epsilon, not rms_norm_eps; HF
# follows it, so we do too (the two agree for every released DeepSeek config, where both are 1e-6).
LATENT_NORM_EPS = 1e-6


@contextlib.contextmanager
def attention_backends(device: torch.device) -> Iterator[None]:
    """Prefer cuDNN SDPA on CUDA: flash rejects MLA's unequal q/k (192) and v (128) head dims and the
    memory-efficient kernel is ~10x slower there. On CPU the math path runs unchanged."""
    if device.type != "cuda":
        yield
        return
    order = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    with sdpa_kernel(order, set_priority=True):
        yield


def same_document(documents: torch.Tensor):
    """Flex attention's mask_mod of packed rows `documents` [B, S]: query q sees key k of its own document, k <= q."""

    def mask_mod(b, h, q, k):
        return (documents[b, q] == documents[b, k]) & (k <= q)

    return mask_mod


class DocumentMask:
    """Where each query of a packed batch may look: keys of its own document at or before it. `documents`
    [B, S] holds each position's document within its row (-1: padding, which sees only padding, so no row of
    the softmax is empty). Built once per forward and shared by every layer: on CUDA as flex attention's
    block mask (blocks wholly outside every document are skipped; compiled, not yet measured on a GPU),
    elsewhere as a dense bool mask for SDPA, which is exact and O(S^2) per row."""

    def __init__(self, documents: torch.Tensor) -> None:
        B, S = documents.shape
        self.flex: BlockMask | None = None
        self.dense: torch.Tensor | None = None
        if documents.is_cuda:
            self.flex = create_block_mask(same_document(documents), B, None, S, S, device=documents.device)
        else:
            causal = torch.ones(S, S, dtype=torch.bool, device=documents.device).tril()
            self.dense = ((documents.unsqueeze(2) == documents.unsqueeze(1)) & causal).unsqueeze(1)  # [B, 1, S, S]


_compiled_flex = None
_fused_saves = False  # set by `fused_kernel_saves` (trainer/plan.py's memory probe)


@contextlib.contextmanager
def fused_kernel_saves() -> Iterator[None]:
    """Causal attention off CUDA keeps for its backward what CUDA's fused kernels keep, for the memory planner.

    CUDA's SDPA kernels (cuDNN, flash, memory-efficient) keep q, k and v in the autocast dtype, the output and
    fp32 softmax statistics: O(tokens). The CPU runs MLA's attention on SDPA's math path (its flash kernel wants
    equal q/k and v head dims), which keeps fp32 operands and the S x S probabilities. trainer/plan.py measures
    blocks on the CPU to plan GPU memory, so inside this context `attend` runs `fused_saves_attention` instead: the
    same results, kept as the CUDA kernels keep them, the backward recomputed from them."""
    global _fused_saves
    _fused_saves = True
    try:
        yield
    finally:
        _fused_saves = False


@torch.library.custom_op("slipstream::fused_saves_attention", mutates_args=())
def fused_saves_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, gqa: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal SDPA as one op returning (output, fp32 log-sum-exp per query and head), like CUDA's fused kernels;
    activation checkpointing's selective policy keeps its results as it keeps theirs (trainer/model/recompute.py)."""
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    return out, torch.zeros(q.shape[:-1], dtype=torch.float32, device=q.device)


@fused_saves_attention.register_fake
def _(q, k, v, scale, gqa):
    return q.new_empty((*q.shape[:-1], v.shape[-1])), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _fused_saves_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, scale, gqa = inputs
    ctx.save_for_backward(q, k, v, *output)
    ctx.scale, ctx.gqa = scale, gqa


def _fused_saves_backward(ctx, grad, _grad_lse):  # type: ignore[no-untyped-def]
    q, k, v, _, _ = ctx.saved_tensors
    with torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=ctx.scale, enable_gqa=ctx.gqa)
        gq, gk, gv = torch.autograd.grad(out, (q, k, v), grad)
    return gq, gk, gv, None, None


fused_saves_attention.register_autograd(_fused_saves_backward, setup_context=_fused_saves_context)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: DocumentMask | None, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of q [B, heads, S, d], k [B, kv heads, S, d], v [B, kv heads, S, dv] -> [B, heads, S, dv],
    within each row's documents when `mask` is given (grouped kv heads are repeated by the kernel)."""
    gqa = k.shape[1] != q.shape[1]
    if mask is None and _fused_saves and torch.is_grad_enabled():
        dev = q.device.type
        if torch.is_autocast_enabled(dev):  # autocast casts SDPA's operands on CUDA; a custom Function is not cast
            q, k, v = (t.to(torch.get_autocast_dtype(dev)) for t in (q, k, v))
        return fused_saves_attention(q, k, v, scale, gqa)[0]
    if mask is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    if mask.flex is not None:
        global _compiled_flex
        if _compiled_flex is None:  # eager flex attention materialises the scores; compiled it is a fused kernel
            _compiled_flex = torch.compile(flex_attention)  # automatic dynamic shapes: row lengths vary per batch
        return _compiled_flex(q, k, v, block_mask=mask.flex, scale=scale, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense, scale=scale, enable_gqa=gqa)


class MLA(nn.Module):
    """Multi-head latent attention with HF DeepseekV3Attention's parameter names."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.nope_dim = cfg.qk_nope_head_dim
        self.rope_dim = cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        qk_dim = self.nope_dim + self.rope_dim
        yarn = yarn_of(cfg)
        self.scale = qk_dim**-0.5 if yarn is None else qk_dim**-0.5 * yarn.softmax_scale
        if cfg.q_lora_rank > 0:
            self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_heads * qk_dim, bias=False)
        else:
            self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * qk_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_lora_rank + self.rope_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, cfg.num_heads * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * self.v_dim, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        B, S, _ = x.shape
        if hasattr(self, "q_proj"):
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(B, S, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_rope = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, S, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos, sin, interleaved=True)
        k_rope = apply_rope(k_rope.view(B, S, 1, self.rope_dim), cos, sin, interleaved=True)
        q = torch.cat((q_nope, q_rope), dim=-1)
        k = torch.cat((k_nope, k_rope.expand(B, S, self.num_heads, self.rope_dim)), dim=-1)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask, self.scale)  # [B, heads, S, v_dim]
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.v_dim))


class GQA(nn.Module):
    """Grouped-query attention with HF Qwen3MoeAttention's / MixtralAttention's parameter names; per-head q/k
    RMSNorm (`q_norm`, `k_norm`) for Qwen3-MoE only (Mixtral has no such weights, so no such modules)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.arch == "qwen3_moe":
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: DocumentMask | None = None
    ) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_proj(x).view(B, S, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        v = self.v_proj(x).view(B, S, self.num_kv_heads, self.head_dim)
        q = apply_rope(q, cos, sin, interleaved=False)
        k = apply_rope(k, cos, sin, interleaved=False)
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, S, self.num_heads * self.head_dim))
