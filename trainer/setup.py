"""What every trainer driver starts from: the device it trains on and the model of `trainer.init` (an HF
directory or one of our checkpoints), or a fresh one. Pretraining and the RL ranks both build theirs here,
below both of them."""

from __future__ import annotations

from pathlib import Path

import torch

from common.config import Config
from trainer.checkpoint import load_model_weights
from trainer.experts import select_backend
from trainer.hf import load_hf_state
from trainer.model import Transformer, build_model


def resolve_device(name: str) -> torch.device:
    """The device of `trainer.device`: "auto" is CUDA when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def initial_model(cfg: Config, device: torch.device, default_init: Path | None = None) -> Transformer:
    """The model of `trainer.init` (an HF directory or one of our checkpoints); without one, `default_init`
    (an HF directory: the RL trainer passes the checkpoint its workers serve), else fresh from run.seed."""
    tc = cfg.trainer
    dtype = torch.bfloat16 if tc.dtype == "bfloat16" else torch.float32
    backend = select_backend(tc.experts.backend, device, dtype, tc.experts.precision)
    init = Path(tc.init) if tc.init else default_init
    model = build_model(tc.model, backend, seed=cfg.run.seed if init is None else None)
    if init is not None:
        load_weights(model, init, "trainer.init")
    return model.to(device)


def load_weights(model: Transformer, path: Path, key: str) -> None:
    """Load `path` (an HF directory or one of our checkpoints) into the full, unsharded `model`; `key` names
    the config field that gave the path, for the error."""
    if (path / "config.json").is_file():
        load_hf_state(model, path)
    elif (path / ".metadata").is_file():
        load_model_weights(path, model)
    else:
        raise FileNotFoundError(f"{key} = {str(path)!r} is neither an HF directory nor a checkpoint")
