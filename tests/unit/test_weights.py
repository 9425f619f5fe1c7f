"""The trainer side of weight sync without vLLM: HF export with one name per expert, atomic and
immutable version directories, pruning to the newest K, a publisher that evicts a worker whose
update fails (and still advances `weights:current` over the workers that acknowledged), a publisher
and a worker catching up by itself taking turns on the worker's weight lock, and the nccl
transport's refusal to run without CUDA. Workers are small aiohttp apps (tests/support/rl_routes.py)."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import aiohttp
import pytest
import redis.exceptions
import torch
from aiohttp import web
from safetensors.torch import load_file

from common.config import RolloutConfig
from common.keys import Keys
from common.weights.base import PublishError
from common.weights.export import per_expert_tensors
from common.weights.nccl import NcclTransport
from common.weights.publisher import WeightPublisher
from common.weights.versions import newest_version, pin_versions, prune_versions
from common.weights.workers import weight_lock
from common.weights.writer import write_version
from tests.support.rl_routes import register, start_app


def test_fused_expert_tensors_are_split_into_one_name_per_expert():
    gate_up = torch.arange(2 * 6 * 3, dtype=torch.float32).reshape(2, 6, 3)  # [E, 2I, H] with I = 3
    down = torch.arange(2 * 3 * 3, dtype=torch.float32).reshape(2, 3, 3)  # [E, H, I]
    other = torch.ones(4)
    out = dict(
        per_expert_tensors(
            {
                "model.layers.1.mlp.experts.gate_up_proj": gate_up,
                "model.layers.1.mlp.experts.down_proj": down,
                "model.norm.weight": other,
            }
        )
    )
    assert sorted(out) == sorted(
        [f"model.layers.1.mlp.experts.{e}.{p}_proj.weight" for e in range(2) for p in ("gate", "up", "down")]
        + ["model.norm.weight"]
    )
    assert torch.equal(out["model.layers.1.mlp.experts.1.gate_proj.weight"], gate_up[1, :3])
    assert torch.equal(out["model.layers.1.mlp.experts.1.up_proj.weight"], gate_up[1, 3:])
    assert torch.equal(out["model.layers.1.mlp.experts.0.down_proj.weight"], down[0])
    assert all(t.is_contiguous() for t in out.values())


def test_version_directories_are_written_whole_immutable_and_pruned_to_the_newest_k(tmp_path: Path):
    t = {"w": torch.randn(4, 4)}
    path, size, _, _ = write_version(tmp_path, 1, t)
    assert path == tmp_path / "v1" and size == 64
    assert torch.equal(load_file(str(path / "model-00000-of-00001.safetensors"))["w"], t["w"])
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]  # no temporary directory left behind
    with pytest.raises(PublishError, match="already exists"):
        write_version(tmp_path, 1, t)
    for v in (2, 3, 10):
        write_version(tmp_path, v, t)
    removed = prune_versions(tmp_path, keep=2)
    assert sorted(p.name for p in removed) == ["v1", "v2"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v10", "v3"]


def test_pinned_versions_outlive_pruning(tmp_path: Path):
    """The trainer pins the versions its kept checkpoints need; keep_versions never removes them."""
    for v in range(5):
        write_version(tmp_path, v, {"w": torch.zeros(2)})
    pin_versions(tmp_path, [1])
    assert sorted(p.name for p in prune_versions(tmp_path, keep=2)) == ["v0", "v2"]
    assert sorted(p.name for p in tmp_path.glob("v*")) == ["v1", "v3", "v4"]
    pin_versions(tmp_path, [])
    assert [p.name for p in prune_versions(tmp_path, keep=2)] == ["v1"]


def test_nccl_transport_without_cuda_says_to_use_the_file_backend():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="weight_backend = 'file'"):
        NcclTransport(["http://127.0.0.1:1"], "127.0.0.1", 29500)
    with pytest.raises(ValueError, match="at least one worker"):
        NcclTransport([], "127.0.0.1", 29500)


async def _fake_worker(fail_on: str | None, calls: list[str]) -> tuple[web.AppRunner, str]:
    async def handle(request: web.Request) -> web.Response:
        calls.append(request.path + (f"?{request.query_string}" if request.query_string else ""))
        if request.path == fail_on:
            return web.json_response({"error": "boom"}, status=500)
        return web.json_response({"ok": True})

    return await start_app(handle)


@pytest.mark.timeout(60)
async def test_a_failing_worker_is_evicted_and_the_version_advances_over_the_ones_that_acknowledged(
    tmp_path: Path, redis_client
):
    r = redis_client
    keys = Keys("wt")
    good_calls: list[str] = []
    bad_calls: list[str] = []
    good, good_url = await _fake_worker(None, good_calls)
    bad, bad_url = await _fake_worker("/update_weights", bad_calls)
    try:
        await register(r, keys, "good", good_url)
        await register(r, keys, "bad", bad_url)
        # A registered worker without a liveness key is dead and must not be driven.
        await register(r, keys, "dead", "http://127.0.0.1:9", alive=False)
        async with WeightPublisher(r, keys, RolloutConfig(pause_mode="abort"), tmp_path) as pub:
            result = await pub.publish(1, {"w": torch.zeros(2, 2)})
            with pytest.raises(PublishError, match="already 1"):
                await pub.publish(1, {"w": torch.zeros(2, 2)})
        assert good_calls == [
            "/pause?mode=abort",
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]
        assert bad_calls == ["/pause?mode=abort", "/start_weight_update", "/update_weights", "/resume"]
        assert [w.worker_id for w in result.evicted] == ["bad"] and "HTTP 500" in result.evicted[0].error
        assert sorted(await r.hkeys(keys.workers)) == ["dead", "good"]
        assert await r.get(keys.worker_alive("bad")) is None
        assert json.loads(await r.hget(keys.workers, "good"))["weight_version"] == 1
        assert await r.get(keys.weights_current) == "1"
        ((_, entry),) = await r.xrange(keys.weights_log)
        assert (
            entry["version"] == "1" and entry["backend"] == "file" and entry["location"] == str(tmp_path / "weights/v1")
        )
        events = [json.loads(f["detail"]) for _, f in await r.xrange(keys.events) if f["event"] == "worker evicted"]
        assert [e["worker"] for e in events] == ["bad"]
    finally:
        await good.cleanup()
        await bad.cleanup()


@pytest.mark.timeout(60)
async def test_a_publish_waits_for_a_worker_catching_up_by_itself_and_their_calls_never_interleave(
    tmp_path: Path, redis_client
):
    """The worker side is the real `follow_current`; the vLLM server is a small app that records calls and
    takes 0.3 s per update, so unlocked drivers would interleave."""
    from types import SimpleNamespace

    from common.config import Config
    from rollout.worker import follow_current

    r, calls = redis_client, []

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/update_weights":
            calls.append(f"update {Path((await request.json())['update_info']['path']).name}")
            await asyncio.sleep(0.3)
        else:
            calls.append(request.path)
        return web.json_response({"ok": True})

    runner, url = await start_app(handle)
    keys = Keys("wl")
    try:
        await register(r, keys, "w", url)
        # Version 1 was published before the worker registered: it is behind and catches up by itself.
        path, *_ = write_version(tmp_path / "weights", 1, {"w": torch.zeros(2)})
        await r.set(keys.weights_current, 1)
        await r.xadd(keys.weights_log, {"version": 1, "backend": "file", "location": str(path), "ts": "0"})
        ctx = SimpleNamespace(keys=keys, cfg=Config())
        async with aiohttp.ClientSession() as session, WeightPublisher(r, keys, RolloutConfig(), tmp_path) as pub:
            follow = asyncio.create_task(follow_current(ctx, r, session, "w", url))
            await asyncio.sleep(0.1)  # the worker holds its weight lock and is updating
            result = await pub.publish(2, {"w": torch.ones(2)})
            assert await follow == 1
        record = json.loads(await r.hget(keys.workers, "w"))
    finally:
        await runner.cleanup()
    one = ["/pause", "/start_weight_update", "update", "/finish_weight_update", "/reset_prefix_cache", "/resume"]
    # The catch-up to v1 runs whole, then the publisher's v2 (streamed from its temporary directory).
    assert [c.split(" ")[0] for c in calls] == one + one, calls
    assert calls[2] == "update v1" and calls[8].startswith("update .v2."), calls
    assert not result.evicted and record["weight_version"] == 2


@pytest.mark.timeout(60)
async def test_a_worker_that_dies_during_a_publish_is_given_up_on_when_its_heartbeat_stops(
    tmp_path: Path, redis_client
):
    """A killed worker role can leave a vLLM server that takes /pause and never answers (its engine is
    gone); the app below does exactly that. The publish must not wait out its 600 s HTTP timeout."""
    r, keys, calls, never = redis_client, Keys("wd"), [], asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        calls.append(request.path)
        await never.wait()
        return web.json_response({"ok": True})

    runner, url = await start_app(hang)
    try:
        await register(r, keys, "w", url)
        async with WeightPublisher(r, keys, RolloutConfig(), tmp_path) as pub:
            publish = asyncio.create_task(pub.publish(1, {"w": torch.zeros(2)}))
            await asyncio.sleep(0.5)
            assert calls == ["/pause"] and not publish.done()
            await r.delete(keys.worker_alive("w"))  # its heartbeat expires
            t0 = time.monotonic()
            result = await publish
            assert time.monotonic() - t0 < 3
    finally:
        never.set()  # let the server shut down
        await runner.cleanup()
    assert [w.worker_id for w in result.evicted] == ["w"] and "stopped heartbeating" in result.evicted[0].error
    assert await r.get(keys.weights_current) == "1" and await r.hkeys(keys.workers) == []


@pytest.mark.timeout(60)
async def test_newest_version_counts_every_number_the_experiment_used(tmp_path: Path, redis_client):
    """Published, logged, reported by a worker, committed on disk, or half-written by a publisher that died:
    each is a number a later publish must not take again."""
    r, keys = redis_client, Keys("nv")
    assert await newest_version(r, keys, tmp_path) is None
    write_version(tmp_path, 3, {"w": torch.zeros(2)})
    assert await newest_version(r, keys, tmp_path) == 3
    (tmp_path / ".v7.12345.tmp").mkdir()  # died mid-write: workers streaming it may hold part of v7
    assert await newest_version(r, keys, tmp_path) == 7
    await register(r, keys, "w0", "http://127.0.0.1:9")
    entry = json.loads(await r.hget(keys.workers, "w0"))
    await r.hset(keys.workers, "w0", json.dumps(entry | {"weight_version": 9}))
    assert await newest_version(r, keys, tmp_path) == 9
    await r.set(keys.weights_current, 11)
    assert await newest_version(r, keys, tmp_path) == 11


@pytest.mark.timeout(60)
async def test_republish_serves_the_files_of_an_old_version_under_a_new_number(tmp_path: Path, redis_client):
    r, keys = redis_client, Keys("rp")
    calls: list[str] = []
    worker, url = await _fake_worker(None, calls)
    try:
        await register(r, keys, "w0", url)
        t = {"w": torch.arange(6.0)}
        async with WeightPublisher(r, keys, RolloutConfig(keep_versions=1), tmp_path) as pub:
            root = pub.root
            await pub.publish(4, t)
            pin_versions(root, [4])  # what a checkpoint at step 5 pins: its generators served v4
            await pub.publish(5, {"w": torch.zeros(6)})
            await pub.publish(6, {"w": torch.ones(6)})
            result = await pub.republish(7, source=4)
            with pytest.raises(PublishError, match="already 7"):
                await pub.republish(7, source=4)
        assert result.source == 4 and result.workers[0].ok
        shard = "model-00000-of-00001.safetensors"
        assert torch.equal(load_file(str(root / "v7" / shard))["w"], t["w"])
        # Hard links, not copies: the same inode.
        assert (root / "v7" / shard).stat().st_ino == (root / "v4" / shard).stat().st_ino
        assert int(await r.get(keys.weights_current)) == 7
        log = [(int(f["version"]), f.get("source")) for _, f in await r.xrange(keys.weights_log)]
        assert log == [(4, None), (5, None), (6, None), (7, "4")]
        assert calls[-5:] == [
            "/start_weight_update",
            "/update_weights",
            "/finish_weight_update",
            "/reset_prefix_cache",
            "/resume",
        ]
    finally:
        await worker.cleanup()


@pytest.mark.timeout(60)
async def test_republish_refuses_a_corrupted_shard_naming_the_file(tmp_path: Path, redis_client):
    r, keys = redis_client, Keys("rc")
    async with WeightPublisher(r, keys, RolloutConfig(), tmp_path) as pub:
        await pub.publish(1, {"w": torch.arange(6.0)})
        root = pub.root
        shard = root / "v1" / "model-00000-of-00001.safetensors"
        data = bytearray(shard.read_bytes())
        data[-1] ^= 0xFF
        shard.write_bytes(bytes(data))
        with pytest.raises(PublishError, match=f"{shard}: CRC-32"):
            await pub.republish(2, source=1)
    assert int(await r.get(keys.weights_current)) == 1 and not (root / "v2").exists()
    assert not list(root.glob(".v2.*"))


_HOLDER = """
import asyncio, sys
import redis.asyncio
from common.keys import Keys
from common.weights.workers import weight_lock

