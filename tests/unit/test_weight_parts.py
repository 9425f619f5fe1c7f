"""One weight version written by several trainer ranks (expert parallelism), without a vLLM server.

Rank 0 is the real `WeightPublisher` (or `VersionWriter`); the other ranks are real OS processes
(multiprocessing, spawn) that each build their own tensors and write their real `VersionPart` into
rank 0's temporary directory. What stands in: `ProcessPeers`, a pipe per process, for the trainer's
torch.distributed implementation of `PeerWriters` (it carries the shard count, the directory and
first shard number, and the report back, as the collectives would); `ThreadPeers`, threads in this
process, for the checks of the index that need no second process; small aiohttp apps reading the
files with the `file` engine's real reader (`FileUpdateInfo.tensors`) for vLLM workers; and, in the
failing rank, safetensors' `save` patched to fail after a number of shards for a full disk.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch

from common.config import RolloutConfig
from common.keys import Keys
from common.weights.base import PublishError
from common.weights.export import per_expert_tensors
from common.weights.index import ABORT_MARKER, INDEX_NAME, CorruptShardError, PartReport, shard_name
from common.weights.publisher import WeightPublisher
from common.weights.writer import VersionPart, VersionWriter, count_shards, write_version
from rollout.vllm_plugin.file_engine import FileUpdateInfo
from tests.support.rl_routes import reading_worker, register

MB = 1 << 20
PEER_START_S = 60.0
# A tensor spec: name -> (number of float32 elements, seed); both sides of a pipe build the same tensors.
Spec = dict[str, tuple[int, int]]


def build(spec: Spec) -> dict[str, torch.Tensor]:
    return {name: torch.randn(n, generator=torch.Generator().manual_seed(seed)) for name, (n, seed) in spec.items()}


def expert_spec(first: int, last: int, n: int = 100_000) -> Spec:
    """Per-expert gate/up/down tensors of layer 0 for experts first..last, 0.4 MB each."""
    return {
        f"model.layers.0.mlp.experts.{e}.{p}_proj.weight": (n, 100 * e + i)
        for e in range(first, last + 1)
        for i, p in enumerate(("gate", "up", "down"))
    }


def _peer_main(conn, spec: Spec, shard_bytes: int, version: int, fail_after: int | None) -> None:
    """One trainer rank > 0: announce its shard count, write its part where told, send back the report."""
    if fail_after is not None:
        import safetensors.torch

        real_save, calls = safetensors.torch.save, []

        def save(tensors, metadata=None):
            calls.append(1)
            if len(calls) > fail_after:
                raise OSError(28, "No space left on device")
            return real_save(tensors, metadata=metadata)

        safetensors.torch.save = save
    tensors = build(spec)
    conn.send(count_shards(tensors, shard_bytes))
    tmp, first, total = conn.recv()
    try:
        conn.send(VersionPart(Path(tmp), version, tensors, shard_bytes, first, total).write())
    except Exception as exc:  # the error travels back to rank 0, as a failed collective would
        conn.send(f"{type(exc).__name__}: {exc}")


class ProcessPeers:
    """`PeerWriters` over one spawned process per rank > 0 (see the module docstring).

    `before_write`, when given, is waited for before the ranks are told where to write.
    """

    def __init__(
        self,
        specs: list[Spec],
        shard_bytes: int,
        version: int,
        fail_after: Mapping[int, int] | None = None,
        before_write: threading.Event | None = None,
    ) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for rank, spec in enumerate(specs, start=1):
            here, there = ctx.Pipe()
            fail = (fail_after or {}).get(rank)
            proc = ctx.Process(target=_peer_main, args=(there, spec, shard_bytes, version, fail), daemon=True)
            proc.start()
            self.conns.append(here)
            self.procs.append(proc)
        self.before_write = before_write
        self.shard_counts = [self._recv(c, rank) for rank, c in enumerate(self.conns, start=1)]

    @staticmethod
    def _recv(conn, rank: int):
        if not conn.poll(PEER_START_S):
            raise TimeoutError(f"rank {rank} did not answer within {PEER_START_S:.0f} s")
        return conn.recv()

    def write(self, tmp: Path, first_shard: list[int], total_shards: int, base: int | None) -> list[PartReport]:
        if self.before_write is not None:
            assert self.before_write.wait(30), "the worker never started loading"
        for conn, first in zip(self.conns, first_shard, strict=True):
            conn.send((str(tmp), first, total_shards))
        answers = [self._recv(c, rank) for rank, c in enumerate(self.conns, start=1)]  # every rank ends first
        if failed := [f"rank {r}: {a}" for r, a in enumerate(answers, start=1) if not isinstance(a, PartReport)]:
            raise RuntimeError("; ".join(failed))
        return answers

    def close(self) -> None:
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.terminate()
                proc.join()


class ThreadPeers:
    """`PeerWriters` over threads of this process, each writing the `VersionPart` of one rank's tensors."""

    def __init__(self, parts: list[dict[str, torch.Tensor]], shard_bytes: int, counts: list[int] | None = None):
        self.parts, self.shard_bytes = parts, shard_bytes
        self.shard_counts = counts if counts is not None else [count_shards(p, shard_bytes) for p in parts]

    def write(self, tmp: Path, first_shard: list[int], total_shards: int, base: int | None) -> list[PartReport]:
        parts = [
            VersionPart(tmp, 1, t, self.shard_bytes, f, total_shards)
            for t, f in zip(self.parts, first_shard, strict=True)
        ]
        reports: list[PartReport | None] = [None] * len(parts)

        def run(i: int) -> None:
            reports[i] = parts[i].write()

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(parts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert all(r is not None for r in reports), "a peer thread failed"
        return reports  # type: ignore[return-value]


def _streaming_worker(got: dict[str, torch.Tensor], seen: list[list[str]], loading: threading.Event):
    """A reading worker that, on /update_weights, first notes which files exist and signals `loading`."""

    def noted(info: dict) -> None:
        seen.append(sorted(os.listdir(info["path"])))
        loading.set()

    return reading_worker(got, noted)


def assert_same(got: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], v) for k, v in expected.items())


