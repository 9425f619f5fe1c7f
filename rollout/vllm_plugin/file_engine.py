"""The `file` weight-transfer engine: applies a published weight version read from safetensors files.

Update info is `{"path": DIR_OR_FILE}`: every `*.safetensors` file of a complete version directory
is read in name order. When the directory has an index with checksums (`model.safetensors.index.json`,
which the publisher writes), each file is read once into memory, its size and CRC-32 checked against
the index, and its tensors loaded from those bytes; a mismatch, a shard missing or a shard the index
does not know raises before that file is loaded. With `{"path": DIR, "shards": K}` the version is still
being written (the publisher streams it; layout in common/weights/index.py): shard i appears by an
atomic rename once whole, so the engine loads shard i while the publisher (or another trainer rank)
writes shard i+1. It waits at most `wait_s` seconds for each shard and stops at once if a writer
leaves an `ABORTED` file (its write failed) or the directory goes away (a publisher killed mid-write left no
marker; the trainer that resumes removes its unfinished directory). Streamed shards are NOT checksummed: the index is written
after the last shard, when the load is already done; the atomic rename is what guards them. A version
published as a delta (rollout.weight_delta, common/weights/delta.py) is decoded against the weights the engine
holds from the last one (or, when it holds another version, against its base rebuilt from the snapshot and
deltas on disk); every decoded tensor, streamed or not, is checked against its CRC-32 first. Tensors
are streamed, one at a time, into `model.load_weights` inside vLLM's layer-wise
reload (`initialize_layerwise_reload` on start, `finalize_layerwise_reload` on finish), so HF-named
checkpoint tensors (one name per expert) are sharded, fused and post-processed exactly as at load.
With `{"group": ...}` (the collective transport, common/weights/collective.py) the shards of a streamed version
come through torch.distributed groups from the trainer ranks, each checked against the CRC-32 its sender sent; only
what a broken group did not deliver is read from the files. Otherwise no process group or handshake is needed:
trainer and workers only share the files.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from common.weights.delta import DeltaDecoder, DeltaError, HeldWeights, rebuild, shard_tensors
from common.weights.group import GroupSpec, receive_shards
from common.weights.index import ABORT_MARKER, committed_shards, read_index, shard_name
from common.weights.versions import version_of_dir

_POLL_S = 0.001

log = logging.getLogger(__name__)


@dataclass
class FileInitInfo(WeightTransferInitInfo):
    """Nothing to set up: the files are the transport."""


@dataclass
class FileUpdateInfo(WeightTransferUpdateInfo):
    path: str
    """A safetensors file, or a directory whose *.safetensors files together hold the version."""
    shards: int = 0
    """When > 0, the version is being streamed into `path` as this many shards; wait for each."""
    wait_s: float = 300.0
    """How long to wait for each streamed shard before giving up."""
    group: dict[str, Any] | None = None
    """A version sent by the collective transport (common/weights/collective.py): its groups' GroupSpec, this
    worker's `rank` in each, and `owned`, [first shard, count] per trainer rank. The shards come through the
    groups, checksummed; those a broken group did not deliver are read from the streamed files."""
    received: int = field(default=0, init=False)
    """How many shards came through the groups (counted while reading)."""

    def files(self) -> Iterator[Path]:
        """The version's files in load order; for a stream, each one once it is whole."""
        p = Path(self.path)
        if self.shards > 0:
            for i in range(self.shards):
                yield self._wait_for(p / shard_name(i, self.shards), i)
            return
        if p.is_file():
            yield p
            return
        # The index (model.safetensors.index.json) does not match this pattern.
        files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
        if not files:
            raise FileNotFoundError(
                f"file weight update: {self.path!r} is not a safetensors file nor a directory holding any; "
                "is the weight dir shared with this worker (rollout.weight_dir)?"
            )
        yield from files

    def _wait_for(self, shard: Path, index: int) -> Path:
        deadline = time.monotonic() + self.wait_s
        abort = shard.parent / ABORT_MARKER
        while not shard.exists():
            if abort.exists():
                raise RuntimeError(
                    f"file weight update: the publisher aborted the version streamed into {shard.parent}: "
                    f"{abort.read_text()[:500]}"
                )
            if not shard.parent.is_dir():
                # A publisher killed mid-write leaves no marker; its successor removes the unfinished directory.
                raise RuntimeError(
                    f"file weight update: {shard.parent} was removed before shard {index + 1} of {self.shards} "
                    "appeared: its publisher died mid-write and the version will never be complete"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"file weight update: shard {index + 1} of {self.shards} ({shard}) did not appear within "
                    f"{self.wait_s:.0f} s; did the publisher stop?"
                )
            time.sleep(_POLL_S)
        return shard

    def shard_data(self) -> Iterator[tuple[Path, bytes]]:
        """Every file of the version with its bytes, in load order; a complete version with an index is checked
        file by file (CorruptShardError names the file, the expected and the found value)."""
        p = Path(self.path)
        if self.group is not None:
            yield from self._group_shards(p)
            return
        expected = read_index(p) if self.shards == 0 and p.is_dir() else None
        if expected is None:
            for f in self.files():
                yield f, f.read_bytes()
            return
        list(self.files())  # says so when the directory holds no shard at all
        yield from committed_shards(p, expected)

    def _group_shards(self, p: Path) -> Iterator[tuple[Path, bytes]]:
        assert self.group is not None
        spec = GroupSpec.from_dict(self.group)
        owned = [range(first, first + count) for first, count in self.group["owned"]]
        if self.shards != sum(len(r) for r in owned):
            raise ValueError(
                f"file weight update: the groups of {self.path} send {sum(len(r) for r in owned)} shard(s) but the "
                f"version has {self.shards}"
            )
        for index, data in receive_shards(spec, int(self.group["rank"]), owned):
            path = p / shard_name(index, self.shards)
            if data is None:  # its group broke: the file (streamed, or already written) has the same bytes
                data = self._wait_for(path, index).read_bytes()
            else:
                self.received += 1
            yield path, data

    def tensors(self, held: HeldWeights | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """The version's tensors, whole: a delta's decoded against `held`, the weights of the version loaded before
        (common/weights/delta.py; without it, or when it holds another version, against the base rebuilt from
        disk), each checked against its CRC-32. Once every tensor went through, `held` holds this version's
        weights when it was delta-published and nothing otherwise (a copy is kept only where deltas need one)."""
        held = held if held is not None else HeldWeights()
        prior = HeldWeights(held.version, held.tensors)
        held.version, held.tensors = None, {}  # nothing held until this version loads whole
        root = self.root()
        decoder: DeltaDecoder | None = None
        plain = False
        version = version_of_dir(Path(self.path))
        for path, data in self.shard_data():
            meta, tensors = shard_tensors(data)
            if meta is None:
                plain = True
                yield from tensors
                continue
            if decoder is None:
                decoder = DeltaDecoder(prior, lambda base: rebuild(root, base, prior))
            if version is None:
                version = int(meta["version"])
            # The held copy is the decoder's; the model gets its own (a loader may change what it is given).
            yield from ((name, t.clone()) for name, t in decoder.tensors(str(path), meta, tensors))
        if decoder is not None and version is not None:
            if plain:
                raise DeltaError(f"{self.path} mixes shards with and without delta metadata")
            done = decoder.finish(version)
            held.version, held.tensors = done.version, done.tensors

    def root(self) -> Path:
        """The weight directory the version lives in (its older versions, the bases of deltas, are there too)."""
        p = Path(self.path)
        return p.parent if p.is_dir() else p.parent.parent


class FileWeightTransferEngine(WeightTransferEngine[FileInitInfo, FileUpdateInfo]):
    """Loads HF-named safetensors into the running model through vLLM's layer-wise reload."""

    init_info_cls = FileInitInfo
    update_info_cls = FileUpdateInfo

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.held = HeldWeights()
        """The full tensors of the last delta-published version loaded: the base of the next delta."""

    def init_transfer_engine(self, init_info: FileInitInfo) -> None:
        pass  # the files need no connection

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: FileUpdateInfo) -> None:
        tensors = update_info.tensors(self.held)
        if self.device.type != "cpu":
            tensors = ((name, t.to(self.device, non_blocking=True)) for name, t in tensors)
        self.model.load_weights(tensors)  # type: ignore[operator]  # vLLM's models define it; nn.Module types it as a Tensor
        if update_info.group is not None:
            log.info(
                "weights %s: %d of %d shard(s) came through the weight groups, %d from the files",
                update_info.path,
                update_info.received,
                update_info.shards,
                update_info.shards - update_info.received,
            )

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self.receive_weights(self.parse_update_info(update_info))
        # The base class synchronizes the accelerator unconditionally, which raises on CPU.
        if torch.accelerator.current_accelerator() is not None:
            torch.accelerator.synchronize()

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass  # nothing held between updates
