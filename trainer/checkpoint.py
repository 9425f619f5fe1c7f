"""Training checkpoints through torch.distributed.checkpoint (DCP): the model (with the router
biases), the AdamW state, the schedule position, every RNG, the data cursor, an opaque slot for the
flow runtime's state, and the config (its identity fingerprint decides whether a resume is allowed).
DCP writes one directory per checkpoint and works in a single process without a process group; under
data/expert parallelism every rank calls the same functions. Resume is exact: N steps, save, load,
N more steps gives bitwise the weights of 2N uninterrupted steps (on CPU)."""

from __future__ import annotations

import os
import random
import shutil
import time
import tomllib
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.storage import WriteResult

from common.config import Config, from_dict, identity_diff, identity_fingerprint, to_toml
from common.fault import fault_point
from common.run_secrets import without_tokens
from trainer.optim import Optimizer

_PREFIX = "step_"


class CheckpointMismatch(RuntimeError):
    """The checkpoint belongs to a run with a different identity (model shape, data, seed, ...)."""


@dataclass
class TrainState:
    """Where a run stands, besides tensors."""

    step: int = 0
    tokens: int = 0
    data_cursor: dict[str, Any] = field(default_factory=dict)
    """Position of the data source (opaque to the checkpoint; the source reads it back)."""
    flow_state: dict[str, Any] = field(default_factory=dict)
    """Queued / in-flight / buffered prompts of the flow runtime (opaque)."""
    lineage: list[list[int]] = field(default_factory=list)
    """The RL run's lineage: [step, version] of every weight publication (common/weights/lineage.py)."""


@dataclass
class Companion:
    """A model kept beside the policy and checkpointed with it: the critic (with its optimizer) or the
    frozen reference policy (no optimizer)."""

    model: nn.Module
    optimizer: Optimizer | None = None


def _companion_state(companions: Mapping[str, Companion]) -> dict[str, Any]:
    """The DCP entries of the companions: f"{name}.model", and with an optimizer f"{name}.optim" and
    f"{name}.meta" (its step and schedule-token counters)."""
    out: dict[str, Any] = {}
    for name, c in companions.items():
        if c.optimizer is None:
            out[f"{name}.model"] = get_model_state_dict(c.model)
            continue
        out[f"{name}.model"], out[f"{name}.optim"] = get_state_dict(c.model, c.optimizer.optimizers)
        out[f"{name}.meta"] = {"optimizer_steps": c.optimizer.steps, "optimizer_tokens": c.optimizer.tokens}
    return out


class CheckpointSchedule:
    """When a run saves mid-run: every `interval_steps` steps, and when `interval_minutes` passed since the
    last save (or the start), whichever comes first."""

    def __init__(self, interval_steps: int, interval_minutes: float) -> None:
        self.interval_steps, self.interval_s = interval_steps, interval_minutes * 60.0
        self.last = time.monotonic()

    def due(self, step: int) -> bool:
        by_steps = self.interval_steps > 0 and step % self.interval_steps == 0
        by_time = self.interval_s > 0 and time.monotonic() - self.last >= self.interval_s
        return by_steps or by_time

    def saved(self) -> None:
        self.last = time.monotonic()


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": np.random.get_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every call that no process group exists; single-process use is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


class _Writer(dcp.FileSystemWriter):
    """DCP's file writer with the chaos benchmark's fault point (common/fault.py) between the data files and
    the `.metadata` that completes a checkpoint."""

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        fault_point("checkpoint_save")
        super().finish(metadata, results)


def _dcp_save(state: dict[str, Any], path: Path) -> None:
    with _single_process_quiet():
        dcp.save(state, storage_writer=_Writer(str(path)))


def _dcp_load(state: dict[str, Any], path: str | Path) -> None:
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path))


def checkpoint_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"{_PREFIX}{step:08d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under root, oldest first (a directory without DCP metadata is incomplete)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.name.startswith(_PREFIX) and (p / ".metadata").is_file()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))


def checkpoint_steps(root: str | Path) -> list[int]:
    """The steps of the complete checkpoints under root, ascending."""
    return [int(p.name[len(_PREFIX) :]) for p in list_checkpoints(root)]


