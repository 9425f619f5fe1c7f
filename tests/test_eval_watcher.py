"""The watcher's Redis side against a real redis-server (fast, no vLLM): waiting for the router fails
after its timeout naming the key and the fix; the fleet snapshot is settled only while every live
worker's /weight_info equals weights:current, and it ignores workers whose liveness key expired."""

from __future__ import annotations

import json

import aiohttp
import pytest
from aiohttp import web

from common.config import RendezvousConfig
from common.keys import Keys
from common.rendezvous import Rendezvous
from evaluator.watcher import EvaluatorError, FleetProbe, wait_for_router


@pytest.fixture
async def redis_client(tmp_path):
    rz = Rendezvous(tmp_path / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    client = rz.async_client()
    yield client
    await client.aclose()
    rz.close()


@pytest.mark.timeout(30)
async def test_waiting_for_the_router_times_out_naming_the_key_and_the_fix(redis_client):
    keys = Keys("t-watch")
    with pytest.raises(EvaluatorError, match=r"no router 'default' registered under Redis key ss:t-watch:router"):
        await wait_for_router(redis_client, keys, "default", 0.3)
    await redis_client.set(keys.router(), "http://127.0.0.1:1234")
    assert await wait_for_router(redis_client, keys, "default", 0.3) == "http://127.0.0.1:1234"


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
