"""A small OpenAI-compatible backend that stands in for a vLLM worker in router tests and the router
benchmark. It runs as its own process (`python tests/support/fake_openai.py --id w0 ...`), prints
`READY <url>` once it listens, and, given a meet dir, registers itself in the experiment's Redis the
way a rollout worker does (workers hash + heartbeat-refreshed alive key), so `kill -9` makes it
expire. Its answers are deterministic functions of the request, so a test can compare bytes through
the router with bytes from the backend directly; request fields steer it: `stream`, `max_tokens`
(number of SSE chunks), `delay_s` (before answering), `chunk_delay_s`, `status` (always answer it),
`fail_on` + `fail_status` (answer fail_status when this worker's id is listed), `hang_on` (never
answer when this worker's id is listed). GET /_stats reports
what it served and how many requests were cancelled by a disconnect; POST /_control sets health.

`Backend` (below) starts and stops such a process, and `start_router_process` the router role
process in front of them, for tests and benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web

from common.net import bearer
from common.run_secrets import read_secrets

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class State:
    worker_id: str
    model: str
    healthy: bool = True
    requests: int = 0
    cancelled: int = 0
    paths: Counter[str] = field(default_factory=Counter)
    groups: Counter[str] = field(default_factory=Counter)


def stream_chunks(body: dict, n: int) -> list[bytes]:
    """The SSE events of one streamed answer: a deterministic function of the request body, with
    multi-byte UTF-8 and one event far larger than a socket read, so byte-level damage shows."""
    seed = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    events = []
    for i in range(n):
        text = f"tok{i}-{seed[i % 64 :]}-é✓"
        if i == n // 2:
            text += "x" * 100_000
        events.append(f"data: {json.dumps({'index': i, 'text': text}, ensure_ascii=False)}\n\n".encode())
    events.append(b"data: [DONE]\n\n")
    return events


def make_app(state: State, api_key: str = "") -> web.Application:
    """The fake's routes; with `api_key`, every route but /health and the test-only /_ routes answers 401
    without `Authorization: Bearer <api_key>`, as a worker's vLLM does (rollout/vllm_plugin/auth.py)."""

    @web.middleware
    async def require_key(request: web.Request, handler: Any) -> web.StreamResponse:
        open_path = request.path == "/health" or request.path.startswith("/_")
        if api_key and not open_path and request.headers.get("Authorization") != f"Bearer {api_key}":
            return web.json_response({"error": {"message": "missing or wrong bearer token"}}, status=401)
        return await handler(request)

    async def generate(request: web.Request) -> web.StreamResponse:
        state.requests += 1
        state.paths[request.path] += 1
        try:
            return await answer(request)
        except asyncio.CancelledError:
            state.cancelled += 1
            raise

    async def answer(request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw) if raw else {}
        group = request.headers.get("X-Slipstream-Group") or body.get("slipstream_group")
        if group is not None:
            state.groups[str(group)] += 1
        headers = {"X-Worker": state.worker_id}
        if body.get("delay_s"):
            await asyncio.sleep(float(body["delay_s"]))
        if state.worker_id in body.get("hang_on", ()):
            await asyncio.sleep(3600)  # accepted and never answered, as a server whose engine died
        status = body.get("status")
        if state.worker_id in body.get("fail_on", ()):
            status = body.get("fail_status", 503)
        if status:
            error = {"error": {"message": f"forced {status} by {state.worker_id}", "type": "forced", "code": status}}
            return web.json_response(error, status=int(status), headers=headers | {"X-Forced": "1"})
        if body.get("stream"):
            response = web.StreamResponse(headers=headers | {"Content-Type": "text/event-stream"})
            await response.prepare(request)
            for chunk in stream_chunks(body, int(body.get("max_tokens", 8))):
                await response.write(chunk)
                if body.get("chunk_delay_s"):
                    await asyncio.sleep(float(body["chunk_delay_s"]))
            await response.write_eof()
            return response
        seen = {"authorization": "Authorization" in request.headers, "group": group}
        if request.path == "/inference/v1/generate":
            result = {"token_ids": list(reversed(body.get("token_ids", []))), "worker": state.worker_id, "seen": seen}
        else:
            result = {
                "id": "cmpl-fake",
                "object": "text_completion",
                "model": state.model,
                "worker": state.worker_id,
                "seen": seen,
                "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
            }
        return web.json_response(result, headers=headers)

    async def models(request: web.Request) -> web.Response:
        state.requests += 1
        state.paths[request.path] += 1
        return web.json_response({"object": "list", "data": [{"id": state.model, "object": "model"}]})

    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok") if state.healthy else web.Response(status=503, text="unhealthy")

    async def control(request: web.Request) -> web.Response:
        state.healthy = bool((await request.json())["healthy"])
        return web.json_response({"healthy": state.healthy})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "id": state.worker_id,
                "requests": state.requests,
                "cancelled": state.cancelled,
                "paths": dict(state.paths),
                "groups": dict(state.groups),
            }
        )

    app = web.Application(middlewares=[require_key])
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_post("/_control", control)
    app.router.add_get("/_stats", stats)
    return app


