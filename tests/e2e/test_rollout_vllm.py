"""Rollout workers and weight sync against real vLLM (CPU build), end to end: a worker role process
registers and serves through the router; published weights change what it serves and restoring
them reproduces the first outputs exactly; served log-probs equal a transformers forward of the
same weights (fp32, both tiny architectures, before and after a publish); keep-mode pauses carry
in-flight requests across versions, abort-mode pauses return them partial and marked; a version
published as deltas serves bit for bit the log-probs of the same version sent whole; a worker
started late, and its restart after a kill -9 while it loaded a delta, serve the current version (a
delta, rebuilt from its snapshot) before they register; an evicted worker reloads the current
version into its live server and registers again; kill -9 removes a worker within the heartbeat TTL.
One vLLM server per architecture is shared by all tests (conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import psutil
import pytest
import torch
from conftest import MAX_MODEL_LEN, VLLM_CACHE_ENV

from common.config import load_config
from common.net import vllm_session
from common.weights.fleet import evict
from common.weights.index import delta_base
from common.weights.publisher import WeightPublisher
from common.weights.workers import end_cut_update, served_version, weight_lock
from rollout.client import RolloutClient
from rollout.vllm_plugin import watchdog
from tests.support import prom
from tests.support.prom import total

pytestmark = [pytest.mark.slow]

# "<|user|>what is 12+7? solve\n<|assistant|>" in the tiny tokenizer
PROMPT = [5, 90, 80, 91, 80, 8, 9, 17, 14, 84, 80, 97, 81, 6]
LOGPROB_TOL = 1e-4
# Requests this long stay in flight across a publish (the fixture's max_model_len leaves room for the prompt).
LONG = MAX_MODEL_LEN - 64


def model_dir(run) -> Path:
    (path,) = (run.run_dir / "models").glob("*-*")
    return path


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    lp = torch.log_softmax(logits.double(), dim=-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def perturb(model, seed: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Add seeded noise to every checkpoint tensor (router bias included) of the HF model; its state dict.

    Only state-dict tensors: non-persistent buffers (rotary inv_freq) are not weights and not published.
    """
    gen = torch.Generator().manual_seed(seed)
    state = model.state_dict()
    with torch.no_grad():
        for t in state.values():
            if t.is_floating_point():
                t.add_(scale * torch.randn(t.shape, generator=gen))
    return state


def worker_url(run, worker_id: str | None = None) -> str:
    """The URL of `worker_id`, or of the first live worker (a worker killed by an earlier test stays in the
    hash: only a live one's liveness key exists; a worker evicted and registered again moves to its end)."""
    workers = run.workers()
    if worker_id is None:
        worker_id = next((w for w in workers if run.redis.exists(run.keys.worker_alive(w))), None)
        assert worker_id is not None, f"no live worker among {list(workers)}"
    return workers[worker_id]["url"]


def publisher(run, r, pause_mode: str = "keep", snapshot_every: int = 0, backend: str = "file") -> WeightPublisher:
    """The run's publisher; with `snapshot_every` it publishes deltas, one version in that many whole; `backend`:
    rollout.weight_backend."""
    cfg = run.cfg()
    cfg.rollout.pause_mode = pause_mode
    cfg.rollout.weight_backend = backend
    cfg.rollout.weight_delta = snapshot_every > 0
    cfg.rollout.weight_snapshot_every = max(snapshot_every, 1)
    return WeightPublisher(r, run.keys, cfg.rollout, run.run_dir)


