"""ROLE=evaluator: evaluate every published policy version (or every Nth) while training runs, each result
carrying the exact version it measured, without ever blocking the trainer. `evaluator.pin` chooses how
exactness is obtained: pin (`PinWatcher`: the evaluator loads each version into its own eval-pool worker,
which neither the router nor the weight publisher sees, and evaluates against it) or verify
(`VerifyWatcher`: evaluate through the router and discard a chunk when the fleet's served version moved);
"auto" decides once at start and logs its choice (`choose_mode`). In both modes the `evals` stream is the
record (a restarted watcher does not repeat a (version, benchmark)), the result cache under `<run
dir>/evals/` lets it finish a half-done version without regenerating, and every result goes to the `evals`
stream {version, benchmark, score, ts}, to DuckDB as `eval/<benchmark>/<metric>` at step = version, and to
the runner's JSON summary and per-case JSONL under `<run dir>/evals/`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis.asyncio

from common.fleet import WorkerError, current_version, evict, live_workers, set_worker_version, while_alive
from common.http import RetryPolicy
from common.keys import Keys
from common.metrics import MetricsWriter
from common.net import bearer
from common.roles import RunContext, announce
from evaluator.backend import Backend, RequestError
from evaluator.benchmark import Benchmark
from evaluator.cache import ResultCache
from evaluator.runner import PIN_PAUSE_MODE, EvalPlan, EvalResult, Snapshot, VersionMoved, eval_plan, evaluate
from rollout.weights.workers import apply_version, served_version

log = logging.getLogger(__name__)

EVALS_MAXLEN = 100_000
PROBE_TIMEOUT_S = 5.0
WAIT_POLL_S = 0.5
# XREAD BLOCK stays below the Redis client's socket timeout (5 s), so a quiet stream is not an error.
BLOCK_MS = 2000
TRANSIENT_PAUSE_S = 2.0
UNSETTLED_LOG_S = 30.0


class EvaluatorError(RuntimeError):
    """The evaluator cannot run: no router, served model or eval worker within the wait; the message says which."""


@dataclass(frozen=True)
class FleetSnapshot(Snapshot):
    settled: bool = True


class FleetProbe:
    """What the fleet serves: `weights:current` and each live worker's /weight_info."""

    def __init__(self, client: redis.asyncio.Redis, keys: Keys, session: aiohttp.ClientSession) -> None:
        self.client, self.keys, self.session = client, keys, session

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
        version = await current_version(self.client, self.keys)
        current = "0" if version is None else str(version)
        workers = await live_workers(self.client, self.keys)
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


async def starting_workers(client: redis.asyncio.Redis, keys: Keys) -> list[str]:
    """Instances of ROLE=vllm processes that are alive (role liveness key) but registered in neither pool yet."""
    prefix, suffix = keys.role_pattern("vllm").split("*")
    instances = [key[len(prefix) : -len(suffix)] async for key in client.scan_iter(match=keys.role_pattern("vllm"))]
    registered = set(await client.hkeys(keys.workers)) | set(await client.hkeys(keys.eval_workers))
    return sorted(i for i in instances if i not in registered)


