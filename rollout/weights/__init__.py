"""Versioned weight sync, the trainer side (DESIGN section 6), one module per part:

- publisher.py: `WeightPublisher`, which checks the version number, sends a version to every live worker
  through the run's transport and commits it (`weights:current`, `weights:log`, the event).
- base.py: what a transport is (`WeightTransport`: prepare, send, finish), `PublishResult`, `PublishError`.
- file.py: the `file` transport (safetensors shards under the weight dir, streamed to the workers while they
  are written); nccl.py: the `nccl` transport (vLLM's NCCL engine, GPUs only); factory.py: the transport
  `rollout.weight_backend` names.
- writer.py: the streamed writer (`VersionWriter`, one `VersionPart` per trainer rank); export.py: HF naming
  with one name per expert.
- versions.py: the version index on disk (committed, unfinished and newest versions, pruning, pinning).
- workers.py: driving one worker's weight-sync routes over HTTP (`apply_version`, `WorkerDriver`).

The fleet's records in Redis (live workers, eviction, the version each serves) are common/fleet.py's. Nothing
here imports torch at import time (tensors only pass through), so the evaluator and the worker role import
these modules without it. This package re-exports the names other modules import from `rollout.weights`.
"""

from common.fleet import (
    LIVENESS_POLL_S,
    WorkerError,
    current_version,
    evict,
    live_workers,
    set_worker_version,
    while_alive,
)
from rollout.weight_files import PartReport
from rollout.weights.base import PublishError, PublishResult, WeightTransport
from rollout.weights.export import hf_tensors, hf_views
from rollout.weights.factory import make_transport
from rollout.weights.file import SHARD_WAIT_S, FileTransport
from rollout.weights.nccl import NcclGroup, NcclTransport
from rollout.weights.publisher import WEIGHTS_LOG_MAXLEN, WeightPublisher
from rollout.weights.versions import (
    PINS_NAME,
    committed_versions,
    newest_version,
    pin_versions,
    pinned_versions,
    prune_versions,
    unfinished_versions,
    weight_root,
)
from rollout.weights.workers import (
    UPDATE_TIMEOUT_S,
    WorkerDriver,
    WorkerOutcome,
    apply_version,
    label_version,
    served_version,
    weight_lock,
)
from rollout.weights.writer import PeerWriters, VersionPart, VersionWriter, count_shards, plan_shards, write_version

__all__ = [
    "LIVENESS_POLL_S",
    "PINS_NAME",
    "SHARD_WAIT_S",
    "UPDATE_TIMEOUT_S",
    "WEIGHTS_LOG_MAXLEN",
    "FileTransport",
    "NcclGroup",
    "NcclTransport",
    "PartReport",
    "PeerWriters",
    "PublishError",
    "PublishResult",
    "VersionPart",
    "VersionWriter",
    "WeightPublisher",
    "WeightTransport",
    "WorkerDriver",
    "WorkerError",
    "WorkerOutcome",
    "apply_version",
    "committed_versions",
    "count_shards",
    "current_version",
    "evict",
    "hf_tensors",
    "hf_views",
    "label_version",
    "live_workers",
    "make_transport",
    "newest_version",
    "pin_versions",
    "pinned_versions",
    "plan_shards",
    "prune_versions",
    "served_version",
    "set_worker_version",
    "unfinished_versions",
    "weight_lock",
    "weight_root",
    "while_alive",
    "write_version",
]
