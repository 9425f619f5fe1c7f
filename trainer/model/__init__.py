"""The model: plain PyTorch modules for a DeepSeek-V3 / Qwen3-MoE shaped decoder. Nothing here knows
about ranks, files or optimizers; parallelism and precision are applied from outside."""

from trainer.model.transformer import (
    Transformer,
    attention_flops_per_token,
    build_model,
    compile_blocks,
    count_params,
    init_weights,
    logprobs_of,
)

__all__ = [
    "Transformer",
    "attention_flops_per_token",
    "build_model",
    "compile_blocks",
    "count_params",
    "init_weights",
    "logprobs_of",
]
