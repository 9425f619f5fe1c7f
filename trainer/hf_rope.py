"""RoPE in HF config.json: our ModelConfig's rope fields to and from the `rope_parameters` (transformers 5) and
`rope_scaling` (released checkpoints, transformers 4) dicts, for default RoPE and YaRN. Reading follows the
rules transformers applies to the same dict, so an imported model computes what transformers computes; what
transformers and vLLM would read differently (a lone mscale, an explicit attention_factor) is refused, so
that a checkpoint trains and serves as one model. Other rope types are refused by name."""

from __future__ import annotations

from typing import Any

from common.config import ModelConfig
from trainer.hf_errors import HFFormatError

_DEFAULT_THETA = 10000.0
_YARN_KEYS = {
    "rope_type",
    "type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
    "truncate",
    "partial_rotary_factor",
}


def hf_rope_parameters(cfg: ModelConfig) -> dict[str, Any]:
    """The rope dict of `cfg` (written as both rope_parameters and, for older readers, rope_scaling)."""
    if cfg.rope_scaling == "none":
        return {"rope_type": "default", "rope_theta": cfg.rope_theta}
    return {
        "rope_type": "yarn",
        "rope_theta": cfg.rope_theta,
        "factor": cfg.rope_factor,
        "original_max_position_embeddings": cfg.rope_original_max_len,
        "beta_fast": cfg.rope_beta_fast,
        "beta_slow": cfg.rope_beta_slow,
        "mscale": cfg.rope_mscale,
        "mscale_all_dim": cfg.rope_mscale_all_dim,
    }


def rope_fields_from_hf(hf: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig keyword arguments (rope_theta, rope_scaling, rope_*) from an HF config.json dict."""
    # transformers takes a non-empty rope_scaling over rope_parameters, and the dict's rope_theta over the
    # top-level one.
    rope = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    theta = float(rope.get("rope_theta") or hf.get("rope_theta") or _DEFAULT_THETA)
    kind = rope.get("rope_type", rope.get("type")) or "default"
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1.0):
        raise HFFormatError(f"partial_rotary_factor = {partial} is not supported; only full-width RoPE is")
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "yarn":
        raise HFFormatError(f"rope type {kind!r} is not supported; only default RoPE and yarn are")
    return {"rope_theta": theta, "rope_scaling": "yarn", **_yarn_fields(rope, hf)}


def _yarn_fields(rope: dict[str, Any], hf: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(rope) - _YARN_KEYS)
    if unknown:
        # attention_factor among them: transformers uses it for cos/sin, vLLM's DeepSeek ignores it.
        raise HFFormatError(f"yarn rope parameters {unknown} are not supported (known: {sorted(_YARN_KEYS)})")
    if rope.get("truncate", True) is not True:
        raise HFFormatError("yarn with truncate = false is not supported; DeepSeek's rounded ramp bounds are")
    original = rope.get("original_max_position_embeddings")
    top = hf.get("original_max_position_embeddings")
    if original is not None and top is not None and top != original:
        raise HFFormatError(
            f"original_max_position_embeddings is {top} at the top level but {original} in the rope parameters; "
            "transformers and vLLM read different ones: make them equal"
        )
    original = int(original or top or hf["max_position_embeddings"])
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else hf["max_position_embeddings"] / original
    mscale, mscale_all_dim = rope.get("mscale") or 0.0, rope.get("mscale_all_dim") or 0.0
    if not mscale_all_dim:
        # transformers then scales cos/sin by 1 + 0.1 ln(factor) whatever mscale says; vLLM's DeepSeek reads
        # mscale. Only mscale 1 (or none) means the same to both.
        if mscale not in (0.0, 1.0):
            raise HFFormatError(
                f"yarn mscale = {mscale} without mscale_all_dim: transformers ignores it and vLLM applies it; "
                "set mscale to 1 or give mscale_all_dim"
            )
        mscale = 1.0
    elif not mscale:
        raise HFFormatError(
            f"yarn mscale_all_dim = {mscale_all_dim} without mscale: transformers scales cos/sin by "
            "1 + 0.1 ln(factor), vLLM divides that by 1 + 0.1 mscale_all_dim ln(factor); give mscale (DeepSeek-V3: 1.0)"
        )
    return {
        "rope_factor": factor,
        "rope_original_max_len": original,
        "rope_beta_fast": float(rope.get("beta_fast") or 32.0),
        "rope_beta_slow": float(rope.get("beta_slow") or 1.0),
        "rope_mscale": float(mscale),
        "rope_mscale_all_dim": float(mscale_all_dim),
    }
