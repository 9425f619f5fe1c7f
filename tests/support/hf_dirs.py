"""Tiny HF checkpoint directories written by transformers itself (random weights, fp32), with the tiny kit's
tokenizer and chat template: what a user brings as "their own checkpoint" in the tests of issue 34."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from trainer.tinykit import build_tokenizer

# Qwen3-MoE at the tiny kit's size: 64 wide, 2 layers (none dense), 8 experts top-2, GQA 4 heads over 2,
# head size 32 (one of vLLM's CPU head sizes), vocabulary of the tiny tokenizer.
TINY_QWEN3 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


# DeepSeek-V3 at the tiny kit's size: MLA with the 512 + 64 latent vLLM's CPU MLA needs, a dense first layer,
# 8 routed experts top-2 and one shared expert, sigmoid routing with the correction bias, default RoPE.
TINY_DEEPSEEK_V3 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
    routed_scaling_factor=1.0,
    norm_topk_prob=True,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    rope_interleave=True,
    # Written by DeepSeek-V3's release and read by vLLM (not by transformers, which always routes this way).
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    max_position_embeddings=512,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_qwen3_dir(out: Path, seed: int = 0) -> Path:
    """Write a random tiny Qwen3MoeForCausalLM with transformers' save_pretrained, then the tiny kit's tokenizer
    files (tokenizer.json, tokenizer_config.json with its chat template, special_tokens_map.json)."""
    import transformers

    return _write(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(**TINY_QWEN3)), out, seed)


# The released DeepSeek-V3 / Kimi-K2 YaRN settings (beta 32 / 1, mscale 1 / 1) over a 64-token original context
# stretched 8 times: TINY_DEEPSEEK_V3's 512 positions.
YARN_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def tiny_deepseek_v3_dir(out: Path, seed: int = 0, yarn: bool = False) -> Path:
    """As tiny_qwen3_dir, a DeepseekV3ForCausalLM; `yarn`: with YaRN RoPE as the released checkpoints have it."""
    import transformers

    fields = {**TINY_DEEPSEEK_V3, **({"rope_parameters": YARN_ROPE} if yarn else {})}
    return _write(transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**fields)), out, seed)


# Mixtral at the tiny kit's size: 2 attention heads of 32 (one of vLLM's CPU head sizes) over 1 KV head,
# 8 experts of width 32, top-2, every layer MoE.
TINY_MIXTRAL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    sliding_window=None,
    tie_word_embeddings=False,
    rope_theta=10000.0,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_mixtral_dir(out: Path, seed: int = 0) -> Path:
    """As tiny_qwen3_dir, a MixtralForCausalLM."""
    import transformers

    return _write(transformers.MixtralForCausalLM(transformers.MixtralConfig(**TINY_MIXTRAL)), out, seed)


def randomize_hf(model: torch.nn.Module, seed: int, std: Callable[[], float] = lambda: 0.05) -> torch.nn.Module:
    """`model` in fp32 eval mode with N(0, std()) weights (a draw of std per tensor) except the norms, and DeepSeek's
    expert correction bias N(0, 0.05): transformers zero-initialises the router and the bias, and random weights make
    routing matter."""
    torch.manual_seed(seed)
    model = model.float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, std())
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.05)
    return model


def _write(model: torch.nn.Module, out: Path, seed: int) -> Path:
    model = randomize_hf(model, seed)
    model.save_pretrained(out)
    build_tokenizer(out)
    return out
