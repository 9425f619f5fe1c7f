"""MixtralForCausalLM interop, the softmax-routed family without shared experts (issue 34): its config.json
and its released tensor names. trainer/hf.py calls in here; everything else (attention, norms, embeddings,
the stacked expert split) is shared with the other families.

Our model (`trainer.model.arch = "mixtral"`) is GQA without q/k norm, softmax top-k renormalised, every layer
MoE, no shared experts. Its state dict uses the names of transformers' in-memory Mixtral (`mlp.gate`,
`mlp.experts.gate_up_proj`), which trainer/hf.py splits per expert (`mlp.experts.N.{gate,up,down}_proj`); the
released checkpoints (and vLLM's loader) name the MoE block `block_sparse_moe` and the expert matrices
w1 (gate), w3 (up), w2 (down). `released_name` / `our_name` translate one name each way."""

from __future__ import annotations

import re

from common.config import ConfigError, ModelConfig

ARCHITECTURE = "MixtralForCausalLM"

_PROJ_TO_W = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
_W_TO_PROJ = {w: proj for proj, w in _PROJ_TO_W.items()}
_OURS = re.compile(r"^(model\.layers\.\d+)\.mlp\.(gate\.weight|experts\.\d+\.(gate_proj|up_proj|down_proj)\.weight)$")
_RELEASED = re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.(gate\.weight|experts\.\d+\.(w1|w2|w3)\.weight)$")


def released_name(name: str) -> str:
    """Our per-expert HF name of a router or expert tensor as Mixtral's released checkpoints spell it
    (`model.layers.3.mlp.experts.5.up_proj.weight` -> `model.layers.3.block_sparse_moe.experts.5.w3.weight`);
    every other name is shared and comes back unchanged."""
    m = _OURS.match(name)
    if m is None:
        return name
    rest = m.group(2) if m.group(3) is None else m.group(2).replace(m.group(3), _PROJ_TO_W[m.group(3)])
    return f"{m.group(1)}.block_sparse_moe.{rest}"


def our_name(name: str) -> str:
    """The inverse of `released_name`; names outside Mixtral's MoE block come back unchanged."""
    m = _RELEASED.match(name)
    if m is None:
        return name
    rest = m.group(2) if m.group(3) is None else m.group(2).replace(m.group(3), _W_TO_PROJ[m.group(3)])
    return f"{m.group(1)}.mlp.{rest}"


def export_problems(cfg: ModelConfig) -> list[str]:
    """Why `cfg` cannot be written as MixtralForCausalLM (empty when it can): the Mixtral-only requirements
    of ModelConfig.check, where a run's config meets them first."""
    try:
        cfg.check()
    except ConfigError as e:
        return [str(e)]
    return []


def hf_config(cfg: ModelConfig, common: dict) -> dict:
    """config.json of MixtralForCausalLM from `cfg` (free of `export_problems`) and the fields every family
    shares (`common`, trainer/hf.py). Mixtral has one MLP width: its `intermediate_size` is the expert's (our
    moe_intermediate_size; our dense intermediate_size is unused, as no layer is dense)."""
    # Fields of the other families that Mixtral's config does not have.
    shared = {k: v for k, v in common.items() if k not in ("moe_intermediate_size", "norm_topk_prob", "attention_bias")}
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "mixtral",
        **shared,
        "intermediate_size": cfg.moe_intermediate_size,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_dim,
        "num_local_experts": cfg.n_routed_experts,
        "sliding_window": None,
        "router_jitter_noise": 0.0,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.0,
    }


def import_problems(hf: dict, max_seq_len: int) -> list[str]:
    """Fields of a Mixtral config.json that our model cannot honour, each named with its fix (empty: none)."""
    problems = []
    window = hf.get("sliding_window")
    if window is not None and int(window) < max_seq_len:
        problems.append(
            f"sliding_window = {window} is below max_seq_len = {max_seq_len}: our attention is full causal attention "
            "and would look further back than this model; import with max_seq_len <= the window, or set "
            "sliding_window to null in config.json"
        )
    if float(hf.get("router_jitter_noise") or 0.0) != 0.0:
        problems.append(
            f"router_jitter_noise = {hf['router_jitter_noise']}: our router has no training-time input jitter; "
            "set it to 0.0 in config.json"
        )
    return problems


def model_config(hf: dict, base: dict) -> ModelConfig:
    """Our ModelConfig from a Mixtral config.json dict free of `import_problems`; `base` holds the fields
    trainer/hf.py reads for every family (its moe_intermediate_size already Mixtral's intermediate_size)."""
    heads = hf["num_attention_heads"]
    return ModelConfig(
        arch="mixtral",
        **base,
        first_k_dense=0,
        n_routed_experts=hf["num_local_experts"],
        n_shared_experts=0,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
    )