async def main():
    host, port, password = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    client = redis.asyncio.Redis(host=host, port=port, password=password)
    async with weight_lock(client, Keys("dl"), "w", ttl_s=1.5):
        print("held", flush=True)
        await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.timeout(60)
async def test_the_weight_lock_outlives_its_ttl_while_held_and_lapses_after_a_kill(
    redis_client,
):
    """The weight lock outlives its TTL while held and lapses within it when the holder is killed.
    A trainer SIGKILLed mid-publish held its worker's weight lock: the next trainer (or the worker's own
    catch-up) must get it within the lock's TTL, not after the 600 s an update may take. The holder here is
    a real process holding the lock through a real Redis, killed with SIGKILL."""
    r, keys = redis_client, Keys("dl")
    kwargs = r.connection_pool.connection_kwargs
    holder = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        _HOLDER,
        kwargs["host"],
        str(kwargs["port"]),
        kwargs["password"],
        cwd=Path(__file__).resolve().parents[2],
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert await asyncio.wait_for(holder.stdout.readline(), 30) == b"held\n"
        # Renewed while held: three TTLs later it is still taken.
        await asyncio.sleep(4.5)
        assert await r.lock(keys.worker_sync("w")).locked()
        with pytest.raises(redis.exceptions.LockError, match="held by another updater"):
            async with weight_lock(r, keys, "w", ttl_s=1.5, wait_s=0.5):
                pass
    finally:
        holder.kill()
        await holder.wait()
    t0 = time.monotonic()
    async with weight_lock(r, keys, "w", ttl_s=1.5):
        waited = time.monotonic() - t0
        await asyncio.sleep(2.0)  # longer than the TTL: the renewal keeps it ours, and the release succeeds
    assert waited < 1.5 + 1.0, f"the killed holder's lock held its successor {waited:.1f}s"
    assert not await r.lock(keys.worker_sync("w")).locked()