def test_a_part_writes_only_its_own_shards(
    tmp_path: Path,
):
    """A part writes only its own shard numbers into the existing directory and reports their checksums."""
    tensors = build(expert_spec(4, 4))  # three 0.4 MB tensors: two shards of <= 1 MB
    assert count_shards(tensors, MB) == 2
    report = VersionPart(tmp_path, 3, tensors, MB, first_shard=2, total_shards=5).write()
    names = [shard_name(2, 5), shard_name(3, 5)]
    assert sorted(p.name for p in tmp_path.iterdir()) == names and list(report.shards) == names
    for name, record in report.shards.items():
        data = (tmp_path / name).read_bytes()
        assert record.bytes == len(data) and record.crc32 == zlib.crc32(data)
    assert [t for r in report.shards.values() for t in r.tensors] == list(tensors)
    assert report.tensor_bytes == sum(t.numel() * 4 for t in tensors.values())
    with pytest.raises(PublishError, match="2 shard.*from index 4 do not fit in 5"):
        VersionPart(tmp_path, 3, tensors, MB, first_shard=4, total_shards=5)
    missing = tmp_path / "gone"
    with pytest.raises(FileNotFoundError):
        VersionPart(missing, 3, tensors, MB, first_shard=0, total_shards=2).write()
    assert not missing.exists()  # a part never creates the directory


@pytest.mark.timeout(120)
async def test_three_ranks_publish_one_version_that_streaming_and_complete_readers_both_get_whole(
    tmp_path: Path, redis_client
):
    # Rank 0: the dense tensors and experts 0-1 (fused, as transformers holds them); rank 1: nothing; rank 2:
    # experts 2-5 (several shards). The worker starts loading before ranks 1 and 2 are told where to write.
    own = {
        "model.embed_tokens.weight": torch.randn(100_000),
        "model.layers.0.mlp.experts.gate_up_proj": torch.randn(2, 200, 250),
        "model.layers.0.mlp.experts.down_proj": torch.randn(2, 250, 100),
    }
    specs = [{}, expert_spec(2, 5)]
    expected = dict(per_expert_tensors(own)) | build(specs[1])
    keys, got, seen, loading = Keys("wp"), {}, [], threading.Event()
    peers = await asyncio.to_thread(ProcessPeers, specs, MB, 1, None, loading)
    runner, url = await _streaming_worker(got, seen, loading)
    try:
        assert peers.shard_counts == [0, 6]  # twelve 0.4 MB tensors, two per 1 MB shard
        await register(redis_client, keys, "w1", url)
        async with WeightPublisher(redis_client, keys, RolloutConfig(weight_shard_mb=1), tmp_path) as pub:
            result = await pub.publish(1, own, peers=peers)
    finally:
        await runner.cleanup()
        peers.close()
    k = count_shards(own, MB) + 6
    assert result.streamed and result.shards == k and not result.evicted
    assert result.bytes == sum(t.numel() * 4 for t in expected.values())
    assert_same(got, expected)
    assert not set(seen[0]) & {shard_name(i, k) for i in range(k - 6, k)}  # rank 2's shards came after
    version = Path(result.location)
    files = sorted(p.name for p in version.iterdir())
    assert files == sorted([shard_name(i, k) for i in range(k)] + [INDEX_NAME])
    index = json.loads((version / INDEX_NAME).read_text())
    assert sorted(index["weight_map"]) == sorted(expected) and index["metadata"]["total_size"] == result.bytes
    for name, record in index["shards"].items():
        data = (version / name).read_bytes()
        assert record == {"bytes": len(data), "crc32": zlib.crc32(data)}, name
    complete: dict[str, torch.Tensor] = dict(FileUpdateInfo(path=str(version)).tensors())
    assert_same(complete, expected)
    assert await redis_client.get(keys.weights_current) == "1"


