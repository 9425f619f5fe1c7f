"""The router's fault-tolerance acceptance test (issue 3): under 64 concurrent clients, one of three
backend processes is killed with SIGKILL. No client request may fail unless it had already received
bytes (only a stream cut mid-way may), no answer may be silently truncated, and the dead backend
must leave /workers within its heartbeat TTL."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from common.config import RendezvousConfig
from common.keys import Keys
from common.rendezvous import Rendezvous
from tests.support.fake_openai import start_backends, start_router_process, token, wait_published
from tests.support.prom import value

CLIENTS = 64
TTL_S, PERIOD_S = 1.0, 0.2
EXP = "fault"


@dataclass
class Outcome:
    ok: bool
    received: int  # bytes the client had received when the request ended
    worker: str = ""
    error: str = ""


async def one_request(http: aiohttp.ClientSession, url: str, body: dict) -> Outcome:
    received = 0
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            data = b""
            async for chunk in resp.content.iter_any():
                received += len(chunk)
                data += chunk
            if resp.status != 200:
                return Outcome(False, received, error=f"status {resp.status}: {data[:200]!r}")
            worker = resp.headers.get("X-Worker", "")
            complete = data.endswith(b"data: [DONE]\n\n") if body["stream"] else json.loads(data)["worker"] == worker
            return Outcome(complete, received, worker, "" if complete else f"truncated answer of {received} bytes")
    except (aiohttp.ClientError, ValueError) as exc:
        return Outcome(False, received, error=f"{type(exc).__name__}: {exc}")


def transport_errors(metrics_text: str) -> int:
    return int(value(metrics_text, "slipstream_router_errors_total", **{"class": "transport"}))


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_kill_9_of_one_backend_under_64_clients_fails_only_requests_that_had_bytes(tmp_path: Path):
    rz = Rendezvous(tmp_path / "meet", RendezvousConfig())
    redis = rz.connect(timeout_s=10)
    backends = start_backends(["f0", "f1", "f2"], rz.meet, EXP, period_s=PERIOD_S, ttl_s=TTL_S)
    config = tmp_path / "router.toml"
    config.write_text(
        f'[run]\nname = "fault"\nroot = "{tmp_path / "runs"}"\n'
        f"[rendezvous]\nheartbeat_period_s = {PERIOD_S}\nheartbeat_ttl_s = {TTL_S}\n"
        '[router]\npolicy = "least_outstanding"\nhealth_interval_s = 0.2\nhealth_timeout_s = 0.5\nmax_retries = 2\n'
    )
    router = start_router_process(config, rz.meet, EXP)
    outcomes: list[Outcome] = []
    stop = asyncio.Event()
    try:
        url = wait_published(router, redis, Keys(EXP).router())
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), headers=token(rz.meet)) as http:

            async def client_loop(i: int) -> None:
                n = 0
                while not stop.is_set():
                    # Half the clients stream (4 chunks 20 ms apart), half wait 20 ms for a JSON answer.
                    body = {"prompt": f"c{i}-{n}", "stream": i % 2 == 0, "max_tokens": 4, "chunk_delay_s": 0.02}
                    if not body["stream"]:
                        body["delay_s"] = 0.02
                    outcomes.append(await one_request(http, url, body))
                    n += 1

            tasks = [asyncio.create_task(client_loop(i)) for i in range(CLIENTS)]
            await asyncio.sleep(1.5)
            victim = backends[1]
            victim.kill()
            killed_at, killed_wall = time.monotonic(), time.time()
            served_before_kill = Counter(o.worker for o in outcomes)
            while True:
                async with http.get(url + "/workers") as resp:
                    listed = {w["id"] for w in (await resp.json())["workers"]}
                if "f1" not in listed:
                    break
                assert time.monotonic() - killed_at < TTL_S + 3.0, "the killed backend is still listed"
                await asyncio.sleep(0.02)
            listed_after = time.monotonic() - killed_at
            # When the router itself removed it (its event's clock), apart from this loaded test loop's delay.
            removal = next(
                f
                for _, f in redis.xrange(Keys(EXP).events)
                if f["event"] == "worker_removed" and json.loads(f["detail"])["worker"] == "f1"
            )
            removed_after = float(removal["ts"]) - killed_wall
            await asyncio.sleep(0.5)  # keep the load on the remaining two for a while
            stop.set()
            await asyncio.gather(*tasks)
            async with http.get(url + "/metrics") as resp:
                transport = transport_errors(await resp.text())
    finally:
        router.terminate()
        router.wait(timeout=15)
        for b in backends:
            b.stop()
        redis.close()
        rz.close()

    failed = [o for o in outcomes if not o.ok]
    print(
        f"{len(outcomes)} requests, {len(failed)} failed after bytes, {transport} transport errors, "
        f"removed by the router {removed_after:.2f} s after the kill, gone from /workers after {listed_after:.2f} s"
    )
    failed_before_bytes = [o for o in failed if o.received == 0 or "truncated" in o.error]
    assert served_before_kill["f1"] > 0, "the victim served nothing before the kill: the test proves nothing"
    assert transport > 0, "no request was in flight at the victim when it died"
    assert len(outcomes) > 500, f"only {len(outcomes)} requests completed"
    assert failed_before_bytes == [], f"{len(failed_before_bytes)} failed before any byte: {failed_before_bytes[:3]}"
    assert all(o.received > 0 for o in failed)
    # The last beat came at most one period before the kill, so the key expires within TTL_S of it;
    # the margin is for scheduling on a loaded two-core machine (a router that noticed only at its next
    # refresh_s poll would take up to TTL_S + 0.5 s).
    assert removed_after <= TTL_S + 0.3, f"the router removed the dead backend {removed_after:.2f} s after the kill"
