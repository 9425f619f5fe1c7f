"""The router end to end over loopback: real Redis (started through the rendezvous in a temporary
meet dir), three fake OpenAI backends in their own processes registered the way rollout workers
register, and the router serving in the test's event loop. Each test states one behaviour of
issue 3: balancing, affinity, streaming integrity, error pass-through and retries, auth, limits,
health-based eviction, heartbeat expiry and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest

from common.config import RendezvousConfig, RouterConfig
from common.keys import Keys
from common.rendezvous import Rendezvous
from common.weights.fleet import time_to_live
from router import pool as router_pool
from router.server import Router, RouterError
from tests.support.fake_openai import Backend, start_backends
from tests.support.prom import value

EXP = "routertest"
TTL_S, PERIOD_S = 1.0, 0.2

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def rz(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rendezvous]:
    rz = Rendezvous(tmp_path_factory.mktemp("meet"), RendezvousConfig())
    rz.connect(timeout_s=10)
    yield rz
    rz.close()


@pytest.fixture(scope="module")
def backends(rz: Rendezvous) -> Iterator[list[Backend]]:
    started = start_backends(["w0", "w1", "w2"], rz.meet, EXP, period_s=PERIOD_S, ttl_s=TTL_S)
    yield started
    for b in started:
        b.stop()


@contextlib.asynccontextmanager
async def router(
    rz: Rendezvous, exp: str = EXP, worker_api_key: str = "", **overrides: object
) -> AsyncIterator[Router]:
    settings: dict[str, object] = {"health_interval_s": 0.2, "health_timeout_s": 0.5, "policy": "least_outstanding"}
    cfg = RouterConfig(**(settings | overrides))  # type: ignore[arg-type]
    client = rz.async_client()
    r = Router(cfg, client, Keys(exp), PERIOD_S, TTL_S, worker_api_key=worker_api_key)
    try:
        await r.start()
        yield r
    finally:
        await r.stop()
        await client.aclose()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, body: dict, **kw: object) -> tuple[int, dict, bytes]:
    async with http.post(url, json=body, **kw) as resp:  # type: ignore[arg-type]
        return resp.status, dict(resp.headers), await resp.read()


async def stats(http: aiohttp.ClientSession, backends: list[Backend]) -> dict[str, dict]:
    out = {}
    for b in backends:
        async with http.get(b.url + "/_stats") as resp:
            out[b.worker_id] = await resp.json()
    return out


async def wait_for(predicate, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    """Poll an async predicate; return the seconds it took or fail naming `what`."""
    start = time.monotonic()
    while not await predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what} did not happen within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - start


async def workers_of(http: aiohttp.ClientSession, url: str) -> dict[str, dict]:
    async with http.get(url + "/workers") as resp:
        return {w["id"]: w for w in (await resp.json())["workers"]}


async def test_all_registered_workers_are_routable_at_start(rz, backends, http):
    async with router(rz) as r:
        listed = await workers_of(http, r.url)
        assert sorted(listed) == ["w0", "w1", "w2"]
        assert all(w["healthy"] and w["url"] == b.url for w, b in zip(listed.values(), backends, strict=True))


async def test_least_outstanding_spreads_sequential_and_concurrent_requests(rz, backends, http):
    async with router(rz, policy="least_outstanding") as r:
        served = Counter()
        for _ in range(30):
            status, headers, _ = await post(http, r.url + "/v1/completions", {"prompt": "p"})
            assert status == 200
            # The router names the worker that answered (the backend's own X-Worker says who it is).
            assert headers["X-Slipstream-Worker"] == headers["X-Worker"]
            served[headers["X-Worker"]] += 1
        assert served == {"w0": 10, "w1": 10, "w2": 10}
        results = await asyncio.gather(
            *(post(http, r.url + "/v1/completions", {"prompt": "p", "delay_s": 0.2}) for _ in range(30))
        )
        concurrent = Counter(headers["X-Worker"] for _, headers, _ in results)
        assert min(concurrent.values()) >= 8, concurrent


async def test_round_robin_alternates_workers(rz, backends, http):
    async with router(rz, policy="round_robin") as r:
        order = [(await post(http, r.url + "/v1/completions", {"prompt": "p"}))[1]["X-Worker"] for _ in range(6)]
        assert order[:3] == order[3:] and sorted(order[:3]) == ["w0", "w1", "w2"]


async def test_affinity_sends_each_group_to_one_worker(rz, backends, http):
    async with router(rz, policy="affinity") as r:
        owners: dict[str, set[str]] = {}
        for g in range(12):
            for i in range(4):
                if i % 2:  # the key may come in the header or as a body field
                    kw = {"headers": {"X-Slipstream-Group": f"g{g}"}}
                    body = {"prompt": f"sample {i}"}
                else:
                    kw, body = {}, {"prompt": f"sample {i}", "slipstream_group": f"g{g}"}
                _, headers, _ = await post(http, r.url + "/v1/completions", body, **kw)
                owners.setdefault(f"g{g}", set()).add(headers["X-Worker"])
        assert all(len(o) == 1 for o in owners.values()), owners
        assert len(set().union(*owners.values())) >= 2, "all groups landed on one worker"


async def test_streaming_is_relayed_byte_for_byte_and_chunk_by_chunk(rz, backends, http):
    body = {"prompt": "stream me", "stream": True, "max_tokens": 6, "chunk_delay_s": 0.1}
    async with http.post(backends[0].url + "/v1/completions", json=body) as resp:
        direct = await resp.read()
    async with router(rz) as r:
        start = time.monotonic()
        async with http.post(r.url + "/v1/chat/completions", json=body) as resp:
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            first = await resp.content.readany()
            first_at = time.monotonic() - start
            via_router = first + await resp.read()
        total = time.monotonic() - start
    assert via_router == direct
    assert len(direct) > 100_000 and direct.endswith(b"data: [DONE]\n\n")
    assert first_at < total - 0.3, "the first chunk waited for the whole stream"


async def test_client_4xx_is_returned_unchanged_without_retry(rz, backends, http):
    async with router(rz, max_retries=2) as r:
        before = sum(s["requests"] for s in (await stats(http, backends)).values())
        status, headers, raw = await post(http, r.url + "/v1/completions", {"prompt": "p", "status": 422})
        after = sum(s["requests"] for s in (await stats(http, backends)).values())
    assert status == 422 and headers["X-Forced"] == "1"
    assert json.loads(raw)["error"]["message"].startswith("forced 422 by w")
    assert after - before == 1


async def test_retryable_answers_go_to_another_worker(rz, backends, http):
    async with router(rz, max_retries=2) as r:
        for _ in range(6):
            status, headers, _ = await post(
                http, r.url + "/v1/completions", {"prompt": "p", "fail_on": ["w0", "w1"], "fail_status": 503}
            )
            assert (status, headers["X-Worker"]) == (200, "w2")
        async with http.get(r.url + "/metrics") as resp:
            assert value(await resp.text(), "slipstream_router_retries_total") > 0
        # Every worker failing: the last worker's own answer comes back after 1 + max_retries attempts.
        before = sum(s["requests"] for s in (await stats(http, backends)).values())
        status, headers, _ = await post(
            http, r.url + "/v1/completions", {"prompt": "p", "fail_on": ["w0", "w1", "w2"], "fail_status": 429}
        )
        after = sum(s["requests"] for s in (await stats(http, backends)).values())
    assert (status, headers["X-Forced"], after - before) == (429, "1", 3)


async def test_without_retries_a_retryable_answer_is_returned(rz, backends, http):
    async with router(rz, max_retries=0, policy="round_robin") as r:
        statuses = [
            (await post(http, r.url + "/v1/completions", {"prompt": "p", "fail_on": ["w1"]}))[0] for _ in range(3)
        ]
    assert sorted(statuses) == [200, 200, 503]


async def test_bearer_token_is_required_and_not_forwarded(rz, backends, http):
    async with router(rz, auth_token="s3cret") as r:
        url = r.url + "/v1/completions"
        assert (await post(http, url, {"prompt": "p"}))[0] == 401
        status, headers, raw = await post(http, url, {"prompt": "p"}, headers={"Authorization": "Bearer nope"})
        assert status == 401 and headers["WWW-Authenticate"] == "Bearer" and b"auth_token" in raw
        status, _, raw = await post(http, url, {"prompt": "p"}, headers={"Authorization": "Bearer s3cret"})
        assert status == 200 and json.loads(raw)["seen"]["authorization"] is False
        async with http.get(r.url + "/workers") as resp:
            assert resp.status == 401
        async with http.get(r.url + "/health") as resp:
            assert resp.status == 200


async def test_the_workers_key_replaces_the_clients_authorization_on_the_hop_to_a_worker(rz, http):
    """A worker bound beyond loopback wants rollout.api_key (the fake refuses like vLLM's middleware)."""
    keyed = start_backends(["k0"], rz.meet, "keyed", period_s=PERIOD_S, ttl_s=TTL_S, api_key="worker-key")
    try:
        async with router(rz, "keyed", auth_token="router-key") as r:
            assert [w.id for w in r.pool.healthy] == ["k0"]  # its /health needs no key
            sent = {"Authorization": "Bearer router-key"}
            status, _, raw = await post(http, r.url + "/v1/completions", {"prompt": "p"}, headers=sent)
            assert status == 401, "the fake let a request without the workers' key through"
        async with router(rz, "keyed", auth_token="router-key", worker_api_key="worker-key") as r:
            status, _, raw = await post(http, r.url + "/v1/completions", {"prompt": "p"}, headers=sent)
            assert status == 200 and json.loads(raw)["worker"] == "k0", raw
    finally:
        for b in keyed:
            b.stop()


async def test_non_loopback_without_token_refuses_to_start(rz):
    with pytest.raises(RouterError, match="0.0.0.0.*auth_token"):
        async with router(rz, bind_host="0.0.0.0"):
            pass


async def test_oversized_body_gets_413(rz, backends, http):
    async with router(rz, max_body_bytes=1000) as r:
        status, _, raw = await post(http, r.url + "/v1/completions", {"prompt": "x" * 2000})
        assert status == 413 and b"max_body_bytes = 1000" in raw

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies while reading
            for _ in range(4):
                yield b"x" * 500

        async with http.post(r.url + "/v1/completions", data=chunked()) as resp:
            assert resp.status == 413
        assert (await post(http, r.url + "/v1/completions", {"prompt": "x" * 500}))[0] == 200


async def test_no_healthy_worker_is_a_503_that_says_so(rz, http):
    async with router(rz, exp="empty") as r:
        status, headers, raw = await post(http, r.url + "/v1/completions", {"prompt": "p"})
    assert status == 503 and headers["Content-Type"].startswith("application/json")
    assert "no healthy worker" in json.loads(raw)["error"]["message"]


async def test_unknown_paths_and_wrong_methods_get_openai_style_json_errors(rz, http):
    async with router(rz, exp="empty") as r:
        answers = []
        for method, path in (
            ("POST", "/v1/embeddings"),
            ("GET", "/nothing/here"),
            ("GET", "/v1/completions"),
            ("DELETE", "/workers"),
        ):
            async with http.request(method, r.url + path) as resp:
                answers.append(
                    (
                        resp.status,
                        resp.headers["Content-Type"],
                        resp.headers.get("Allow"),
                        await resp.json(content_type=None),
                    )
                )
    for status, content_type, _, body in answers:
        assert content_type.startswith("application/json") and set(body["error"]) == {
            "message",
            "type",
            "param",
            "code",
        }
        assert body["error"]["code"] == status
    (s1, _, _, b1), (s2, _, _, b2), (s3, _, allow3, b3), (s4, _, allow4, b4) = answers
    assert (s1, s2, s3, s4) == (404, 404, 405, 405)
    assert b1["error"]["type"] == "not_found" and "no route POST /v1/embeddings" in b1["error"]["message"]
    assert "POST /v1/completions" in b2["error"]["message"]  # says what is served
    assert b3["error"]["type"] == "method_not_allowed" and allow3 == "POST" and "use POST" in b3["error"]["message"]
    assert allow4 == "GET, HEAD"


async def test_other_routes_are_proxied(rz, backends, http):
    async with router(rz) as r:
        async with http.get(r.url + "/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "policy"
        status, _, raw = await post(http, r.url + "/inference/v1/generate", {"token_ids": [1, 2, 3]})
        assert status == 200 and json.loads(raw)["token_ids"] == [3, 2, 1]
        async with http.get(r.url + "/v1/completions") as resp:
            assert resp.status == 405


async def test_failing_health_check_evicts_and_passing_readmits(rz, backends, http):
    w1 = backends[1]
    async with router(rz) as r:

        async def healthy(expected: bool):  # type: ignore[no-untyped-def]
            return (await workers_of(http, r.url))["w1"]["healthy"] is expected

        try:
            await post(http, w1.url + "/_control", {"healthy": False})
            await wait_for(lambda: healthy(False), 1.5, "eviction of w1")
            served = {(await post(http, r.url + "/v1/completions", {"prompt": "p"}))[1]["X-Worker"] for _ in range(6)}
            assert served == {"w0", "w2"}
            assert "503" in (await workers_of(http, r.url))["w1"]["last_error"]
        finally:
            await post(http, w1.url + "/_control", {"healthy": True})
        await wait_for(lambda: healthy(True), 1.5, "re-admission of w1")


async def test_worker_whose_heartbeat_expires_is_removed(rz, backends, http):
    keys = Keys("ghosts")
    client = rz.async_client()
    try:
        record = {"url": backends[0].url, "model": "policy", "weight_version": 3, "started_at": time.time()}
        await client.hset(keys.workers, "ghost", json.dumps(record))
        await client.set(keys.worker_alive("ghost"), "1", px=1500)  # one beat, never refreshed
        beat_at = time.monotonic()
        async with router(rz, exp="ghosts") as r:
            listed = await workers_of(http, r.url)
            assert listed["ghost"]["healthy"] and listed["ghost"]["weight_version"] == 3
            await wait_for(
                lambda: _absent(http, r.url, "ghost"), 3.0, "removal of the worker with the expired heartbeat"
            )
            assert time.monotonic() - beat_at <= 1.5 + 0.25  # within its TTL, not a refresh period later
            assert (await post(http, r.url + "/v1/completions", {"prompt": "p"}))[0] == 503
    finally:
        await client.delete(keys.workers)
        await client.aclose()


async def test_a_liveness_answer_that_reaches_the_router_late_does_not_postpone_removal(
    rz, backends, http, monkeypatch
):
    """Redis measures a TTL when it answers; on a loaded host the answer can reach the router's event loop much
    later. The worker beats for the last time as the router asks, and the answer takes 0.4 s to arrive: the
    worker still leaves within its TTL, not its TTL plus the answer's delay."""
    keys = Keys("late")
    client = rz.async_client()
    ttl_s, delay_s = 0.45, 0.4
    beat_at: list[float] = []
    questions = 0

    async def answered_late(redis_client, keys_, worker_ids):  # type: ignore[no-untyped-def]
        nonlocal questions
        questions += 1
        if questions != 2:  # the first is the router's start; the second its refresh loop's first
            return await time_to_live(redis_client, keys_, worker_ids)
        await client.set(keys.worker_alive("ghost"), "1", px=int(ttl_s * 1000))  # the worker's last beat
        beat_at.append(time.monotonic())
        ttls = await time_to_live(redis_client, keys_, worker_ids)
        await asyncio.sleep(delay_s)  # the answer waits to reach the router
        return ttls

    monkeypatch.setattr(router_pool, "time_to_live", answered_late)
    try:
        record = {"url": backends[0].url, "model": "policy", "weight_version": 0, "started_at": time.time()}
        await client.hset(keys.workers, "ghost", json.dumps(record))
        await client.set(keys.worker_alive("ghost"), "1", px=30_000)
        async with router(rz, exp="late") as r:
            assert (await workers_of(http, r.url))["ghost"]["healthy"]
            await wait_for(lambda: _absent(http, r.url, "ghost"), 3.0, "removal of the worker whose beats stopped")
            assert beat_at and time.monotonic() - beat_at[0] <= ttl_s + 0.25
    finally:
        await client.delete(keys.workers, keys.worker_alive("ghost"))
        await client.aclose()


async def _ghost_and_live(client, keys: Keys, backends, ghost_ttl_ms: int = 1500) -> None:
    """Two workers of experiment `keys`: a-ghost (w0's server; its heartbeat beats once) and b-live (w1)."""
    for worker_id, backend, ttl_ms in (("a-ghost", backends[0], ghost_ttl_ms), ("b-live", backends[1], 30_000)):
        record = {"url": backend.url, "model": "policy", "weight_version": 0, "started_at": time.time()}
        await client.hset(keys.workers, worker_id, json.dumps(record))
        await client.set(keys.worker_alive(worker_id), "1", px=ttl_ms)


async def test_a_request_waiting_on_a_removed_unreachable_worker_is_retried_on_another(rz, backends, http):
    """A killed worker role can leave a server that accepted a request and never answers. When the
    worker's heartbeat expires and its server fails its health check, the router gives the request up
    and retries it elsewhere."""
    keys = Keys("orphans")
    client = rz.async_client()
    try:
        await _ghost_and_live(client, keys, backends)
        async with router(rz, exp="orphans", policy="round_robin") as r:
            await wait_for(lambda: _routable(http, r.url, 2), 3.0, "both workers routable")
            start = time.monotonic()
            # w0 (the ghost's server) accepts and never answers; the live worker answers at once.
            asked = asyncio.gather(
                *(post(http, r.url + "/v1/completions", {"prompt": f"p{i}", "hang_on": ["w0"]}) for i in range(4))
            )
            await asyncio.sleep(0.3)
            await post(http, backends[0].url + "/_control", {"healthy": False})  # its engine died
            answers = await asyncio.wait_for(asked, 10)
            assert [status for status, _, _ in answers] == [200] * 4
            assert {h["X-Worker"] for _, h, _ in answers} == {"w1"}
            assert time.monotonic() - start < 1.5 + 1.0  # within the ghost's TTL, not a timeout
            async with http.get(r.url + "/metrics") as resp:
                assert value(await resp.text(), "slipstream_router_errors_total", **{"class": "worker_gone"}) == 2
    finally:
        await post(http, backends[0].url + "/_control", {"healthy": True})
        await client.delete(keys.workers)
        await client.aclose()


async def test_a_removed_worker_whose_server_still_answers_finishes_its_requests(rz, backends, http):
    """A heartbeat can lapse under load while the server is fine: its requests are not given up."""
    keys = Keys("lapsed")
    client = rz.async_client()
    try:
        await _ghost_and_live(client, keys, backends, ghost_ttl_ms=30_000)
        async with router(rz, exp="lapsed", policy="round_robin") as r:
            await wait_for(lambda: _routable(http, r.url, 2), 3.0, "both workers routable")
            asked = asyncio.gather(
                *(post(http, r.url + "/v1/completions", {"prompt": f"p{i}", "delay_s": 2.5}) for i in range(2))
            )
            await asyncio.sleep(0.3)
            await client.delete(keys.worker_alive("a-ghost"))  # the heartbeat lapses while w0 works
            answers = await asyncio.wait_for(asked, 10)
            assert [status for status, _, _ in answers] == [200] * 2
            assert sorted(h["X-Worker"] for _, h, _ in answers) == ["w0", "w1"]  # w0 answered after removal
            assert "a-ghost" not in await workers_of(http, r.url)
            async with http.get(r.url + "/metrics") as resp:
                assert value(await resp.text(), "slipstream_router_errors_total", **{"class": "worker_gone"}) == 0
    finally:
        await client.delete(keys.workers)
        await client.aclose()


async def _routable(http: aiohttp.ClientSession, url: str, n: int) -> bool:
    return sum(w["healthy"] for w in (await workers_of(http, url)).values()) == n


async def _absent(http: aiohttp.ClientSession, url: str, worker_id: str) -> bool:
    return worker_id not in await workers_of(http, url)


async def test_client_disconnect_cancels_the_upstream_request(rz, backends, http):
    async with router(rz) as r:
        before = sum(s["cancelled"] for s in (await stats(http, backends)).values())
        with pytest.raises(asyncio.TimeoutError):
            await post(
                http, r.url + "/v1/completions", {"prompt": "p", "delay_s": 5}, timeout=aiohttp.ClientTimeout(total=0.3)
            )

        async def cancelled() -> bool:
            return sum(s["cancelled"] for s in (await stats(http, backends)).values()) == before + 1

        await wait_for(cancelled, 2.0, "cancellation of the upstream request")
        async with http.get(r.url + "/metrics") as resp:
            assert value(await resp.text(), "slipstream_router_errors_total", **{"class": "client_disconnect"}) == 1


async def test_a_second_router_of_the_same_name_refuses_naming_the_first(rz, backends):
    async with router(rz, name="solo") as first:
        with pytest.raises(RouterError, match=f"'solo'.*already running at {first.url}"):
            async with router(rz, name="solo"):
                pass
        async with router(rz, name="other") as second:
            assert second.url != first.url
        client = rz.async_client()
        assert await client.get(Keys(EXP).router("solo")) == first.url
    assert await client.get(Keys(EXP).router("solo")) is None  # withdrawn on stop
    await client.aclose()


@pytest.mark.slow  # stopping the router waits out redis-py's reconnect attempts (~3 s)
async def test_routing_goes_on_with_the_last_known_pool_when_redis_is_gone(backends, http, tmp_path):
    private = Rendezvous(tmp_path / "meet", RendezvousConfig())
    private.connect(timeout_s=10)
    keys = Keys("redisgone")
    client = private.async_client()
    try:
        record = {"url": backends[2].url, "model": "policy", "weight_version": 0, "started_at": time.time()}
        await client.hset(keys.workers, "w2", json.dumps(record))
        await client.set(keys.worker_alive("w2"), "1", px=60_000)
        async with router(private, exp="redisgone") as r:
            private.close()  # stops this experiment's redis-server
            await asyncio.sleep(1.2)  # a few failed refreshes
            status, headers, _ = await post(http, r.url + "/v1/completions", {"prompt": "p"})
            assert (status, headers["X-Worker"]) == (200, "w2")
    finally:
        private.close()
        await client.aclose()


async def test_a_router_stopping_with_a_request_no_worker_answers_is_down_within_the_launchers_grace(rz, backends):
    """aiohttp waits up to its shutdown timeout for an in-flight handler, cancels it, and waits up to that long
    again: with a request that no worker answers, the router's stop took twice SHUTDOWN_GRACE_S. It must end
    well inside the launcher's SIGTERM grace (launch.stop_timeout_s / 2 = 5 s by default), or the role is
    reported as having ignored SIGTERM (seen in CI: a worker admitted as the run was torn down)."""
    from router.server import SHUTDOWN_GRACE_S

    async with aiohttp.ClientSession() as session, router(rz) as r:
        body = {"prompt": "p", "hang_on": [b.worker_id for b in backends]}
        request = asyncio.ensure_future(session.post(r.url + "/v1/completions", json=body))
        await asyncio.sleep(0.3)  # the request is in flight at a worker that never answers
        assert not request.done()
        started = time.monotonic()
        await r.stop()
        took = time.monotonic() - started
        with contextlib.suppress(aiohttp.ClientError):
            (await request).release()
    assert took <= 2 * SHUTDOWN_GRACE_S + 0.5 and took < 4.5, f"the router took {took:.1f}s to stop"