async def choose_mode(client: redis.asyncio.Redis, keys: Keys, timeout_s: float) -> str:
    """evaluator.pin = "auto": "pin" if an eval-pool worker is live, "verify" once every started vLLM worker has
    registered in the train pool (or timeout_s has passed with some still starting); the choice is logged."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        # Starting workers first, the eval pool second: a worker that registers between the two reads
        # is then seen in the pool; in the other order it would be seen in neither.
        starting = await starting_workers(client, keys)
        pinned = await live_workers(client, keys, keys.eval_workers)
        if pinned:
            log.info("evaluator.pin = auto: eval-pool worker(s) %s registered; pinning each version on one of them",
                     sorted(pinned))  # fmt: skip
            return "pin"
        if not starting:
            log.info("evaluator.pin = auto: no eval-pool worker (every vLLM worker is in the train pool); verifying "
                     "each version through the router")  # fmt: skip
            return "verify"
        if time.monotonic() > deadline:
            log.warning("evaluator.pin = auto: vLLM worker(s) %s still not registered after %.0fs and no eval-pool "
                        "worker; verifying each version through the router", starting, timeout_s)  # fmt: skip
            return "verify"
        if not logged:
            log.info("evaluator.pin = auto: waiting for starting vLLM worker(s) %s to register (one may be an "
                     "eval-pool worker)", starting)  # fmt: skip
            logged = True
        await asyncio.sleep(WAIT_POLL_S)


class Watcher:
    """What both modes share: the benchmarks, the record of what was evaluated, and writing results."""

    def __init__(
        self,
        ctx: RunContext,
        client: redis.asyncio.Redis,
        plan: EvalPlan,
        cache: ResultCache,
        metrics: MetricsWriter,
    ) -> None:
        self.ctx, self.client = ctx, client
        self.benchmarks, self.cache, self.metrics = plan.benchmarks, cache, metrics
        ev = ctx.cfg.evaluator
        self.every_n, self.until = ev.every_n_versions, ev.until_version
        self.options, self.max_concurrent, self.chunk_cases = plan.options, plan.max_concurrent, plan.chunk_cases
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


class VerifyWatcher(Watcher):
    """Evaluates through the router, keeping only chunks during which the fleet's served version did not move.

    `FleetProbe` snapshots `weights:current` and the /weight_info of every live train worker. An evaluation
    starts only from a settled snapshot (every live worker reports `weights:current`); the runner re-reads the
    snapshot before and after every chunk of requests and keeps the chunk only if both equal the starting one.
    A publish labels a worker with the new version in /finish_weight_update, after its weights changed and
    before its requests resume, and versions only grow; so any weight change on a worker that could have served
    a request of the chunk shows up in the after-snapshot (a changed label, or a worker gone or added), and the
    chunk is discarded. On a discard the watcher skips straight to the newest version and logs what it skipped.
    If one evaluation takes longer than the trainer's publish interval, no version can be measured this way
    (every discard is logged): run an eval-pool worker (pin mode), or evaluate fewer cases.
    """

    def __init__(self, ctx: RunContext, client: redis.asyncio.Redis, plan: EvalPlan, cache: ResultCache,
                 metrics: MetricsWriter, backend: Backend, probe: FleetProbe) -> None:  # fmt: skip
        super().__init__(ctx, client, plan, cache, metrics)
        self.backend, self.probe = backend, probe

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


@dataclass
class EvalWorker:
    """The eval-pool worker the evaluator drives, and the version the evaluator last loaded into it."""

    id: str
    url: str
    backend: Backend
    loaded: int | None = None

    async def read(self) -> Snapshot:
        """The runner's version probe: the worker's /weight_info label (WorkerError if it does not answer)."""
        return Snapshot(str(await served_version(self.backend.session, self.url)), (self.id,))


class PinWatcher(Watcher):
    """Evaluates each version on an eval-pool worker that the evaluator loads with exactly that version.

    The versions are those of `weights:log` (file backend; the newest entry of a version number wins). Each
    step takes the newest version with benchmarks due whose directory still exists (newest first: when the
    evaluator falls behind the trainer, the newest version matters most; older due versions are evaluated
    afterwards while their files are kept), loads it with `apply_version` unless the worker already holds it,
    and evaluates every due benchmark against the worker, with the runner checking its /weight_info before and
    after each chunk. Versions whose directory was pruned first are skipped and logged once. A load that fails
    evicts the eval worker (it exits and is restarted), as the publisher does with train workers; a worker that
    leaves is replaced by the next live one. Nothing is evaluated before the first publish.
    """

    def __init__(self, ctx: RunContext, client: redis.asyncio.Redis, plan: EvalPlan, cache: ResultCache,
                 metrics: MetricsWriter, session: aiohttp.ClientSession) -> None:  # fmt: skip
        super().__init__(ctx, client, plan, cache, metrics)
        self.session = session
        self.worker: EvalWorker | None = None
        self.published: dict[int, str] = {}  # version -> location
        self.log_id = "0-0"
        self.pruned: set[int] = set()

    async def read_log(self) -> None:
        """Add the `weights:log` entries published since the last read."""
        keys = self.ctx.keys
        for entry_id, fields in await self.client.xrange(keys.weights_log, min=f"({self.log_id}"):
            self.log_id = entry_id
            if fields["backend"] != "file":
                raise EvaluatorError(
                    f"weight version {fields['version']} was published with backend {fields['backend']!r}; pin mode "
                    "loads file-published versions only. Use rollout.weight_backend = 'file' or evaluator.pin = "
                    "'never'"
                )
            self.published[int(fields["version"])] = fields["location"]

    async def find_worker(self, timeout_s: float | None = None) -> EvalWorker:
        """The eval worker in use if it is still live, else the first live one, waiting for one to register (up
        to timeout_s if given: EvaluatorError after it)."""
        keys = self.ctx.keys
        started = next_log = time.monotonic()
        while True:
            live = await live_workers(self.client, keys, keys.eval_workers)
            if self.worker is not None and self.worker.id in live:
                return self.worker
            if self.worker is not None:
                log.warning("eval worker %s at %s left the eval pool; waiting for a live one", self.worker.id,
                            self.worker.url)  # fmt: skip
                self.worker = None
            if live:
                worker_id = min(live)
                backend = Backend(self.session, live[worker_id], self.ctx.cfg.rollout.served_model_name,
                                  self.ctx.cfg.evaluator.request_timeout_s, RetryPolicy())  # fmt: skip
                await backend.wait_until_served(self.ctx.cfg.evaluator.router_wait_s)
                await backend.choose_counter()
                self.worker = EvalWorker(worker_id, live[worker_id], backend)
                log.info("evaluating on eval worker %s at %s%s", worker_id, self.worker.url,
                         f" ({len(live) - 1} other eval worker(s) idle)" if len(live) > 1 else "")  # fmt: skip
                return self.worker
            if timeout_s is not None and time.monotonic() - started > timeout_s:
                raise EvaluatorError(
                    f"no live eval-pool worker in Redis hash {keys.eval_workers} after {timeout_s:.0f}s; start a "
                    "ROLE=vllm worker with rollout.pool = 'eval' (or raise evaluator.router_wait_s, or set "
                    "evaluator.pin = 'never' to evaluate through the router)"
                )
            if time.monotonic() >= next_log:
                log.info("waiting for a live eval-pool worker (Redis hash %s); start a ROLE=vllm worker with "
                         "rollout.pool = 'eval'", keys.eval_workers)  # fmt: skip
                next_log = time.monotonic() + UNSETTLED_LOG_S
            await asyncio.sleep(WAIT_POLL_S)

    def candidates(self) -> list[int]:
        """Published versions with benchmarks due (up to until_version), newest first."""
        return sorted((v for v in self.published if v not in self.pruned and self.due(v)
                       and (self.until < 0 or v <= self.until)), reverse=True)  # fmt: skip

    async def pick(self) -> int | None:
        """The newest due version whose files exist; pruned ones are skipped (logged once); None if none."""
        newest = max(self.published, default=None)
        if newest is not None and not Path(self.published[newest]).is_dir():
            await self.read_log()  # a publish may have pruned it right now (keep_versions = 1)
            if max(self.published) == newest:
                raise EvaluatorError(
                    f"the newest weight version {newest} is not at {self.published[newest]} as seen from the "
                    "evaluator; run the evaluator where rollout.weight_dir is visible, or set evaluator.pin = 'never'"
                )
        gone = []
        due = self.candidates()
        for version in due:
            if Path(self.published[version]).is_dir():
                if gone:
                    self.log_pruned(gone)
                if version != due[-1]:
                    log.info("%d due versions not evaluated yet; evaluating the newest, %d, first (older ones "
                             "follow while their files are kept)", len(due) - len(gone), version)  # fmt: skip
                return version
            gone.append(version)
            self.pruned.add(version)
        if gone:
            self.log_pruned(gone)
        return None

    def log_pruned(self, versions: list[int]) -> None:
        log.warning("weight version(s) %s were pruned (rollout.keep_versions = %d) before they were evaluated; "
                    "skipping them (raise rollout.keep_versions to keep them)", sorted(versions),
                    self.ctx.cfg.rollout.keep_versions)  # fmt: skip

    async def load(self, worker: EvalWorker, version: int) -> bool:
        """Load `version` into the worker unless it holds it; False if the load failed (the worker is evicted)."""
        if worker.loaded == version:
            return True
        keys, location = self.ctx.keys, self.published[version]
        try:
            # The publisher's own sequence (pause, start/update/finish with the version, reset prefix cache, resume).
            update = apply_version(self.session, worker.url, version, location, PIN_PAUSE_MODE)
            took = await while_alive(self.client, keys, worker.id, update)
        except WorkerError as exc:
            why = "" if Path(location).is_dir() else f" ({location} was pruned meanwhile)"
            await evict(self.client, keys, worker.id, f"loading weight version {version}: {exc}{why}",
                        registry=keys.eval_workers, by="evaluator")  # fmt: skip
            self.worker = None
            return False
        worker.loaded = version
        await set_worker_version(self.client, keys.eval_workers, worker.id, version)
        log.info("loaded weight version %d into eval worker %s in %.3fs", version, worker.id, took)
        return True

    async def step(self) -> bool:
        """Evaluate one version (the newest due one); False if nothing is due."""
        await self.read_log()
        version = await self.pick()
        if version is None:
            return False
        worker = await self.find_worker()
        if not await self.load(worker, version):
            return True
        expect = Snapshot(str(version), (worker.id,))
        for bench in self.due(version):
            try:
                result = await evaluate(bench, worker.backend, self.cache, self.out_dir, worker, self.options,
                                        self.max_concurrent, self.chunk_cases, expect=expect)  # fmt: skip
            except VersionMoved as exc:
                # Only this evaluator loads weights into its worker: something else drives it (a second evaluator?).
                log.error("%s: eval worker %s changed from version %s to %s during the evaluation, but only this "
                          "evaluator loads it; is another evaluator using it? Discarding the chunk and reloading",
                          bench.name, worker.id, exc.expected, exc.seen)  # fmt: skip
                await announce(self.client, self.ctx.keys, "evaluator", "eval discarded", benchmark=bench.name,
                               version=exc.expected, seen=exc.seen)  # fmt: skip
                worker.loaded = None
                return True
            await self.record(version, result)
        return True

    def finished(self) -> bool:
        """until_version is published (or passed) and every due version up to it is evaluated or pruned."""
        return 0 <= self.until <= max(self.published, default=-1) and not self.candidates()

    async def run(self) -> int:
        await self.load_done()
        await self.find_worker(timeout_s=self.ctx.cfg.evaluator.router_wait_s)
        log_key = self.ctx.keys.weights_log
        waiting_logged = False
        while True:
            try:
                evaluated = await self.step()
            except RequestError as exc:
                if not exc.transient:
                    raise
                log.error("evaluation requests keep failing (%s); trying again in %.0fs", exc, TRANSIENT_PAUSE_S)
                await asyncio.sleep(TRANSIENT_PAUSE_S)
                continue
            except WorkerError as exc:
                log.error("eval worker stopped answering (%s); looking for a live one", exc)
                self.worker = None
                await asyncio.sleep(TRANSIENT_PAUSE_S)
                continue
            if self.finished():
                log.info("evaluated up to version %d (evaluator.until_version = %d); done", self.until, self.until)
                return 0
            if evaluated:
                continue
            if not self.published and not waiting_logged:
                log.info("pin mode evaluates published versions only; waiting for the first publish (%s)", log_key)
                waiting_logged = True
            await self.client.xread({log_key: self.log_id}, block=BLOCK_MS)


async def main(ctx: RunContext) -> int:
    """`ROLE=evaluator slipstream run CFG`: evaluate published versions until cancelled (or until_version)."""
    cfg = ctx.cfg
    ev = cfg.evaluator
    # The same plan `slipstream eval --config` builds, so the command reproduces these scores.
    plan = eval_plan(ev, cfg.rollout.task)
    client = ctx.async_redis()
    metrics = MetricsWriter(ctx.run_dir, ctx.exp, "evaluator", 0)
    cache = ResultCache(ctx.run_dir / "evals" / "cache.jsonl")
    try:
        # Requests to workers carry their key; the router's Backend sends the router's token instead.
        async with aiohttp.ClientSession(headers=bearer(cfg.rollout.api_key)) as session:
            mode = "pin"
            if ev.pin != "always":
                try:
                    started = time.monotonic()
                    url = await wait_for_router(client, ctx.keys, cfg.router.name, ev.router_wait_s)
                    backend = Backend(session, url, cfg.rollout.served_model_name, ev.request_timeout_s,
                                      RetryPolicy(), cfg.router.auth_token)  # fmt: skip
                    await backend.wait_until_served(ev.router_wait_s)
                except (EvaluatorError, RequestError) as exc:
                    log.error("%s", exc)
                    return 2
                left = max(0.0, ev.router_wait_s - (time.monotonic() - started))
                mode = "verify" if ev.pin == "never" else await choose_mode(client, ctx.keys, left)
            if mode == "pin":
                log.info("evaluating %s on an eval-pool worker pinned to each version (every %d version(s))",
                         ", ".join(ev.benchmarks), ev.every_n_versions)  # fmt: skip
                try:
                    return await PinWatcher(ctx, client, plan, cache, metrics, session).run()
                except EvaluatorError as exc:
                    log.error("%s", exc)
                    return 2
            probe = FleetProbe(client, ctx.keys, session)
            await backend.choose_counter(tokenize_urls=tuple((await live_workers(client, ctx.keys)).values()))
            log.info("evaluating %s through %s (every %d version(s))", ", ".join(ev.benchmarks), url,
                     ev.every_n_versions)  # fmt: skip
            return await VerifyWatcher(ctx, client, plan, cache, metrics, backend, probe).run()
    finally:
        cache.close()
        metrics.close()
        await client.aclose()
