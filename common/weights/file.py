"""The `file` transport: each version is written as safetensors shards under `<weight root>/v<N>/` (any
machine that sees the weight dir) and every worker loads it through the `file` engine our vLLM plugin
registers, driven over HTTP (workers.py). With `rollout.stream_weights` (the default) the workers are paused
and loading while the version is written: each loads shard i as soon as it is whole, so a publish costs about
max(write, load) instead of write + load, at the price of a pause window that includes the write. Otherwise
the whole version is written and committed first and the workers are paused only for the load. If writing
fails the version is not published and its temporary directory is removed; workers that were streaming it
stop at the ABORTED marker, fail their update and are evicted (their weights are half-loaded). A republish
hard-links the committed files of an older version under the new number, checksums verified. With
`rollout.weight_delta` a version is written as the difference from the last one published (common/weights/
delta.py), one in `weight_snapshot_every` whole, and the first after a start or a republish whole too. After a
publish, version directories older than the newest `keep_versions` (and not pinned) are removed, except the
snapshot and deltas a kept version is built from.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.weights.base import PublishError, PublishResult, WeightTransport
from common.weights.index import CorruptShardError, ShardRecord, read_index, verify_shard
from common.weights.versions import prune_versions, temp_dir, version_dir
from common.weights.workers import WorkerDriver, WorkerOutcome
from common.weights.writer import PeerWriters, VersionWriter

if TYPE_CHECKING:
    import torch

    from common.weights.delta import DeltaEncoder

log = logging.getLogger(__name__)

# How long a worker streaming a version waits for the publisher's next shard.
SHARD_WAIT_S = 300.0


@dataclass(frozen=True)
class _Copy:
    """A version republished from the committed files of `source`, already linked in place under its number."""

    source: int
    location: Path
    bytes: int
    shards: int
    link_s: float


def _link_version(src: Path, dst: Path, records: Mapping[str, ShardRecord]) -> None:
    """Hard-link a committed version's files into `dst`, checking every shard against its index first."""
    for name, record in records.items():
        verify_shard(src / name, (src / name).read_bytes(), record)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        os.link(f, dst / f.name)


