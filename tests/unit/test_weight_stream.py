"""Streamed weight versions (rollout.stream_weights) without a vLLM server: the publisher's shard plan,
the `file` engine's reader (the class vLLM runs, imported from the vLLM CPU build) following a
version while it is being written, stopping on the publisher's ABORTED marker or a missing shard,
and a publish whose write fails part-way (failure injected into safetensors' `save`, the one
stand-in here): the worker streaming it fails and is evicted, nothing is published, nothing is left
on disk. The workers are small aiohttp apps that read the files with that same reader."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from common.config import RolloutConfig
from common.keys import Keys
from common.weights.base import PublishError
from common.weights.index import ABORT_MARKER, INDEX_NAME, shard_name
from common.weights.publisher import WeightPublisher
from common.weights.versions import committed_versions, unfinished_versions
from common.weights.writer import VersionWriter, plan_shards
from rollout.vllm_plugin.file_engine import FileUpdateInfo
from tests.support.rl_routes import reading_worker, register

MB = 1 << 20


def mb_tensor(n_mb: float, fill: float) -> torch.Tensor:
    return torch.full((int(n_mb * MB) // 4,), float(fill))


def test_shards_keep_the_model_order_stay_under_the_size_and_give_a_big_tensor_its_own():
    named = [
        ("a", mb_tensor(0.4, 0)),
        ("b", mb_tensor(0.4, 1)),
        ("c", mb_tensor(0.4, 2)),
        ("big", mb_tensor(3, 3)),
        ("d", mb_tensor(0.1, 4)),
    ]
    shards = plan_shards(named, 1 * MB)
    assert [[n for n, _ in s] for s in shards] == [["a", "b"], ["c"], ["big"], ["d"]]
    with pytest.raises(PublishError, match="shard size"):
        plan_shards(named, 0)


def test_the_reader_follows_a_version_while_it_is_written_and_gets_every_tensor(tmp_path: Path):
    tensors = {f"t{i}": mb_tensor(0.5, float(i)) for i in range(6)}
    writer = VersionWriter(tmp_path, 7, tensors, 1 * MB)
    assert writer.total_shards == 3
    got: dict[str, torch.Tensor] = {}

    def read() -> None:
        info = FileUpdateInfo(path=str(writer.tmp), shards=writer.total_shards, wait_s=30)
        for name, t in info.tensors():
            got[name] = t.clone()

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.2)  # the reader is waiting for shard 0 before anything is written
    assert not got
    writer.write()
    reader.join(30)
    assert list(got) == list(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
    assert writer.commit() == tmp_path / "v7"
    assert sorted(p.name for p in (tmp_path / "v7").iterdir()) == sorted(
        [shard_name(i, 3) for i in range(3)] + [INDEX_NAME]
    )


def test_the_reader_stops_on_the_abort_marker_and_on_a_shard_that_never_comes(tmp_path: Path):
    (tmp_path / ABORT_MARKER).write_text("OSError: disk full")
    with pytest.raises(RuntimeError, match="aborted.*disk full"):
        list(FileUpdateInfo(path=str(tmp_path), shards=2, wait_s=30).files())
    (tmp_path / ABORT_MARKER).unlink()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"shard 1 of 2 .* did not appear within 0 s"):
        list(FileUpdateInfo(path=str(tmp_path), shards=2, wait_s=0.2).files())
    assert time.monotonic() - t0 < 5


# A publisher SIGKILLed by the fault point once its first of three shards is in place (common/fault.py).
_KILLED_MID_PUBLISH = """
import sys, torch
from pathlib import Path
from common.weights.writer import write_version
tensors = {f"t{i}": torch.full((1 << 17,), float(i)) for i in range(6)}  # 0.5 MB each: 3 shards of 1 MB
write_version(Path(sys.argv[1]), 7, tensors, shard_bytes=1 << 20)
print("the fault point did not fire")
"""


def test_a_publisher_killed_mid_version_commits_nothing_and_its_reader_stops_when_the_directory_is_removed(
    tmp_path: Path,
):
    arm = tmp_path.parent / "arm"
    arm.touch()
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_PUBLISH, str(tmp_path)],
        env={**os.environ, "SLIPSTREAM_FAULT": f"publish:{arm}"},
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert not arm.exists()
    assert committed_versions(tmp_path) == []
    [tmp] = unfinished_versions(tmp_path)
    assert sorted(p.name for p in tmp.glob("*.safetensors")) == [shard_name(0, 3)], "killed after the first shard"
    got: list[str] = []
    failure: list[BaseException] = []

    def read() -> None:
        try:
            for name, _ in FileUpdateInfo(path=str(tmp), shards=3, wait_s=120).tensors():
                got.append(name)
        except BaseException as exc:
            failure.append(exc)

    reader = threading.Thread(target=read)
    reader.start()
    time.sleep(0.5)  # the reader has shard 0 and waits for shard 1, which no one will write
    assert got == ["t0", "t1"] and reader.is_alive()
    t0 = time.monotonic()
    shutil.rmtree(tmp)  # what the trainer that resumes does with a dead publisher's directory
    reader.join(30)
    assert time.monotonic() - t0 < 5
    assert len(failure) == 1 and "was removed before shard 2 of 3" in str(failure[0])


@pytest.mark.timeout(60)
async def test_a_streamed_publish_is_loaded_shard_by_shard_and_committed_whole(tmp_path: Path, redis_client):
    keys, updates, got = Keys("ws"), [], {}
    runner, url = await reading_worker(got, updates.append)
    tensors = {f"model.layers.{i}.w": mb_tensor(0.75, float(i)) for i in range(4)}
    try:
        await register(redis_client, keys, "w1", url)
        async with WeightPublisher(redis_client, keys, RolloutConfig(weight_shard_mb=1), tmp_path) as pub:
            result = await pub.publish(1, tensors)
    finally:
        await runner.cleanup()
    assert result.streamed and result.shards == 4 and not result.evicted
    (info,) = updates
    assert info["shards"] == 4 and info["path"] != result.location  # read from the directory being written
    assert all(torch.equal(got[k], v) for k, v in tensors.items()) and len(got) == 4
    assert result.location == str(tmp_path / "weights" / "v1") and await redis_client.get(keys.weights_current) == "1"
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["v1"]


@pytest.mark.timeout(60)
async def test_a_write_failing_mid_stream_publishes_nothing_and_leaves_no_files(
    tmp_path: Path, redis_client, monkeypatch: pytest.MonkeyPatch
):
    """A write failing mid-stream publishes nothing, evicts the loading worker and leaves no files."""
    import safetensors.torch

    real_save = safetensors.torch.save
    calls = []

    def failing_save(tensors, metadata=None):
        calls.append(sorted(tensors))
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real_save(tensors, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save", failing_save)
    keys, updates, got = Keys("wf"), [], {}
    runner, url = await reading_worker(got, updates.append)
    tensors = {f"model.layers.{i}.w": mb_tensor(0.75, float(i)) for i in range(4)}
    try:
        await register(redis_client, keys, "w1", url)
        async with WeightPublisher(redis_client, keys, RolloutConfig(weight_shard_mb=1), tmp_path) as pub:
            with pytest.raises(PublishError, match="writing the version failed.*No space left.*evicted"):
                await pub.publish(1, tensors)
    finally:
        await runner.cleanup()
    assert len(updates) == 1 and sorted(got) == ["model.layers.0.w", "model.layers.1.w"]  # it had started loading
    assert await redis_client.hkeys(keys.workers) == [] and await redis_client.get(keys.weights_current) is None
    events = [
        json.loads(f["detail"]) for _, f in await redis_client.xrange(keys.events) if f["event"] == "worker evicted"
    ]
    assert [e["worker"] for e in events] == ["w1"] and "aborted" in events[0]["reason"]
    assert list((tmp_path / "weights").iterdir()) == []