def drift(state: dict[str, torch.Tensor], seed: int, lr: float = 1e-3) -> dict[str, torch.Tensor]:
    """A copy of `state` moved as an optimizer step moves it: every float by about `lr`."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: v + lr * torch.randn(v.shape, generator=gen).sign() if v.is_floating_point() else v.clone()
        for k, v in state.items()
    }


async def next_version(run, r) -> int:
    return int(await r.get(run.keys.weights_current) or 0) + 1


async def restore(run, r, pub: WeightPublisher) -> None:
    """Publish the original checkpoint again so later tests see version-0 weights."""
    await pub.publish(await next_version(run, r), hf_model(model_dir(run)).state_dict())


async def check_logprobs_match_hf(client: RolloutClient, model, seed: int) -> float:
    (s,) = await client.generate(PROMPT, max_tokens=48, temperature=1.0, seed=seed, ignore_eos=True)
    ref = hf_logprobs(model, PROMPT, s.token_ids)
    diff = max(abs(a - b) for a, b in zip(ref, s.logprobs, strict=True))
    assert diff < LOGPROB_TOL, f"served log-probs differ from transformers by {diff} nats"
    return diff


async def greedy(client: RolloutClient) -> list[int]:
    (s,) = await client.generate(PROMPT, max_tokens=16, temperature=0.0, ignore_eos=True)
    return s.token_ids


@pytest.mark.timeout(400)
async def test_worker_registers_and_serves_through_the_router_with_logprobs_and_versions(deepseek_run):
    run = deepseek_run
    (entry,) = run.workers().values()
    assert entry["model"] == "policy" and entry["url"].startswith("http://127.0.0.1:")
    listed = await asyncio.to_thread(run.wait_for, "router pool", run.router_workers, None, 10)
    assert [w["url"] for w in listed] == [entry["url"]]
    r = run.rz.async_client()
    async with RolloutClient("policy", redis_client=r, keys=run.keys, token=run.secrets.router) as client:
        samples = await client.generate(PROMPT, n=4, max_tokens=12, seed=1, group="g1", ignore_eos=True)
        current = int(await r.get(run.keys.weights_current) or 0)
    await r.aclose()
    assert len(samples) == 4
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == len(s.versions) == 12
        assert all(lp <= 0.0 for lp in s.logprobs)
        assert set(s.versions) == {current} and s.finish_reason == "length" and not s.aborted
    # The worker's vLLM kept its model inspection in the session's shared cache (rollout.vllm_cache_dir, from
    # the environment tests/conftest.py sets), so the servers started after it skip that subprocess; nothing of
    # it went under the run dir.
    shared = Path(os.environ[VLLM_CACHE_ENV])
    assert list((shared / "modelinfos").glob("*DeepseekV3ForCausalLM.json")), sorted(shared.rglob("*"))
    assert not (run.run_dir / "cache" / "vllm").exists()


# Every route of the run's router and of its worker's vLLM but /health, on loopback: what each answers without
# the run's generated token and with a wrong one (the control routes first: anyone who reaches them could pause
# the worker or replace the policy).
WORKER_ROUTES = [
    ("POST", "/pause"),
    ("POST", "/update_weights"),
    ("POST", "/collective_rpc"),
    ("POST", "/resume"),
    ("POST", "/v1/completions"),
    ("GET", "/metrics"),
]
ROUTER_ROUTES = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/inference/v1/generate"),
    ("GET", "/workers"),
    ("GET", "/metrics"),
]


@pytest.mark.timeout(120)
async def test_without_the_runs_token_the_router_and_the_workers_control_routes_answer_401_on_loopback(deepseek_run):
    run = deepseek_run
    worker, router = worker_url(run), run.router_url()
    assert worker.startswith("http://127.0.0.1:") and router.startswith("http://127.0.0.1:")
    secrets = run.secrets
    async with aiohttp.ClientSession() as http:
        for base, routes, right in ((worker, WORKER_ROUTES, secrets.workers), (router, ROUTER_ROUTES, secrets.router)):
            for method, path in routes:
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {right}x"}):
                    async with http.request(method, base + path, json={}, headers=headers) as resp:
                        assert resp.status == 401, (base, method, path, headers, resp.status, await resp.text())
            async with http.get(f"{base}/health") as resp:
                assert resp.status == 200, base  # liveness probes stay open
        # With the token the same routes answer (the worker's /metrics, the router's /workers and /metrics).
        for url, token in ((f"{worker}/metrics", secrets.workers), (f"{router}/workers", secrets.router)):
            async with http.get(url, headers={"Authorization": f"Bearer {token}"}) as resp:
                assert resp.status == 200, url
        async with http.get(f"{router}/metrics", headers={"Authorization": f"Bearer {secrets.router}"}) as resp:
            page = await resp.text()
    assert resp.status == 200
    # Each refusal is counted (6 routes x 3 attempts here; other tests of the session may add theirs).
    assert prom.value(page, "slipstream_router_errors_total", **{"class": "unauthorized"}) >= 18


@pytest.mark.timeout(120)
async def test_closing_an_update_none_opened_says_so_and_the_next_call_on_the_session_is_answered(deepseek_run):
    """An evicted worker first closes the update a cut-off publisher may have left open. When none is open, vLLM's
    route raises and uvicorn answers 500 and drops the connection: the next call on the same session, had it
    taken that connection from the pool, failed with a reset (seen in test_multihost's partition). Whether the reset
    happens depends on the server's close arriving first, so the test looks at the pool: the connection the 500
    came on is not put back."""
    run = deepseek_run
    url = worker_url(run)
    async with vllm_session(run.secrets.workers) as session:
        before = await served_version(session, url)  # leaves one idle connection in the pool
        assert await end_cut_update(session, url) is False
        idle = session.connector._conns if session.connector is not None else {}  # aiohttp's idle pool, per host
        assert sum(len(conns) for conns in idle.values()) == 0, "the connection answered 500 went back to the pool"
        assert await served_version(session, url) == before


@pytest.mark.timeout(400)
async def test_publish_changes_greedy_output_and_restoring_reproduces_it_exactly_deepseek(deepseek_run):
    run = deepseek_run
    url = worker_url(run)
    r = run.rz.async_client()
    model = hf_model(model_dir(run))
    async with (
        RolloutClient("policy", url=url, token=run.secrets.workers) as client,
        publisher(run, r) as pub,
        run.worker_session() as http,
    ):
        first = await greedy(client)
        (first_sample,) = await client.generate(PROMPT, max_tokens=24, seed=7, ignore_eos=True)
        d0 = await check_logprobs_match_hf(client, model, seed=11)

        version = await next_version(run, r)
        result = await pub.publish(version, perturb(model, seed=version))
        assert not result.evicted and result.version == version
        assert await served_version(http, url) == str(version)
        assert run.workers()[result.workers[0].worker_id]["weight_version"] == version
        assert int(await r.get(run.keys.weights_current)) == version
        changed = await greedy(client)
        assert changed != first
        d1 = await check_logprobs_match_hf(client, model, seed=12)

        await restore(run, r, pub)
        assert await greedy(client) == first
        (again,) = await client.generate(PROMPT, max_tokens=24, seed=7, ignore_eos=True)
        assert again.token_ids == first_sample.token_ids and again.logprobs == first_sample.logprobs
    await r.aclose()
    print(f"deepseek log-prob max |vLLM - HF|: before publish {d0:.2e}, after {d1:.2e}")


@pytest.mark.timeout(400)
async def test_served_logprobs_equal_transformers_before_and_after_a_publish_qwen3(qwen3_run):
    run = qwen3_run
    url = worker_url(run)
    r = run.rz.async_client()
    model = hf_model(model_dir(run))
    async with RolloutClient("policy", url=url, token=run.secrets.workers) as client, publisher(run, r) as pub:
        d0 = await check_logprobs_match_hf(client, model, seed=21)
        first = await greedy(client)
        await pub.publish(await next_version(run, r), perturb(model, seed=3))
        d1 = await check_logprobs_match_hf(client, model, seed=22)
        assert await greedy(client) != first
        await restore(run, r, pub)
    await r.aclose()
    print(f"qwen3 log-prob max |vLLM - HF|: before publish {d0:.2e}, after {d1:.2e}")


async def until_running(run, url: str, n: int, timeout_s: float = 60.0, requests: Sequence[asyncio.Task] = ()) -> None:
    """Wait until vLLM's scheduler runs n requests (an HTTP request may still sit in the router or queue).
    A request task in `requests` that already ended with an error fails the wait at once with that error
    (otherwise it would only surface as "Task exception was never retrieved" after the session ends)."""
    deadline = time.monotonic() + timeout_s
    async with run.worker_session() as http:
        while True:
            for task in requests:
                if task.done() and not task.cancelled() and task.exception() is not None:
                    raise AssertionError(f"an in-flight request failed: {task.exception()!r}") from task.exception()
            async with http.get(f"{url}/metrics") as resp:
                text = await resp.text()
            # vLLM's page, read by Prometheus's own parser (it must parse, as ours do).
            running = total(text, "vllm:num_requests_running")
            assert "vllm:num_requests_running" in text, "vLLM /metrics has no vllm:num_requests_running"
            if running >= n:
                return
            assert time.monotonic() < deadline, f"only {running:g} of {n} requests running after {timeout_s}s"
            await asyncio.sleep(0.05)


async def _in_flight_publish(run, mode: str, max_tokens: int):
    """8 long samples in flight (one request, n = 8), frozen, then a publish in `mode`; (samples, old version,
    new version, the publish's result)."""
    r = run.rz.async_client()
    model = hf_model(model_dir(run))
    async with (
        RolloutClient("policy", redis_client=r, keys=run.keys, token=run.secrets.router) as client,
        publisher(run, r, mode) as pub,
    ):
        old = int(await r.get(run.keys.weights_current) or 0)
        # The new weights are made before the requests start (this took 14-21 s next to the busy engine).
        weights = perturb(model, seed=old + 1)
        # One request of 8 samples: vLLM adds its 8 sequences to the engine together. (8 requests of one sample
        # were seen reaching the engine one, then seven a request's length later, right after a publish, so 8
        # never ran at once.)
        tasks = [asyncio.create_task(client.generate(PROMPT, n=8, max_tokens=max_tokens, seed=1, ignore_eos=True))]
        url = worker_url(run)
        await until_running(run, url, 8, requests=tasks)
        await asyncio.sleep(0.1)  # a few decode steps on the old weights
        # Freeze the requests first: vLLM's engine keeps both cores busy (its worker on one, the engine core's
        # spin-wait on the other), and everything this process does meanwhile was measured 10-80 times slower:
        # a publish took 42 s (writing the 2 MB version 6.5 s of it), longer than the requests (about 28 s),
        # so it found them finished. The publish's own pause (keep or abort) then acts on frozen requests.
        async with run.worker_session() as http, http.post(f"{url}/pause", params={"mode": "keep"}) as resp:
            assert resp.status == 200, await resp.text()
        assert not any(t.done() for t in tasks), "requests finished before the pause; raise max_tokens"
        result = await pub.publish(old + 1, weights)
        (samples,) = await asyncio.gather(*tasks)
        try:
            assert not result.evicted
        finally:
            await restore(run, r, pub)
    await r.aclose()
    return samples, old, old + 1, result


@pytest.mark.timeout(400)
async def test_keep_mode_pause_completes_all_in_flight_requests_across_the_version_switch(deepseek_run):
    samples, old, new, result = await _in_flight_publish(deepseek_run, "keep", max_tokens=LONG)
    assert len(samples) == 8
    for i, s in enumerate(samples):
        assert s.finish_reason == "length" and len(s.token_ids) == LONG
        assert new in s.versions, (
            f"request {i} has no token of version {new}: {[(v, s.versions.count(v)) for v in sorted(set(s.versions))]}"
            f"; all requests: {[sorted(set(x.versions)) for x in samples]}; publish {result}"
        )
        switch = s.versions.index(new)
        assert switch > 0 and s.versions == [old] * switch + [new] * (LONG - switch)
    print(f"keep-mode publish with 8 in flight: pause window {result.max_pause_s * 1e3:.1f} ms")


@pytest.mark.timeout(400)
async def test_abort_mode_pause_returns_partial_results_marked_aborted(deepseek_run):
    samples, old, _, _ = await _in_flight_publish(deepseek_run, "abort", max_tokens=LONG)
    assert len(samples) == 8
    for s in samples:
        assert s.aborted and s.finish_reason == "abort"
        assert 0 < len(s.token_ids) < LONG and len(s.logprobs) == len(s.token_ids)
        assert set(s.versions) == {old}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("backend", ["file", "collective"])
async def test_a_version_published_as_deltas_serves_bit_for_bit_the_log_probs_of_the_same_version_sent_whole(
    deepseek_run, backend
):
    """Deltas through `backend` (collective: the real vLLM server receives every shard through a gloo group from
    this process, and says so in its log), then the same weights as a whole version of the file transport."""
    run = deepseek_run
    url = worker_url(run)
    r = run.rz.async_client()
    state = hf_model(model_dir(run)).state_dict()
    async with (
        RolloutClient("policy", url=url, token=run.secrets.workers) as client,
        publisher(run, r, snapshot_every=3, backend=backend) as deltas,
        publisher(run, r) as whole,
    ):
        for seed in (1, 2, 3):  # a snapshot, then two deltas, each of the version before
            state = drift(state, seed)
            result = await deltas.publish(await next_version(run, r), state)
            assert not result.evicted and result.workers
        version = result.version
        assert delta_base(deltas.root / f"v{version}") == version - 1
        assert delta_base(deltas.root / f"v{version - 1}") == version - 2
        assert delta_base(deltas.root / f"v{version - 2}") is None
        (by_delta,) = await client.generate(PROMPT, max_tokens=24, seed=5, ignore_eos=True)
        sent_whole = await whole.publish(await next_version(run, r), state)
        assert not sent_whole.evicted and delta_base(Path(sent_whole.location)) is None
        (by_whole,) = await client.generate(PROMPT, max_tokens=24, seed=5, ignore_eos=True)
        assert by_delta.token_ids == by_whole.token_ids and by_delta.logprobs == by_whole.logprobs
        if backend == "collective":
            took = f"/.v{version}.{os.getpid()}.tmp: {result.shards} of {result.shards} shard(s) came through the weight groups, 0 from the files"
            for w in result.workers:
                server_log = run.run_dir / "logs" / f"vllm-{w.worker_id}.log"
                # The worker role copies the server's output into its log as it comes.
                await asyncio.to_thread(
                    run.wait_for, f"{took!r} in {server_log}", lambda log=server_log: took in log.read_text(), None, 10
                )
        print(
            f"{backend} delta version {version}: {result.bytes / 1e6:.2f} MB against {sent_whole.bytes / 1e6:.2f} "
            "MB whole"
        )
        await restore(run, r, whole)
    await r.aclose()


async def serves_as_the_others(run, worker_id: str, url: str) -> None:
    """The worker at `url` answers greedily exactly as another live worker of the run."""
    other = worker_url(run, next(w for w in run.workers() if w != worker_id))
    async with (
        RolloutClient("policy", url=url, token=run.secrets.workers) as worker,
        RolloutClient("policy", url=other, token=run.secrets.workers) as first,
    ):
        assert await greedy(worker) == await greedy(first)


async def start_late_worker(run, http, name: str, version: int) -> tuple[subprocess.Popen, str, dict]:
    """Start a worker role and wait until it registers: at that moment it already serves `version` (on the other
    workers' weights); (process, worker id, pool entry)."""
    before = set(run.workers())
    proc = run.start_role("vllm", name)

    def registered():
        return set(run.workers()) - before

    (worker_id,) = await asyncio.to_thread(run.wait_for, f"{name} registration", registered, proc, 300)
    entry = run.workers()[worker_id]
    assert entry["weight_version"] == version
    assert await served_version(http, entry["url"]) == str(version)
    await serves_as_the_others(run, worker_id, entry["url"])
    return proc, worker_id, entry


@pytest.mark.timeout(700)
async def test_late_and_restarted_workers_catch_up_a_delta_version_from_its_snapshot_and_kill9_removes_one(
    deepseek_run,
):
    """Versions published as deltas (the transport's first whole, the rest deltas). A worker started late serves
    the current version, a delta, before it registers: it holds nothing, so it rebuilds the delta's base from the
    snapshot and deltas on disk, every tensor checked. Killed with kill -9 while loading a delta, its restart
    does the same and serves the current version. The restarted worker, evicted as a cut-off publish leaves it,
    reloads into its live server and registers again; kill -9 removes it from the router within the TTL."""
    run = deepseek_run
    r = run.rz.async_client()
    model = hf_model(model_dir(run))
    state = model.state_dict()
    async with publisher(run, r, snapshot_every=100) as pub, run.worker_session() as http:
        published = 0
        while (version := await next_version(run, r)) <= 4 or published < 2:  # this publisher's second is a delta
            await pub.publish(version, state := drift(state, version))
            published += 1
        version -= 1
        assert delta_base(pub.root / f"v{version}") == version - 1  # a delta: the late worker rebuilds its base
        try:
            proc, late_id, entry = await start_late_worker(run, http, "worker-late", version)

            # kill -9 while it loads a delta: the test drives its update (under its weight lock, as a publisher
            # would) and kills the role as the load is sent; the pool then moves on without it.
            async with weight_lock(r, run.keys, late_id):
                for route in ("pause?mode=keep", "start_weight_update"):
                    async with http.post(f"{entry['url']}/{route}") as answer:
                        assert answer.status == 200, await answer.text()
                body = {"update_info": {"path": str(pub.root / f"v{version}")}}
                loading = asyncio.ensure_future(http.post(f"{entry['url']}/update_weights", json=body))
                await asyncio.sleep(0.01)
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                await evict(r, run.keys, late_id, "test: killed with kill -9 while loading a delta")
            with contextlib.suppress(aiohttp.ClientError):
                (await loading).release()
            version = await next_version(run, r)
            result = await pub.publish(version, state := drift(state, version))
            assert not result.evicted and late_id not in {w.worker_id for w in result.workers}
            assert delta_base(pub.root / f"v{version}") == version - 1

            # Its restart: a new worker role, holding nothing, catches up from the snapshot.
            proc, late_id, entry = await start_late_worker(run, http, "worker-restart", version)

            deadline = time.monotonic() + 10
            while late_id not in {w["id"] for w in run.router_workers()}:
                assert time.monotonic() < deadline, "router never picked up the late worker"
                await asyncio.sleep(0.1)
            log = (run.run_dir / "worker-restart.log").read_text()
            vllm_pid = int(re.search(r"started vLLM pid (\d+)", log)[1])

            # Evicted as a publish cut off mid-update leaves it (paused, an update open, out of the pool), while a
            # new version is published without it: it loads that version whole into the same vLLM server, resumes and
            # registers again (a partitioned host rejoining). The test holds the worker's weight lock until the
            # publish is done, so the reload is of the new version, into a paused server.
            for route in ("pause?mode=keep", "start_weight_update"):  # the publish was cut after these
                async with http.post(f"{entry['url']}/{route}") as answer:
                    assert answer.status == 200, await answer.text()
            async with weight_lock(r, run.keys, late_id):
                await evict(r, run.keys, late_id, "test: a weight update cut off mid-way")
                version = await next_version(run, r)
                await pub.publish(version, state := drift(state, version))
            # The registry entry is written before the worker announces and logs its return, so the wait is for
            # both: reading the log as soon as the entry appears raced the log line (CI, 2026-12-07).
            rejoined = await asyncio.to_thread(
                run.wait_for,
                "the evicted late worker registering again",
                lambda: (
                    (run.workers().get(late_id) or {}).get("weight_version") == version
                    and f"registered worker {late_id} again" in (run.run_dir / "worker-restart.log").read_text()
                ),
                proc,
                120,
            )
            assert rejoined and proc.poll() is None
            late_log = (run.run_dir / "worker-restart.log").read_text()
            assert int(re.findall(r"started vLLM pid (\d+)", late_log)[-1]) == (vllm_pid), (
                "the evicted worker restarted vLLM instead of reloading it"
            )
            assert "closed a weight update left open" in late_log
            assert await served_version(http, entry["url"]) == str(version)
            await serves_as_the_others(run, late_id, entry["url"])  # unpaused, on the others' weights
            server = psutil.Process(vllm_pid)
            group = [server, *server.children(recursive=True)]  # API server, engine core, workers

            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            killed = time.monotonic()
            ttl = load_config(run.config).rendezvous.heartbeat_ttl_s
            while late_id in {w["id"] for w in run.router_workers()}:
                assert time.monotonic() - killed < ttl + 1.0, "killed worker still routed after the heartbeat TTL"
                await asyncio.sleep(0.05)
            gone_after = time.monotonic() - killed
            # The orphaned vLLM server dies with its worker (PR_SET_PDEATHSIG, and the plugin's watchdog
            # within watchdog.GRACE_S), its engine processes with it: nothing is left running.
            _, alive = await asyncio.to_thread(psutil.wait_procs, group, watchdog.GRACE_S + 10)
            assert not alive, f"{[(p.pid, p.name()) for p in alive]} outlived their killed worker role"
        finally:
            await restore(run, r, pub)
    await r.aclose()
    print(f"kill -9: worker left the router after {gone_after:.2f}s (TTL {ttl}s)")