@pytest.mark.timeout(120)
async def test_a_rank_failing_mid_write_publishes_nothing_and_leaves_no_files(tmp_path: Path, redis_client):
    """A rank failing mid-write publishes nothing, evicts the streaming worker and leaves no files."""
    keys, got, seen, loading = Keys("wx"), {}, [], threading.Event()
    # Rank 2 writes one of its six shards, then its disk is full.
    peers = await asyncio.to_thread(ProcessPeers, [expert_spec(2, 3), expert_spec(4, 7)], MB, 1, {2: 1})
    runner, url = await _streaming_worker(got, seen, loading)
    await redis_client.set(keys.weights_current, 0)
    try:
        await register(redis_client, keys, "w1", url)
        async with WeightPublisher(redis_client, keys, RolloutConfig(weight_shard_mb=1), tmp_path) as pub:
            with pytest.raises(
                PublishError, match=r"writing the version failed.*rank 2: OSError.*No space left.*evicted"
            ):
                await pub.publish(1, {"model.embed_tokens.weight": torch.randn(100_000)}, peers=peers)
    finally:
        await runner.cleanup()
        peers.close()
    assert await redis_client.get(keys.weights_current) == "0"
    assert list((tmp_path / "weights").iterdir()) == []  # no v1, no temporary directory
    assert await redis_client.hkeys(keys.workers) == []
    events = [
        json.loads(f["detail"]) for _, f in await redis_client.xrange(keys.events) if f["event"] == "worker evicted"
    ]
    assert [e["worker"] for e in events] == ["w1"] and "No space left" in events[0]["reason"]


def test_ranks_whose_shards_leave_a_gap_or_repeat_a_tensor_fail_the_write_and_abort_it(tmp_path: Path):
    own = build(expert_spec(0, 0))
    # A rank announcing one shard more than it writes: streaming readers would wait for the gap.
    writer = VersionWriter(tmp_path, 1, own, MB, [3])
    with pytest.raises(PublishError, match=r"missing \['model-00004-of-00005.safetensors'\]"):
        writer.write(ThreadPeers([build(expert_spec(1, 1))], MB, counts=[3]))
    assert (writer.tmp / ABORT_MARKER).exists()
    writer.discard()
    # Two ranks exporting the same expert name (a rank numbering its experts from 0).
    writer = VersionWriter(tmp_path, 1, own, MB, [2])
    with pytest.raises(PublishError, match="experts.0.gate_proj.weight' is in both"):
        writer.write(ThreadPeers([build(expert_spec(0, 0))], MB))
    assert (writer.tmp / ABORT_MARKER).exists()


def test_a_corrupted_or_truncated_shard_of_a_complete_version_is_refused_naming_the_file(tmp_path: Path):
    tensors = build(expert_spec(0, 1))  # six 0.4 MB tensors: three shards
    path, *_ = write_version(tmp_path, 1, tensors, MB)
    assert_same(dict(FileUpdateInfo(path=str(path)).tensors()), tensors)
    shard = path / shard_name(1, 3)
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0x01  # in the tensor data: safetensors itself would load it without complaint
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match=rf"{shard_name(1, 3)}: CRC-32 0x[0-9a-f]+, the version's index says"):
        dict(FileUpdateInfo(path=str(path)).tensors())
    shard.write_bytes(bytes(data[:-4]))
    with pytest.raises(CorruptShardError, match=rf"{shard_name(1, 3)}: {len(data) - 4} bytes, .* says {len(data)}"):
        dict(FileUpdateInfo(path=str(path)).tensors())
    shard.unlink()
    with pytest.raises(CorruptShardError, match=rf"lacks the shard\(s\) \['{shard_name(1, 3)}'\]"):
        dict(FileUpdateInfo(path=str(path)).tensors())