def save_checkpoint(
    root: str | Path,
    model: nn.Module,
    optimizer: Optimizer,
    state: TrainState,
    cfg: Config,
    keep: int = 0,
    companions: Mapping[str, Companion] | None = None,
) -> Path:
    """Write checkpoint `root/step_<state.step>` (with the `companions` beside the model); then keep only the
    newest `keep` (0 = all).

    The checkpoint is written into `root/.step_<N>.partial` and renamed into place once whole, so a save that
    dies (a kill, a full disk) never leaves a directory that `list_checkpoints` takes, nor damages a complete
    checkpoint of the same step (the end of a run saves the step an interval save may have saved)."""
    path = checkpoint_dir(root, state.step)
    partial = path.with_name(f".{path.name}.partial")
    # One rank moves directories: under several ranks each would race the others. DCP's first collective
    # (planning) comes before any rank writes, so the others never write into a directory removed here.
    lead = not dist.is_initialized() or dist.get_rank() == 0
    if lead:
        for stale in Path(root).glob(f".{_PREFIX}*"):  # left by a save that died; this one is the only writer
            shutil.rmtree(stale)
    model_sd, optim_sd = get_state_dict(model, optimizer.optimizers)
    _dcp_save(
        {
            **_companion_state(companions or {}),
            "model": model_sd,
            "optim": optim_sd,
            "meta": {
                "state": state,
                "optimizer_steps": optimizer.steps,
                "optimizer_tokens": optimizer.tokens,
                "fingerprint": identity_fingerprint(cfg),
                "config": to_toml(without_tokens(cfg)),  # a checkpoint travels: no bearer tokens in it
            },
            "rng": _rng_state(),
        },
        partial,
    )
    if lead:
        if path.exists():  # replaced whole: moved aside first, so a kill in between leaves it in a dot directory
            replaced = path.with_name(f".{path.name}.replaced")
            os.rename(path, replaced)
            os.rename(partial, path)
            shutil.rmtree(replaced)
        else:
            os.rename(partial, path)
        if keep > 0:
            for old in list_checkpoints(root)[:-keep]:
                shutil.rmtree(old)
    return path


def load_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizer | None,
    cfg: Config,
    companions: Mapping[str, Companion] | None = None,
) -> TrainState:
    """Restore a checkpoint into model (and optimizer, RNG) and its `companions`; refuses one whose config
    identity differs or that lacks a companion."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint (no .metadata); pick one of list_checkpoints()")
    meta: dict[str, Any] = {"meta": {"fingerprint": "", "config": ""}}
    _dcp_load(meta, path)
    saved_fp = meta["meta"]["fingerprint"]
    if saved_fp != identity_fingerprint(cfg):
        old = from_dict(tomllib.loads(meta["meta"]["config"]))
        raise CheckpointMismatch(
            f"checkpoint {path} was written by a different run (identity {saved_fp} != "
            f"{identity_fingerprint(cfg)}): identity fields differ: {', '.join(identity_diff(old, cfg))}. "
            "Restore those values, or start a new run directory."
        )
    full: dict[str, Any] = {"meta": {"state": None, "optimizer_steps": 0, "optimizer_tokens": 0}}
    if optimizer is not None:
        full["model"], full["optim"] = get_state_dict(model, optimizer.optimizers)
        full["rng"] = _rng_state()
    else:
        full["model"] = get_model_state_dict(model)
    _dcp_load(full, path)
    if optimizer is not None:
        set_state_dict(model, optimizer.optimizers, model_state_dict=full["model"], optim_state_dict=full["optim"])
        optimizer.steps = full["meta"]["optimizer_steps"]
        optimizer.tokens = full["meta"]["optimizer_tokens"]
        _set_rng_state(full["rng"])
    else:
        set_model_state_dict(model, full["model"])
    _load_companions(path, companions or {})
    return full["meta"]["state"]


def _load_companions(path: Path, companions: Mapping[str, Companion]) -> None:
    if not companions:
        return
    saved = {key.split(".")[0] for key in dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata}
    lacking = sorted(set(companions) - saved)
    if lacking:
        raise CheckpointMismatch(
            f"checkpoint {path} holds no {', '.join(lacking)} model, which this run keeps beside the policy; resume "
            "from a checkpoint of a run that had it, or start a new run directory"
        )
    state = _companion_state(companions)
    _dcp_load(state, path)
    for name, c in companions.items():
        if c.optimizer is None:
            set_model_state_dict(c.model, state[f"{name}.model"])
            continue
        set_state_dict(
            c.model,
            c.optimizer.optimizers,
            model_state_dict=state[f"{name}.model"],
            optim_state_dict=state[f"{name}.optim"],
        )
        c.optimizer.steps = state[f"{name}.meta"]["optimizer_steps"]
        c.optimizer.tokens = state[f"{name}.meta"]["optimizer_tokens"]


def load_model_weights(path: str | Path, model: nn.Module) -> None:
    """Only the model tensors of a checkpoint (to start a new run from it; no identity check)."""
    sd = {"model": get_model_state_dict(model)}
    _dcp_load(sd, path)
    set_model_state_dict(model, sd["model"])


def save_model_weights(path: str | Path, model: nn.Module, config_toml: str) -> Path:
    """The model tensors alone, with the config they belong to (`to_toml` of it), as a checkpoint directory
    that `load_model_weights` (trainer.init) and `checkpoint_config` read; `slipstream convert` writes these."""
    path = Path(path)
    _dcp_save({"model": get_model_state_dict(model), "meta": {"config": config_toml}}, path)
    return path


def checkpoint_config(path: str | Path) -> Config:
    """The config a checkpoint was saved with (training checkpoints and `save_model_weights` record it)."""
    meta: dict[str, Any] = {"meta": {"config": ""}}
    _dcp_load(meta, path)
    return from_dict(tomllib.loads(meta["meta"]["config"]))
