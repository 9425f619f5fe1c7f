"""Stand-ins for vLLM servers in publisher tests: an in-process aiohttp app whose one handler answers
every POST (vLLM's RL routes: /pause, /start_weight_update, /update_weights, ...), and the Redis
entries that make it a live worker of the train pool."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from aiohttp import web

from common.keys import Keys

if TYPE_CHECKING:
    from common.weights.delta import HeldWeights


async def start_app(
    handle: Callable[[web.Request], Awaitable[web.Response]], methods: tuple[str, ...] = ("POST",)
) -> tuple[web.AppRunner, str]:
    """Serve `handle` for every request of `methods` on a free loopback port; the runner (clean it up) and its URL."""
    app = web.Application()
    for method in methods:
        app.router.add_route(method, "/{tail:.*}", handle)
    return await serve_app(app)


async def serve_app(app: web.Application) -> tuple[web.AppRunner, str]:
    """Serve `app` on a free loopback port; the runner (clean it up) and its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def register(r, keys: Keys, worker_id: str, url: str, alive: bool = True) -> None:
    """Enter a worker in the `workers` hash at version 0, live (with its liveness key) unless told otherwise."""
    entry = {"url": url, "model": "policy", "weight_version": 0, "started_at": 0.0}
    await r.hset(keys.workers, worker_id, json.dumps(entry))
    if alive:
        await r.set(keys.worker_alive(worker_id), "1", ex=30)


async def reading_worker(
    got: dict,
    on_update: Callable[[dict], None] | None = None,
    held: HeldWeights | None = None,
    reads: list | None = None,
) -> tuple[web.AppRunner, str]:
    """A worker that answers the RL routes and, on /update_weights, reads the version into `got` with the real
    reader (the `file` engine's; deltas are decoded against `held`, as the engine holds them; a collective update
    is received through its groups); `on_update(update_info)` runs first; `reads` gets each read's FileUpdateInfo.
    A failed read answers 500, as vLLM does."""
    import asyncio

    from rollout.vllm_plugin.file_engine import FileUpdateInfo

    async def handle(request: web.Request) -> web.Response:
        if request.path == "/update_weights":
            info = (await request.json())["update_info"]
            if on_update is not None:
                on_update(info)

            def read() -> None:
                update = FileUpdateInfo(**info)
                for name, t in update.tensors(held):
                    got[name] = t.clone()
                if reads is not None:
                    reads.append(update)

            try:
                await asyncio.to_thread(read)
            except (RuntimeError, TimeoutError, FileNotFoundError) as exc:
                return web.json_response({"error": str(exc)}, status=500)
        return web.json_response({"ok": True})

    return await start_app(handle)
