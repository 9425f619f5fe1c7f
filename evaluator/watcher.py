"""ROLE=evaluator: evaluate every published policy version (or every Nth) while training runs.

The watcher waits for the router's URL in Redis and for a model served behind it (up to
`evaluator.router_wait_s`, then it fails saying what it waited for), then loops: read the version
every live worker serves (`weights:current`, 0 before the first publish), evaluate each configured
benchmark at it if `version % every_n_versions == 0` and it was not evaluated before (the `evals`
stream is the record, so a restarted watcher does not repeat a version, and the result cache under
`<run dir>/evals/` lets it finish a half-done one without regenerating), then block on `weights:log`
for the next publish. It never blocks the trainer: it only reads Redis and sends requests through
the router.

Version-exactness (verify, discard, redo): `FleetProbe` snapshots `weights:current` and the
/weight_info of every live worker in the `workers` hash. An evaluation starts only from a settled
snapshot (every live worker reports `weights:current`). The runner re-reads the snapshot before and
after every chunk of requests and keeps the chunk only if both equal the starting one. A publish
labels a worker with the new version in /finish_weight_update, after its weights changed and before
its requests resume, and versions only grow; so any weight change on a worker that could have served
a request of the chunk shows up in the after-snapshot (a changed label, or a worker gone or added),
and the chunk is discarded. On a discard the watcher skips straight to the newest version (older
ones are no longer served anywhere) and logs what it skipped. If one version's evaluation takes
longer than the trainer's publish interval, no version can be measured exactly; every discard is
logged, so this is visible (add workers, or evaluate fewer cases with `evaluator.limit`).

Results: one `evals` stream entry {version, benchmark, score, ts} per benchmark and version, DuckDB
metrics `eval/<benchmark>/<metric>` at step = version, and the runner's JSON summary and per-case
JSONL under `<run dir>/evals/`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp
import redis.asyncio

from common.keys import Keys
from common.metrics import MetricsWriter
from common.roles import RunContext, announce
from evaluator.backend import Backend, RequestError, RetryPolicy
from evaluator.benchmark import Benchmark, EvalOptions, load_benchmark
from evaluator.cache import ResultCache
from evaluator.runner import EvalResult, Snapshot, VersionMoved, evaluate

log = logging.getLogger(__name__)

EVALS_MAXLEN = 100_000
PROBE_TIMEOUT_S = 5.0
WAIT_POLL_S = 0.5
# XREAD BLOCK stays below the Redis client's socket timeout (5 s), so a quiet stream is not an error.
BLOCK_MS = 2000
TRANSIENT_PAUSE_S = 2.0
UNSETTLED_LOG_S = 30.0


class EvaluatorError(RuntimeError):
    """The evaluator cannot run: no router or no served model within the wait; the message says which."""


@dataclass(frozen=True)
class FleetSnapshot(Snapshot):
    settled: bool = True


class FleetProbe:
    """What the fleet serves: `weights:current` and each live worker's /weight_info."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, session: aiohttp.ClientSession) -> None:
        self.client, self.keys, self.session = client, keys, session

    async def live_workers(self) -> dict[str, str]:
        """worker_id -> URL of the workers in the `workers` hash whose liveness key exists."""
        entries = await self.client.hgetall(self.keys.workers)
        if not entries:
            return {}
        ids = sorted(entries)
        alive = await self.client.mget([self.keys.worker_alive(i) for i in ids])
        return {i: json.loads(entries[i])["url"] for i, a in zip(ids, alive, strict=True) if a is not None}

    async def _served(self, url: str) -> str:
        try:
            async with self.session.get(
                url.rstrip("/") + "/weight_info", timeout=aiohttp.ClientTimeout(total=PROBE_TIMEOUT_S)
            ) as r:
                if r.status != 200:
                    return f"unreadable (HTTP {r.status})"
                return str((await r.json())["weight_version"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as exc:
            return f"unreadable ({type(exc).__name__})"

    async def read(self) -> FleetSnapshot:
        raw = await self.client.get(self.keys.weights_current)
        current = "0" if raw is None else str(int(raw))
        workers = await self.live_workers()
        served = await asyncio.gather(*(self._served(url) for url in workers.values()))
        detail = tuple(zip(workers, served, strict=True))
        settled = bool(detail) and all(v == current for v in served)
        return FleetSnapshot(current, detail, settled)


async def wait_for_router(client: redis.asyncio.Redis, keys: Keys, name: str, timeout_s: float) -> str:
    """The router's URL from Redis, waiting up to timeout_s for it to appear."""
    deadline = time.monotonic() + timeout_s
    key = keys.router(name)
    logged = False
    while True:
        url = await client.get(key)
        if url:
            return url
        if time.monotonic() > deadline:
            raise EvaluatorError(
                f"no router {name!r} registered under Redis key {key} after {timeout_s:.0f}s; start the router role "
                "(or raise evaluator.router_wait_s)"
            )
        if not logged:
            log.info("waiting for router %r (Redis key %s, up to %.0fs)", name, key, timeout_s)
            logged = True
        await asyncio.sleep(WAIT_POLL_S)


class Watcher:
    """The evaluation loop of one experiment (see the module docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        client: redis.asyncio.Redis,
        backend: Backend,
        probe: FleetProbe,
        benchmarks: list[Benchmark],
        cache: ResultCache,
        metrics: MetricsWriter,
    ) -> None:
        self.ctx, self.client, self.backend, self.probe = ctx, client, backend, probe
        self.benchmarks, self.cache, self.metrics = benchmarks, cache, metrics
        ev = ctx.cfg.evaluator
        self.every_n, self.until = ev.every_n_versions, ev.until_version
        self.options = EvalOptions(limit=ev.limit or None, max_tokens=ev.max_tokens or None)
        self.max_concurrent, self.chunk_cases = ev.max_concurrent, ev.chunk_cases
        self.out_dir = ctx.run_dir / "evals"
        self.done: set[tuple[int, str]] = set()

    async def load_done(self) -> None:
        """(version, benchmark) pairs already in the evals stream (a restarted watcher skips them)."""
        for _id, fields in await self.client.xrange(self.ctx.keys.evals):
            self.done.add((int(fields["version"]), fields["benchmark"]))
        if self.done:
            log.info("resuming: %d (version, benchmark) results already recorded", len(self.done))

    def due(self, version: int) -> list[Benchmark]:
        if version % self.every_n:
            return []
        return [b for b in self.benchmarks if (version, b.name) not in self.done]

    async def record(self, version: int, result: EvalResult) -> None:
        keys = self.ctx.keys
        await self.client.xadd(
            keys.evals,
            {
                "version": version,
                "benchmark": result.benchmark,
                "score": repr(result.score),
                "ts": f"{time.time():.3f}",
            },
            maxlen=EVALS_MAXLEN,
            approximate=True,
        )
        self.metrics.log_many(version, {f"eval/{result.benchmark}/{k}": v for k, v in result.metrics.items()})
        self.metrics.flush()
        self.done.add((version, result.benchmark))
        log.info("version %d %s: %s = %.4f (%d generated, %d from cache)", version, result.benchmark,
                 result.primary, result.score, result.generated, result.cached)  # fmt: skip

    async def settled(self) -> FleetSnapshot:
        """The fleet's snapshot once every live worker serves weights:current (a publish may be midway)."""
        next_log = time.monotonic() + UNSETTLED_LOG_S
        while True:
            snap = await self.probe.read()
            if snap.settled:
                return snap
            if time.monotonic() > next_log:
                log.warning("no settled fleet for %.0fs: weights:current = %s, workers (id, served) = %s",
                            UNSETTLED_LOG_S, snap.version, snap.detail or "none live")  # fmt: skip
                next_log = time.monotonic() + UNSETTLED_LOG_S
            await asyncio.sleep(WAIT_POLL_S)

    async def step(self) -> int | None:
        """Evaluate the served version if due; the version now served (evaluated or not)."""
        snap = await self.settled()
        version = int(snap.version)
        for bench in self.due(version):
            try:
                result = await evaluate(bench, self.backend, self.cache, self.out_dir, self.probe, self.options,
                                        self.max_concurrent, self.chunk_cases, expect=snap)  # fmt: skip
            except VersionMoved as exc:
                log.warning("%s: version %s stopped being served during the evaluation (now %s); its unfinished "
                            "results are discarded, moving to the newest version", bench.name, exc.expected,
                            exc.seen)  # fmt: skip
                await announce(self.client, self.ctx.keys, "evaluator", "eval discarded", benchmark=bench.name,
                               version=exc.expected, seen=exc.seen)  # fmt: skip
                return None
            await self.record(version, result)
        return version

    async def run(self) -> int:
        await self.load_done()
        log_key = self.ctx.keys.weights_log
        last_id = "0-0"
        while True:
            newest = await self.client.xrevrange(log_key, count=1)
            if newest:
                last_id = newest[0][0]
            try:
                version = await self.step()
            except RequestError as exc:
                if not exc.transient:
                    raise
                log.error("evaluation requests keep failing (%s); trying again in %.0fs", exc, TRANSIENT_PAUSE_S)
                await asyncio.sleep(TRANSIENT_PAUSE_S)
                continue
            if version is None:
                continue  # moved during an evaluation: re-read at once
            if 0 <= self.until <= version and not self.due(self.until):
                log.info("evaluated up to version %d (evaluator.until_version = %d); done", version, self.until)
                return 0
            # Wake on the next publish; the timeout re-checks in case a worker was still settling.
            await self.client.xread({log_key: last_id}, block=BLOCK_MS)


async def _served_model(backend: Backend, timeout_s: float) -> None:
    """Wait until the router answers /v1/models (it needs a healthy worker behind it)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await backend.describe()
            return
        except RequestError as exc:
            if not exc.transient or time.monotonic() > deadline:
                raise EvaluatorError(f"no model served behind the router at {backend.url}: {exc}") from None
            log.info("waiting for a worker behind the router at %s", backend.url)


async def main(ctx: RunContext) -> int:
    """`ROLE=evaluator slipstream run CFG`: evaluate published versions until cancelled (or until_version)."""
    cfg = ctx.cfg
    ev = cfg.evaluator
    benchmarks = [load_benchmark(name, ev.data_root, cfg.rollout.task) for name in ev.benchmarks]
    client = ctx.async_redis()
    metrics = MetricsWriter(ctx.run_dir, ctx.exp, "evaluator", 0)
    cache = ResultCache(ctx.run_dir / "evals" / "cache.jsonl")
    try:
        async with aiohttp.ClientSession() as session:
            try:
                url = await wait_for_router(client, ctx.keys, cfg.router.name, ev.router_wait_s)
                backend = Backend(session, url, cfg.rollout.served_model_name, ev.request_timeout_s, RetryPolicy(),
                                  cfg.router.auth_token)  # fmt: skip
                await _served_model(backend, ev.router_wait_s)
            except EvaluatorError as exc:
                log.error("%s", exc)
                return 2
            probe = FleetProbe(client, ctx.keys, session)
            await backend.choose_counter(tokenize_urls=tuple((await probe.live_workers()).values()))
            log.info("evaluating %s through %s (every %d version(s))", ", ".join(ev.benchmarks), url,
                     ev.every_n_versions)  # fmt: skip
            return await Watcher(ctx, client, backend, probe, benchmarks, cache, metrics).run()
    finally:
        cache.close()
        metrics.close()
        await client.aclose()
