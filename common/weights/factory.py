"""The weight transport a run uses: the one `rollout.weight_backend` names."""

from __future__ import annotations

from pathlib import Path

from common.config import RolloutConfig
from common.weights.base import WeightTransport
from common.weights.file import FileTransport
from common.weights.nccl import NcclGroup, NcclTransport
from common.weights.workers import WorkerDriver


def make_transport(
    cfg: RolloutConfig,
    root: Path,
    driver: WorkerDriver,
    nccl_group: NcclGroup | None = None,
    model_files: Path | None = None,
    group_host: str = "127.0.0.1",
) -> WeightTransport:
    """`file`: versions under `root` (see file.py), each carrying the model files of the HF directory
    `model_files` (config, tokenizer, chat template). `collective`: the same files, and each version broadcast to
    the live workers from every trainer rank, through groups meeting at `group_host` (see collective.py). `nccl`:
    a broadcast to the fixed workers of `nccl_group`, which the trainer forms (see nccl.py)."""
    if cfg.weight_backend == "collective":
        from common.weights.collective import CollectiveTransport  # torch.distributed: the trainer's side only

        return CollectiveTransport(
            root,
            driver,
            cfg.weight_shard_mb << 20,
            cfg.keep_versions,
            group_host,
            cfg.weight_group_timeout_s,
            model_files,
            cfg.weight_delta,
            cfg.weight_snapshot_every,
        )
    if cfg.weight_backend == "file":
        return FileTransport(
            root,
            driver,
            cfg.weight_shard_mb << 20,
            cfg.stream_weights,
            cfg.keep_versions,
            model_files,
            cfg.weight_delta,
            cfg.weight_snapshot_every,
        )
    if cfg.weight_backend == "nccl":
        if nccl_group is None:
            raise ValueError(
                "rollout.weight_backend = 'nccl' needs the NCCL group of the trainer and a fixed set of workers "
                "(NcclGroup: their URLs, the rendezvous address and port); pass nccl_group, or use 'file'"
            )
        return NcclTransport(
            list(nccl_group.urls), nccl_group.master_address, nccl_group.master_port, cfg.tensor_parallel_size, driver
        )
    raise ValueError(f"rollout.weight_backend = {cfg.weight_backend!r} is not one of 'file', 'collective', 'nccl'")
