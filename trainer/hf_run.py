"""A run whose model is an HF checkpoint directory (rollout.model = a directory with config.json): the
trainer's model shape comes from that config.json (trainer/hf.py model_config_from_hf) rather than from
[trainer.model] copied by hand, and trainer.init defaults to the directory.

Which [trainer.model] fields the user set is told by their value: a field left at its schema default takes
config.json's value; a field set to anything else must equal config.json's, else the run is refused naming
both values. `max_seq_len` is the trainer's own limit, not part of the checkpoint: it stays as configured."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

from common.config import Config, ConfigError, ModelConfig
from trainer.hf import model_config_from_hf
from trainer.tinykit import TINY_MODELS

log = logging.getLogger(__name__)

# ModelConfig fields that describe the run, not the checkpoint.
RUN_FIELDS = ("max_seq_len",)


def hf_model_dir(cfg: Config) -> Path | None:
    """rollout.model as an HF directory, or None for a tiny-model kit name."""
    if cfg.rollout.model in TINY_MODELS:
        return None
    path = Path(cfg.rollout.model)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"rollout.model = {cfg.rollout.model!r} is neither a tiny model ({', '.join(TINY_MODELS)}) nor an HF "
            "checkpoint directory with a config.json"
        )
    return path


def merged_model_config(configured: ModelConfig, hf: dict, source: str) -> ModelConfig:
    """The model of config.json (`hf`, read from `source`) with the run fields of `configured`; ConfigError
    naming every field of `configured` set away from its default that disagrees with config.json."""
    from_hf = model_config_from_hf(hf, max_seq_len=configured.max_seq_len)
    default = ModelConfig()
    conflicts = []
    for f in dataclasses.fields(ModelConfig):
        if f.name in RUN_FIELDS:
            continue
        mine, theirs = getattr(configured, f.name), getattr(from_hf, f.name)
        if mine != getattr(default, f.name) and mine != theirs:
            conflicts.append(f"trainer.model.{f.name} = {mine!r} but {source} gives {theirs!r}")
    if conflicts:
        raise ConfigError(
            "; ".join(conflicts) + ": the trainer's model comes from rollout.model's config.json; remove these "
            "fields from [trainer.model] (or make them equal)"
        )
    return from_hf


def config_for_hf_model(cfg: Config) -> Config:
    """`cfg` with trainer.model taken from rollout.model's config.json and trainer.init defaulting to that
    directory; `cfg` itself for a tiny-model kit name."""
    path = hf_model_dir(cfg)
    if path is None:
        return cfg
    source = str(path / "config.json")
    model = merged_model_config(cfg.trainer.model, json.loads((path / "config.json").read_text()), source)
    trainer = dataclasses.replace(cfg.trainer, model=model, init=cfg.trainer.init or str(path))
    log.info("trainer.model from %s: %s", source, describe(model))
    return dataclasses.replace(cfg, trainer=trainer)


def describe(m: ModelConfig) -> str:
    """One line of the model's shape, for the log: what a user checks against their checkpoint's card."""
    rope = f"yarn x{m.rope_factor:g} over {m.rope_original_max_len}" if m.rope_scaling == "yarn" else "default"
    return (
        f"{m.arch}, {m.num_layers} layers ({m.first_k_dense} dense), hidden {m.hidden_size}, "
        f"{m.n_routed_experts} experts top-{m.num_experts_per_tok} + {m.n_shared_experts} shared, rope {rope}"
    )


def refuse_quantized_rollout_model(cfg: Config) -> None:
    """ConfigError when rollout.model is an FP8 block-quantized directory: vLLM builds FP8 layers for it, and
    the trainer publishes bf16/fp32 weights (its masters), which those layers cannot take. The trainer can
    start from such a checkpoint (trainer.init dequantizes it); the workers must serve a dequantized copy."""
    path = hf_model_dir(cfg)
    if path is None or "quantization_config" not in json.loads((path / "config.json").read_text()):
        return
    raise ConfigError(
        f"rollout.model = {str(path)!r} is FP8 block-quantized (its config.json has a quantization_config): the "
        "trainer publishes bf16/fp32 weights, which vLLM's FP8 layers for it cannot load. Serve a dequantized "
        f"copy: `slipstream convert {path} CKPT` then `slipstream convert CKPT DIR --dtype bfloat16`, and set "
        "rollout.model = DIR"
    )
