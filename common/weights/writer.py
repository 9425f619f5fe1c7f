"""The streamed writer of the file transport: one version as safetensors shards (layout:
common/weights/index.py), each renamed into place once whole so workers can load shard i while shard i+1 is
written, by one trainer rank or several. Rank 0's `VersionWriter` owns the temporary directory, writes its own
`VersionPart` (shards 0..) while `PeerWriters`, the other ranks, write theirs (the shards after it), then the
index from every rank's `PartReport`, and renames the directory into place. A writer that fails leaves the
ABORTED marker, so workers streaming the version stop instead of waiting. With delta publishing each rank
encodes its part against its own copy of the part it wrote last (common/weights/delta.py). Left out: a failing rank does not
stop the others (`PeerWriters.write` has no cancel); every writer runs to its end before the directory is
removed, and the ABORTED marker releases the workers early.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from common.fault import fault_point
from common.weights.base import PublishError
from common.weights.export import per_expert_views
from common.weights.index import ABORT_MARKER, DELTA_META_KEY, PartReport, ShardRecord, shard_name, write_index
from common.weights.model_files import copy_model_files
from common.weights.versions import temp_dir, version_dir

if TYPE_CHECKING:
    import torch

    from common.weights.delta import DeltaEncoder
    from common.weights.group import GroupSpec


def plan_shards(named: list[tuple[str, torch.Tensor]], shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Cut the tensors, in their order, into consecutive shards of at most `shard_bytes` each.

    A tensor larger than `shard_bytes` gets a shard of its own. Keeping the model's order keeps a
    layer's tensors together, so a worker can finish (and post-process) layers as shards arrive.
    """
    if shard_bytes < 1:
        raise PublishError(f"shard size must be >= 1 byte, got {shard_bytes}")
    shards: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if not shards or (shards[-1] and size + nbytes > shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def count_shards(tensors: Mapping[str, torch.Tensor], shard_bytes: int) -> int:
    """How many shards `VersionPart` cuts these tensors into (0 for none): what a rank announces before writing."""
    return len(plan_shards(list(per_expert_views(tensors)), shard_bytes))


def _host(t: torch.Tensor, own: bool) -> torch.Tensor:
    """A contiguous host tensor of `t`'s values; with `own`, never memory that `t` shares (a CPU trainer's exported
    masters are the parameters themselves, which the next step changes)."""
    host = t.detach().contiguous().cpu()
    return host.clone() if own and host.data_ptr() == t.data_ptr() else host


def _mark_aborted(tmp: Path, exc: BaseException) -> None:
    """Leave the ABORTED marker for streaming readers; the first writer to fail gives the reason. The marker is
    linked into place once written: a reader polling for it never finds it empty."""
    partial = tmp / f"{ABORT_MARKER}.{os.getpid()}.{threading.get_ident()}.partial"
    with contextlib.suppress(OSError):
        partial.write_text(f"{type(exc).__name__}: {exc}")
        os.link(partial, tmp / ABORT_MARKER)  # fails when another writer's marker is there: the first one stays
    with contextlib.suppress(OSError):
        partial.unlink()


class VersionPart:
    """One trainer rank's shards of a version, written into the version's existing temporary directory.

    The tensors are cut by `plan_shards` and written as shards `first_shard`, `first_shard + 1`, ... of
    `total_shards`, each renamed into its final name once whole. The part never creates, renames or
    removes the directory: rank 0's `VersionWriter` does. A failed write leaves the ABORTED marker.
    """

    def __init__(
        self,
        tmp: Path,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        shard_bytes: int,
        first_shard: int,
        total_shards: int,
        delta: DeltaEncoder | None = None,
        base: int | None = None,
        sink: Callable[[int, bytes], None] | None = None,
    ) -> None:
        """With `delta` (this rank's encoder: rollout.weight_delta) every shard carries delta metadata, and the
        tensors are written as deltas of version `base` where the encoder holds it (common/weights/delta.py).
        `sink(index, bytes)` gets each shard before its file is written (the collective transport's sending
        side, common/weights/group.py)."""
        named = list(per_expert_views(tensors))
        self.shards = plan_shards(named, shard_bytes)
        if first_shard < 0 or first_shard + len(self.shards) > total_shards:
            raise PublishError(
                f"publish({version}): this part's {len(self.shards)} shard(s) from index {first_shard} do not fit in "
                f"{total_shards}; did the rank announce count_shards() of these same tensors and shard size?"
            )
        self.tmp, self.version = tmp, version
        self.delta = delta
        self.base = delta.base_for(base) if delta is not None else None
        self.sink = sink
        self.first_shard, self.total_shards = first_shard, total_shards
        self.bytes = sum(t.numel() * t.element_size() for _, t in named)
        self.export_s = 0.0
        self.write_s = 0.0

    def write(self) -> PartReport:
        """Write every shard (blocking); what was written. On failure leave the ABORTED marker and raise."""
        from safetensors.torch import save

        report = PartReport({}, 0, self.base)
        kept: list[tuple[str, torch.Tensor]] = []  # the next delta's base
        t0 = time.perf_counter()
        try:
            for i, shard in enumerate(self.shards, start=self.first_shard):
                t1 = time.perf_counter()
                tensors = {name: _host(t, own=self.delta is not None) for name, t in shard}
                self.export_s += time.perf_counter() - t1
                metadata = {"slipstream_version": str(self.version)}
                if self.delta is not None:
                    kept += tensors.items()
                    tensors, metadata[DELTA_META_KEY] = self.delta.encode_shard(self.version, self.base, tensors)
                report.tensor_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
                # Serialised in memory so the checksum costs no second read of the file.
                data = save(tensors, metadata=metadata)
                if self.sink is not None:
                    self.sink(i, data)
                path = self.tmp / shard_name(i, self.total_shards)
                partial = path.with_name(path.name + ".partial")
                partial.write_bytes(data)
                os.rename(partial, path)  # a streaming reader sees the whole shard or nothing
                if i == self.first_shard:
                    fault_point("publish")  # the chaos benchmark's kill mid-publish (common/fault.py)
                report.shards[path.name] = ShardRecord(len(data), zlib.crc32(data), tuple(tensors))
            if self.delta is not None:
                self.delta.remember(self.version, kept)
        except BaseException as exc:
            _mark_aborted(self.tmp, exc)
            raise
        finally:
            self.write_s = time.perf_counter() - t0 - self.export_s
        return report


class PeerWriters(Protocol):
    """The other trainer ranks, each writing its own `VersionPart` of a version (rank 0 writes the first).

    The trainer implements this with torch.distributed; the publisher knows only this interface.
    """

    shard_counts: list[int]
    """How many shards each other rank will write (`count_shards` of its tensors), in rank order 1, 2, ..."""

    def write(
        self, tmp: Path, first_shard: list[int], total_shards: int, base: int | None, group: GroupSpec | None = None
    ) -> list[PartReport]:
        """Have rank r+1 write its part into `tmp` from shard `first_shard[r]` of `total_shards` (as deltas of version
        `base` where it holds it, when publishing deltas), each shard broadcast first into its group of `group`
        when given (common/weights/group.py); block until every rank is done; their reports in rank order. Raises
        if any rank failed (that rank left the ABORTED marker)."""
        ...


class VersionWriter:
    """Writes one version as safetensors shards (layout: common/weights/index.py), then moves it into place.

    The shards go to a temporary directory `root/.v<N>.<pid>.tmp/`, each renamed into its final name
    once whole, so workers can load shard i while shard i+1 is written. `write` writes rank 0's part
    (`VersionPart`, shards 0..) while `peers`, the other trainer ranks, write theirs (the shards after
    it), then the index. `commit` renames the directory to `root/v<N>/`: readers of a committed version
    see all of it or none of it. A failed write leaves the ABORTED marker for streaming readers;
    `discard` removes the directory. With `model_files` (the HF directory of the run's model) the version also
    carries its config.json, generation config, tokenizer and chat template (common/weights/model_files.py),
    copied before any shard.
    """

    def __init__(
        self,
        root: Path,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        shard_bytes: int,
        peer_shards: Sequence[int] = (),
        model_files: Path | None = None,
        delta: DeltaEncoder | None = None,
        base: int | None = None,
    ) -> None:
        own = count_shards(tensors, shard_bytes)
        if own == 0:
            raise PublishError(f"publish({version}): no tensors given")
        if any(n < 0 for n in peer_shards):
            raise PublishError(
                f"publish({version}): the other ranks announced negative shard counts {list(peer_shards)}"
            )
        self.version = version
        self.final = version_dir(root, version)
        if self.final.exists():
            raise PublishError(
                f"publish({version}): {self.final} already exists; versions are immutable, publish {version + 1}"
            )
        self.tmp = temp_dir(root, version)
        self.total_shards = own + sum(peer_shards)
        self.peer_first_shards = [own + sum(peer_shards[:r]) for r in range(len(peer_shards))]
        self.base = base
        self.delta_base: int | None = None
        """The version this one is a delta of, once written (None: written whole)."""
        self.part = VersionPart(self.tmp, version, tensors, shard_bytes, 0, self.total_shards, delta, base)
        self.bytes = self.part.bytes  # rank 0's tensor bytes until `write` has every rank's report
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)
        if model_files is not None:
            copy_model_files(model_files, self.tmp)

    @property
    def export_s(self) -> float:
        return self.part.export_s

    @property
    def write_s(self) -> float:
        return self.part.write_s

    def write(self, peers: PeerWriters | None = None, group: GroupSpec | None = None) -> None:
        """Write rank 0's part while `peers` write theirs, then the index (blocking); returns when every writer
        has ended. With `group`, every rank broadcasts each shard into its group first (the part's `sink` is rank
        0's). On any failure leave the ABORTED marker and raise PublishError naming who failed."""
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"write-v{self.version}") as pool:
            mine = pool.submit(self.part.write)
            if peers and group is not None:
                theirs = pool.submit(peers.write, self.tmp, self.peer_first_shards, self.total_shards, self.base, group)
            elif peers:
                theirs = pool.submit(peers.write, self.tmp, self.peer_first_shards, self.total_shards, self.base)
            else:
                theirs = None
        # Both have ended (the pool's exit waits), so nothing writes into the directory after this.
        failures = [
            (who, exc)
            for who, f in (("rank 0", mine), ("the other ranks", theirs))
            if f is not None and (exc := f.exception()) is not None
        ]
        if failures:
            _mark_aborted(self.tmp, failures[0][1])
            raise PublishError("; ".join(f"{who}: {type(e).__name__}: {e}" for who, e in failures)) from failures[0][1]
        reports = [mine.result(), *(theirs.result() if theirs else [])]
        self.delta_base = next((r.delta_base for r in reports if r.delta_base is not None), None)
        try:
            self.bytes = write_index(self.tmp, reports, self.total_shards)
        except (ValueError, OSError) as exc:
            _mark_aborted(self.tmp, exc)
            raise PublishError(f"the index of version {self.version}: {exc}") from exc

    def commit(self) -> Path:
        os.rename(self.tmp, self.final)
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_version(
    root: Path,
    version: int,
    tensors: Mapping[str, torch.Tensor],
    shard_bytes: int = 32 << 20,
    model_files: Path | None = None,
) -> tuple[Path, int, float, float]:
    """Write one whole version to root/v<N>/ (atomically), with the model's files of `model_files` (see
    VersionWriter); (dir, bytes, export_s, write_s)."""
    writer = VersionWriter(root, version, tensors, shard_bytes, model_files=model_files)
    try:
        writer.write()
    except BaseException:
        writer.discard()
        raise
    return writer.commit(), writer.bytes, writer.export_s, writer.write_s