class FileTransport(WeightTransport):
    """Versions as files under `root`, loaded by each worker through `driver` (see the module docstring)."""

    backend = "file"

    def __init__(
        self,
        root: Path,
        driver: WorkerDriver,
        shard_bytes: int,
        stream: bool,
        keep_versions: int,
        model_files: Path | None = None,
        delta: bool = False,
        snapshot_every: int = 1,
    ) -> None:
        """`model_files`: the HF directory of the run's model, whose config, tokenizer and chat template every
        version carries (VersionWriter). `delta`: write versions as deltas of the last one published, one in
        `snapshot_every` whole (rollout.weight_delta)."""
        self.root, self.driver, self.model_files = root, driver, model_files
        self.shard_bytes, self.stream, self.keep_versions = shard_bytes, stream, keep_versions
        self.snapshot_every = snapshot_every
        self._encoder: DeltaEncoder | None = None
        if delta:
            from common.weights.delta import DeltaEncoder

            self._encoder = DeltaEncoder()
        # The last version this transport committed (None: none yet, or a republish: the next is whole) and how
        # many deltas were published since the last whole version.
        self._last: int | None = None
        self._deltas = 0
        # What the publish under way prepared: a version to write (with the other ranks writing parts of it),
        # its write once started, or the files of an older version linked in place.
        self._writer: VersionWriter | None = None
        self._peers: PeerWriters | None = None
        self._write: asyncio.Future[None] | None = None
        self._copy: _Copy | None = None

    async def prepare(
        self, version: int, tensors: Mapping[str, torch.Tensor], peers: PeerWriters | None = None
    ) -> None:
        peer_shards = list(peers.shard_counts) if peers is not None else []
        self._writer = await asyncio.to_thread(
            VersionWriter,
            self.root,
            version,
            tensors,
            self.shard_bytes,
            peer_shards,
            self.model_files,
            self._encoder,
            self.delta_base(),
        )
        self._peers = peers

    def delta_base(self) -> int | None:
        """The version the next one is written as a delta of: the last one published, unless deltas are off or a
        whole version is due."""
        if self._encoder is None or self._last is None or self._deltas + 1 >= self.snapshot_every:
            return None
        return self._last

    async def prepare_copy(self, version: int, source: int) -> None:
        t0 = time.perf_counter()
        src = version_dir(self.root, source)
        records = await asyncio.to_thread(read_index, src)
        if records is None:
            raise PublishError(f"republish({version}): {src} has no index with checksums; it cannot be republished")
        final = version_dir(self.root, version)
        if final.exists():
            raise PublishError(f"republish({version}): {final} already exists; versions are immutable")
        tmp = temp_dir(self.root, version)
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            await asyncio.to_thread(_link_version, src, tmp, records)
            os.rename(tmp, final)
        except (OSError, CorruptShardError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublishError(f"republish({version}) of version {source}: {exc}") from exc
        size = sum(r.bytes for r in records.values())
        self._copy = _Copy(source, final, size, len(records), time.perf_counter() - t0)

    async def send(self, version: int, workers: Mapping[str, str], pause_mode: str) -> PublishResult:
        t1 = time.perf_counter()
        if (copy := self._copy) is not None:
            outcomes = await self._update(workers, version, {"path": str(copy.location)}, pause_mode)
            return PublishResult(
                version,
                str(copy.location),
                copy.bytes,
                0.0,
                copy.link_s,
                time.perf_counter() - t1,
                0.0,
                copy.shards,
                False,
                outcomes,
                source=copy.source,
            )
        writer = self._writer
        if writer is None or writer.version != version:
            raise RuntimeError(f"FileTransport.send({version}) without prepare({version}) first")
        streamed = self.stream and bool(workers)
        self._write = write = asyncio.ensure_future(asyncio.to_thread(writer.write, self._peers))
        if streamed:
            # Workers pause and load shard i while shard i+1 is written (by whichever rank owns it).
            info = {"path": str(writer.tmp), "shards": writer.total_shards, "wait_s": SHARD_WAIT_S}
            outcomes = await self._update(workers, version, info, pause_mode)
        await asyncio.wait({write})
        if (failure := write.exception()) is not None:
            evicted = "; the workers that were loading it were evicted" if streamed else ""
            raise PublishError(f"publish({version}): writing the version failed: {failure}{evicted}") from failure
        location = writer.commit()
        if not streamed:
            outcomes = await self._update(workers, version, {"path": str(location)}, pause_mode)
        return PublishResult(
            version,
            str(location),
            writer.bytes,
            writer.export_s,
            writer.write_s,
            time.perf_counter() - t1,
            0.0,
            writer.total_shards,
            streamed,
            outcomes,
            delta_base=writer.delta_base,
        )

    async def _update(
        self, workers: Mapping[str, str], version: int, info: dict[str, Any], pause_mode: str
    ) -> list[WorkerOutcome]:
        return list(
            await asyncio.gather(*(self.driver.update(w, url, version, info, pause_mode) for w, url in workers.items()))
        )

    async def finish(self, published: bool) -> None:
        writer, write, copy = self._writer, self._write, self._copy
        self._writer, self._peers, self._write, self._copy = None, None, None, None
        if published:
            if writer is not None:
                self._last = writer.version
                self._deltas = 0 if writer.delta_base is None else self._deltas + 1
            elif copy is not None:
                self._last = None  # the trainer holds none of the copied version's tensors: the next is whole
            for p in prune_versions(self.root, self.keep_versions):
                log.debug("removed old weight version %s", p)
            return
        if write is not None:
            await asyncio.wait({write})  # every writer runs to its end; then nothing is left behind
        if writer is not None:
            writer.discard()
