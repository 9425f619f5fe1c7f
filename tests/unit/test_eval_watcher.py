"""The watcher's Redis side against a real redis-server (fast, no vLLM): waiting for the router fails
after its timeout naming the key and the fix; a stream wait wakes on an entry added after its start (even
one added before the wait began) and otherwise returns after its timeout; the fleet snapshot is settled only
while every live worker's /weight_info equals weights:current, and it ignores workers whose liveness key
expired. Pin mode picks the newest due published version first, then older ones, skipping pruned ones with
one log line; evaluator.pin = auto waits for started vLLM workers to register, woken by the registration's
event, and pins only if one joined the eval pool."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import pytest
from aiohttp import web

import evaluator.fleetview
from common.keys import Keys
from common.roles import announce
from evaluator.fleetview import EvaluatorError, FleetProbe, StreamWait, choose_mode, starting_workers, wait_for_router
from evaluator.pinned import PinWatcher
from evaluator.watch_loop import Inputs


@pytest.mark.timeout(30)
async def test_waiting_for_the_router_times_out_naming_the_key_and_the_fix(redis_client):
    keys = Keys("t-watch")
    with pytest.raises(EvaluatorError, match=r"no router 'default' registered under Redis key ss:t-watch:router"):
        await wait_for_router(redis_client, keys, "default", 0.3)
    await redis_client.set(keys.router(), "http://127.0.0.1:1234")
    assert await wait_for_router(redis_client, keys, "default", 0.3) == "http://127.0.0.1:1234"


@pytest.mark.timeout(30)
async def test_a_stream_wait_wakes_on_any_entry_after_its_start_and_otherwise_times_out(redis_client):
    keys = Keys("t-wait")
    await redis_client.xadd(keys.events, {"event": "before the start"})
    events = await StreamWait(redis_client, keys.events).start()
    started = time.monotonic()
    await events.wait(0.3)  # nothing after the start: returns after its timeout
    assert 0.25 <= time.monotonic() - started < 2.0
    await redis_client.xadd(keys.events, {"event": "between a read and the wait"})
    started = time.monotonic()
    await events.wait(10.0)
    assert time.monotonic() - started < 1.0  # not missed: the wait starts from the position, not from now
    started = time.monotonic()
    await events.wait(0.3)  # the position moved past that entry
    assert time.monotonic() - started >= 0.25


@pytest.mark.timeout(30)
async def test_fleet_snapshot_is_settled_only_when_every_live_worker_serves_the_current_version(redis_client):
    served = {"w0": "3", "w1": "3"}

    def handler(worker):
        async def info(request):
            return web.json_response({"weight_version": served[worker]})

        return info

    runners, urls = [], {}
    for worker in served:
        app = web.Application()
        app.router.add_get("/weight_info", handler(worker))
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        urls[worker] = f"http://127.0.0.1:{runner.addresses[0][1]}"
    keys = Keys("t-fleet")
    try:
        async with aiohttp.ClientSession() as session:
            probe = FleetProbe(redis_client, keys, session)
            assert not (await probe.read()).settled  # no worker at all
            for worker, url in urls.items():
                await redis_client.hset(keys.workers, worker, json.dumps({"url": url}))
                await redis_client.set(keys.worker_alive(worker), "1", px=10_000)
            await redis_client.set(keys.weights_current, 3)
            first = await probe.read()
            assert first.settled and first.version == "3"
            served["w1"] = "4"  # a publish is midway: w1 already runs version 4
            moving = await probe.read()
            assert not moving.settled and moving != first
            await redis_client.delete(keys.worker_alive("w1"))  # w1's heartbeat expired: not live
            alone = await probe.read()
            assert alone.settled and alone.detail == (("w0", "3"),) and alone != first
    finally:
        for runner in runners:
            await runner.cleanup()


def pin_watcher(client, keys: Keys, tmp_path) -> PinWatcher:
    from pathlib import Path

    from common.config import Config
    from common.metrics import MetricsWriter
    from common.roles import RunContext
    from evaluator.cache import ResultCache
    from evaluator.runner import eval_plan

    cfg = Config()
    cfg.evaluator.data_root = str(Path(__file__).resolve().parents[2] / "evaluator" / "data")
    ctx = RunContext(cfg, "evaluator", keys.exp, tmp_path, tmp_path / "meet", "i0", None, keys)  # type: ignore[arg-type]
    inputs = Inputs(
        ctx,
        client,
        eval_plan(cfg.evaluator, None),
        ResultCache(tmp_path / "cache.jsonl"),
        MetricsWriter(tmp_path, keys.exp, "evaluator", 0),
    )
    return PinWatcher(inputs, None)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
async def test_pin_mode_takes_the_newest_due_version_first_and_skips_pruned_ones(redis_client, tmp_path, caplog):
    """Pin mode takes the newest due version first, then older ones, and skips pruned ones once."""
    keys = Keys("t-pin")
    for version in range(1, 6):
        location = tmp_path / "weights" / f"v{version}"
        if version != 1:  # v1's directory was pruned by the publisher
            location.mkdir(parents=True)
        await redis_client.xadd(keys.weights_log, {"version": version, "backend": "file", "location": str(location)})
    watcher = pin_watcher(redis_client, keys, tmp_path)
    watcher.done.add((3, "arithmetic"))
    await watcher.read_log()
    picked = []
    while (version := await watcher.pick()) is not None:
        picked.append(version)
        watcher.done.add((version, "arithmetic"))
    assert picked == [5, 4, 2]
    assert sum("were pruned" in r.getMessage() and "[1]" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.timeout(60)
async def test_auto_mode_waits_for_starting_vllm_workers_and_pins_only_when_an_eval_worker_registers(
    redis_client, monkeypatch
):
    # Blocks longer than the whole wait: only the registration's event can end the wait early.
    monkeypatch.setattr(evaluator.fleetview, "BLOCK_S", 30.0)
    keys = Keys("t-auto")
    assert await choose_mode(redis_client, keys, 0.3) == "verify"  # no vLLM worker started at all
    await redis_client.set(keys.role_alive("vllm", "host-1-0"), "{}", px=10_000)
    await redis_client.set(keys.role_alive("vllm", "host-2-1"), "{}", px=10_000)
    await redis_client.hset(keys.workers, "host-1-0", json.dumps({"url": "http://127.0.0.1:1"}))
    assert await starting_workers(redis_client, keys) == ["host-2-1"]

    async def register_eval_worker() -> None:
        await asyncio.sleep(0.5)
        # As rollout/worker.py registers: liveness key, record, then the event.
        await redis_client.set(keys.worker_alive("host-2-1"), "1", px=10_000)
        await redis_client.hset(keys.eval_workers, "host-2-1", json.dumps({"url": "http://127.0.0.1:2"}))
        await announce(redis_client, keys, "vllm", "worker registered", worker="host-2-1", pool="eval")

    task = asyncio.create_task(register_eval_worker())
    started = time.monotonic()
    assert await choose_mode(redis_client, keys, 10.0) == "pin"
    assert time.monotonic() - started < 5.0  # woken by the event, not at the end of the 10 s wait
    await task
    await redis_client.delete(keys.eval_workers)
    await redis_client.hset(keys.workers, "host-2-1", json.dumps({"url": "http://127.0.0.1:2"}))
    assert await choose_mode(redis_client, keys, 10.0) == "verify"  # both started workers are train workers