async def serve(args: argparse.Namespace) -> None:
    state = State(args.id, args.model)
    runner = web.AppRunner(make_app(state, args.api_key), access_log=None, handler_cancellation=True)
    await runner.setup()
    await web.TCPSite(runner, args.host, args.port, backlog=1024).start()
    url = f"http://{args.host}:{runner.addresses[0][1]}"
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    heartbeat = client = keys = None
    if args.meet:
        from common.heartbeat import Heartbeat
        from common.keys import Keys
        from common.rendezvous import Rendezvous

        rz = Rendezvous(args.meet)
        rz.connect(timeout_s=10)
        client, keys = rz.async_client(), Keys(args.exp)
        record = {"url": url, "model": args.model, "weight_version": 0, "started_at": time.time()}
        await client.hset(keys.workers, args.id, json.dumps(record))
        heartbeat = Heartbeat(client, keys.worker_alive(args.id), "1", args.period, args.ttl)
        await heartbeat.start()
    print(f"READY {url}", flush=True)
    try:
        await stop.wait()
    finally:
        if heartbeat is not None and client is not None and keys is not None:
            await heartbeat.stop()
            await client.hdel(keys.workers, args.id)
            await client.aclose()
        await runner.cleanup()


@dataclass
class Backend:
    """One fake backend process; `start` waits for its READY line."""

    worker_id: str
    meet: Path | None = None
    exp: str = ""
    period_s: float = 0.2
    ttl_s: float = 1.0
    api_key: str = ""
    proc: subprocess.Popen[str] | None = None
    url: str = ""

    def start(self) -> Backend:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--id", self.worker_id]
        if self.meet is not None:
            cmd += [
                "--meet",
                str(self.meet),
                "--exp",
                self.exp,
                "--period",
                str(self.period_s),
                "--ttl",
                str(self.ttl_s),
            ]
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
        return self

    def wait_ready(self) -> Backend:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()  # blocks until READY or exit (the process prints nothing else)
        if not line.startswith("READY "):
            self.stop()
            raise RuntimeError(f"fake backend {self.worker_id} did not start: {line!r} (exit {self.proc.poll()})")
        self.url = line.split()[1]
        return self

    def kill(self) -> None:
        """SIGKILL: no deregistration, the alive key just stops being refreshed."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.kill()


def start_backends(ids: list[str], meet: Path | None = None, exp: str = "", **kw: Any) -> list[Backend]:
    """Start several backends at once (their interpreters boot in parallel) and wait for all."""
    backends = [Backend(i, meet, exp, **kw).start() for i in ids]
    try:
        return [b.wait_ready() for b in backends]
    except BaseException:
        for b in backends:
            b.stop()
        raise


def start_router_process(config: Path, meet: Path, exp: str, **popen: object) -> subprocess.Popen[str]:
    """The router role process (`ROLE=router python -m common.runs.cli run CONFIG`) of experiment `exp`;
    it publishes its URL under `Keys(exp).router(name)` once it serves."""
    env = os.environ | {"ROLE": "router", "SLIPSTREAM_MEET_DIR": str(meet), "SLIPSTREAM_EXP": exp}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "common.runs.cli", "run", str(config)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, text=True, **popen)  # type: ignore[call-overload]


def token(meet: Path) -> dict[str, str]:
    """The Authorization header a router role process of the run at `meet` asks for (its generated token)."""
    found = read_secrets(meet)
    if found is None:
        raise RuntimeError(f"no secrets.json in {meet}: has the router process started?")
    return bearer(found.router)


def wait_published(proc: subprocess.Popen[str], client: Any, key: str, timeout_s: float = 30.0) -> str:
    """The URL a router process publishes at `key` (a sync Redis client), failing if it exits first."""
    deadline = time.monotonic() + timeout_s
    while (url := client.get(key)) is None:
        if proc.poll() is not None:
            raise RuntimeError(f"router exited with {proc.returncode} before publishing {key}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"router did not publish {key} within {timeout_s} s")
        time.sleep(0.05)
    return url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--id", required=True, help="worker id (also put in X-Worker and JSON answers)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--model", default="policy")
    parser.add_argument("--meet", default="", help="meet dir of the experiment's Redis; empty: do not register")
    parser.add_argument("--exp", default="test")
    parser.add_argument("--period", type=float, default=0.2, help="heartbeat period, seconds")
    parser.add_argument("--ttl", type=float, default=1.0, help="alive-key TTL, seconds")
    parser.add_argument("--api-key", default="", help="bearer token required on every route but /health")
    args = parser.parse_args()
    import uvloop

    with contextlib.suppress(KeyboardInterrupt):
        uvloop.run(serve(args))


if __name__ == "__main__":
    main()
