"""What every trainer driver starts from: the device it trains on and the model of `trainer.init` (an HF
directory or one of our checkpoints), or a fresh one. Pretraining and the RL ranks both build theirs here,
below both of them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from common.config import Config
from trainer.checkpoint import load_model_weights
from trainer.experts import expert_shape, select_backend
from trainer.hf import load_hf_state
from trainer.hf_stream import place_without_experts, stream_hf_state
from trainer.model import Transformer, build_model


def resolve_device(name: str) -> torch.device:
    """The device of `trainer.device`: "auto" is CUDA when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


Loader = Callable[[Transformer], object]
"""Fills a model's weights in place; run once its experts are sharded."""


def starting_model(
    cfg: Config, device: torch.device, default_init: Path | None = None
) -> tuple[Transformer, Loader | None]:
    """The model of `trainer.init` (an HF directory or one of our checkpoints); without one, `default_init`
    (an HF directory: the RL trainer passes the checkpoint its workers serve), else fresh from run.seed.

    From an HF directory the weights are not read yet: the model comes back uninitialised with the loader
    to run once the training core has sharded its experts, so each rank reads only its own experts, one
    entry at a time (trainer/hf_stream.py). Its experts are left on the meta device until then: the sharding
    allocates this rank's block only, on `device` (host or accelerator)."""
    tc = cfg.trainer
    dtype = torch.bfloat16 if tc.dtype == "bfloat16" else torch.float32
    backend = select_backend(tc.experts.backend, device, dtype, tc.experts.precision, expert_shape(tc.model))
    init = Path(tc.init) if tc.init else default_init
    if init is not None and (init / "config.json").is_file():
        model = place_without_experts(build_model(tc.model, backend, seed=None), device)
        return model, partial(stream_hf_state, path=init)
    model = build_model(tc.model, backend, seed=cfg.run.seed if init is None else None)
    if init is not None:
        load_weights(model, init, "trainer.init")
    return model.to(device), None


def initial_model(cfg: Config, device: torch.device, default_init: Path | None = None) -> Transformer:
    """`starting_model` with its weights loaded: the full, unsharded model."""
    model, load = starting_model(cfg, device, default_init)
    if load is not None:
        load(model)
    return model


def load_weights(model: Transformer, path: Path, key: str) -> None:
    """Load `path` (an HF directory or one of our checkpoints) into the full, unsharded `model`; `key` names
    the config field that gave the path, for the error."""
    if (path / "config.json").is_file():
        load_hf_state(model, path)
    elif (path / ".metadata").is_file():
        load_model_weights(path, model)
    else:
        raise FileNotFoundError(f"{key} = {str(path)!r} is neither an HF directory nor a checkpoint")
