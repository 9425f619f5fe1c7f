"""rollout/worker.py `UnheldPause`: a server left paused with nobody holding the worker's weight lock (a cut-off
publisher's request that arrived after the worker rejoined) is resumed once the grace has passed, and never while
someone holds the lock. Real Redis (the lock) and real HTTP over loopback; the vLLM server is stood in for by a
small aiohttp app answering /is_paused and /resume as vLLM's RL routes do (no vLLM needed for the rule itself)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from aiohttp import web

from common.config import Config
from common.keys import Keys
from common.roles import RunContext
from common.weights.workers import weight_lock
from rollout.worker import UnheldPause
from tests.support.rl_routes import start_app


async def test_an_unheld_pause_is_resumed_after_the_grace_and_a_held_one_never(tmp_path: Path, redis_client):
    state = {"paused": True, "resumes": 0}

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/is_paused":
            return web.json_response({"is_paused": state["paused"]})
        if request.path == "/resume":
            state["paused"] = False
            state["resumes"] += 1
        return web.json_response({"ok": True})

    runner, url = await start_app(handle, ("GET", "POST"))
    keys = Keys("unheld")
    ctx = RunContext(Config(), "vllm", keys.exp, tmp_path, tmp_path / "meet", "i0", None, keys)  # type: ignore[arg-type]
    guard = UnheldPause(grace_s=0.3)
    try:
        async with aiohttp.ClientSession() as session:
            # Held by a publisher: its pause is left alone, however long.
            async with weight_lock(redis_client, keys, "w"):
                for _ in range(3):
                    assert not await guard.look(ctx, redis_client, session, "w", url)
                    await asyncio.sleep(0.15)
            assert state == {"paused": True, "resumes": 0}
            # Nobody holds it: the first look starts the grace, a look after it resumes the server.
            assert not await guard.look(ctx, redis_client, session, "w", url)
            assert state["paused"]
            await asyncio.sleep(0.35)
            assert await guard.look(ctx, redis_client, session, "w", url)
            assert state == {"paused": False, "resumes": 1}
            assert not await guard.look(ctx, redis_client, session, "w", url)  # not paused: nothing to do
    finally:
        await runner.cleanup()
