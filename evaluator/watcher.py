"""ROLE=evaluator: evaluate every published policy version (or every Nth) while training runs, each result
carrying the exact version it measured, without ever blocking the trainer. `evaluator.pin` chooses how
exactness is obtained: pin (`PinWatcher`: the evaluator loads each version into its own eval-pool worker,
which neither the router nor the weight publisher sees, and evaluates against it) or verify
(`VerifyWatcher`: evaluate through the router and discard a chunk when the fleet's served version moved);
"auto" decides once at start and logs its choice (`choose_mode`). In both modes the `evals` stream is the
record (a restarted watcher does not repeat a (version, benchmark)), the result cache under `<run
dir>/evals/` lets it finish a half-done version without regenerating, and every result goes to the `evals`
stream {version, benchmark, score, ts}, to DuckDB as `eval/<benchmark>/<metric>` at step = version, and to
the runner's JSON summary and per-case JSONL under `<run dir>/evals/`. Both modes run one loop (`Watcher.run`)
that waits for the next publish, and every other wait for the fleet, on the experiment's streams
(evaluator/fleetview.py: finding the router, choosing the mode, the fleet's version, `StreamWait`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import redis.asyncio

from common.fleet import WorkerError, evict, live_workers, set_worker_version, while_alive
from common.http import RetryPolicy
from common.metrics import MetricsWriter
from common.net import bearer
from common.roles import RunContext, announce
from evaluator.backend import Backend, RequestError
from evaluator.benchmark import Benchmark
from evaluator.cache import ResultCache
from evaluator.fleetview import (
    EvaluatorError,
    FleetProbe,
    FleetSnapshot,
    StreamWait,
    choose_mode,
    entries,
    wait_for_router,
)
from evaluator.runner import PIN_PAUSE_MODE, EvalPlan, EvalResult, Snapshot, VersionMoved, eval_plan, evaluate
from rollout.weights.workers import apply_version, served_version

log = logging.getLogger(__name__)

EVALS_MAXLEN = 100_000
TRANSIENT_PAUSE_S = 2.0
UNSETTLED_LOG_S = 30.0


class Watcher:
    """What both modes share: the benchmarks, the record of what was evaluated, writing results, and the loop
    that steps (`step`: True if it did something, so step again at once) until `finished`, waiting for the
    next publish when a step found nothing to do."""

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
        for _id, fields in entries(await self.client.xrange(self.ctx.keys.evals)):
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
        log.info(
            "version %d %s: %s = %.4f (%d generated, %d from cache)",
            version,
            result.benchmark,
            result.primary,
            result.score,
            result.generated,
            result.cached,
        )

    async def step(self) -> bool:
        """One round: True if it did something (step again at once), False if it waits for the next publish."""
        raise NotImplementedError

    def finished(self) -> bool:
        raise NotImplementedError

    def recover(self, exc: RequestError | WorkerError) -> bool:
        """Whether a step that raised `exc` is tried again after a pause (said in the log): yes for requests
        that kept failing (the server may recover)."""
        if isinstance(exc, RequestError) and exc.transient:
            log.error("evaluation requests keep failing (%s); trying again in %.0fs", exc, TRANSIENT_PAUSE_S)
            return True
        return False

    async def run(self) -> int:
        await self.load_done()
        publishes = await StreamWait(self.client, self.ctx.keys.weights_log).start()
        while True:
            try:
                progressed = await self.step()
            except (RequestError, WorkerError) as exc:
                if not self.recover(exc):
                    raise
                # A back-off: nothing announces that a failing server recovered, so time passing is the point.
                await asyncio.sleep(TRANSIENT_PAUSE_S)
                continue
            if self.finished():
                log.info("evaluated every due version up to evaluator.until_version = %d; done", self.until)
                return 0
            if not progressed:
                await publishes.wait()  # the next publish, or BLOCK_S: step reads the state again either way


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

    def __init__(
        self,
        ctx: RunContext,
        client: redis.asyncio.Redis,
        plan: EvalPlan,
        cache: ResultCache,
        metrics: MetricsWriter,
        backend: Backend,
        probe: FleetProbe,
    ) -> None:
        super().__init__(ctx, client, plan, cache, metrics)
        self.backend, self.probe = backend, probe
        self.served = -1  # the version served during the last step that was not discarded

    async def settled(self) -> FleetSnapshot:
        """The fleet's snapshot once every live worker serves weights:current (a publish may be midway), read
        again on every event: the publish's, a worker registered, deregistered or evicted."""
        events = await StreamWait(self.client, self.ctx.keys.events).start()
        next_log = time.monotonic() + UNSETTLED_LOG_S
        while True:
            snap = await self.probe.read()
            if snap.settled:
                return snap
            if time.monotonic() > next_log:
                log.warning(
                    "no settled fleet for %.0fs: weights:current = %s, workers (id, served) = %s",
                    UNSETTLED_LOG_S,
                    snap.version,
                    snap.detail or "none live",
                )
                next_log = time.monotonic() + UNSETTLED_LOG_S
            await events.wait()

    async def step(self) -> bool:
        """Evaluate the served version if due; True if it moved during the evaluation (read again at once)."""
        snap = await self.settled()
        version = int(snap.version)
        for bench in self.due(version):
            try:
                result = await evaluate(
                    bench,
                    self.backend,
                    self.cache,
                    self.out_dir,
                    self.probe,
                    self.options,
                    self.max_concurrent,
                    self.chunk_cases,
                    expect=snap,
                )
            except VersionMoved as exc:
                log.warning(
                    "%s: version %s stopped being served during the evaluation (now %s); its unfinished "
                    "results are discarded, moving to the newest version",
                    bench.name,
                    exc.expected,
                    exc.seen,
                )
                await announce(
                    self.client,
                    self.ctx.keys,
                    "evaluator",
                    "eval discarded",
                    benchmark=bench.name,
                    version=exc.expected,
                    seen=exc.seen,
                )
                return True
            await self.record(version, result)
        self.served = version
        return False

    def finished(self) -> bool:
        return 0 <= self.until <= self.served and not self.due(self.until)


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

    def __init__(
        self,
        ctx: RunContext,
        client: redis.asyncio.Redis,
        plan: EvalPlan,
        cache: ResultCache,
        metrics: MetricsWriter,
        session: aiohttp.ClientSession,
    ) -> None:
        super().__init__(ctx, client, plan, cache, metrics)
        self.session = session
        self.worker: EvalWorker | None = None
        self.published: dict[int, str] = {}  # version -> location
        self.log_id = "0-0"
        self.pruned: set[int] = set()

    async def read_log(self) -> None:
        """Add the `weights:log` entries published since the last read."""
        keys = self.ctx.keys
        for entry_id, fields in entries(await self.client.xrange(keys.weights_log, min=f"({self.log_id}")):
            self.log_id = entry_id
            if fields["backend"] != "file":
                raise EvaluatorError(
                    f"weight version {fields['version']} was published with backend {fields['backend']!r}; pin mode "
                    "loads file-published versions only. Use rollout.weight_backend = 'file' or evaluator.pin = "
                    "'never'"
                )
            self.published[int(fields["version"])] = fields["location"]

    async def find_worker(self, timeout_s: float = math.inf) -> EvalWorker:
        """The eval worker in use if it is still live, else the first live one, waiting for one to register (up
        to timeout_s: EvaluatorError after it); read again on every event (a worker registered, one gone)."""
        keys = self.ctx.keys
        events = await StreamWait(self.client, keys.events).start()
        next_log = time.monotonic()
        deadline = next_log + timeout_s
        while True:
            live = await live_workers(self.client, keys, keys.eval_workers)
            if self.worker is not None and self.worker.id in live:
                return self.worker
            if self.worker is not None:
                log.warning(
                    "eval worker %s at %s left the eval pool; waiting for a live one", self.worker.id, self.worker.url
                )
                self.worker = None
            if live:
                worker_id = min(live)
                backend = Backend(
                    self.session,
                    live[worker_id],
                    self.ctx.cfg.rollout.served_model_name,
                    self.ctx.cfg.evaluator.request_timeout_s,
                    RetryPolicy(),
                )
                await backend.wait_until_served(self.ctx.cfg.evaluator.router_wait_s)
                await backend.choose_counter()
                self.worker = EvalWorker(worker_id, live[worker_id], backend)
                log.info(
                    "evaluating on eval worker %s at %s%s",
                    worker_id,
                    self.worker.url,
                    f" ({len(live) - 1} other eval worker(s) idle)" if len(live) > 1 else "",
                )
                return self.worker
            if time.monotonic() > deadline:
                raise EvaluatorError(
                    f"no live eval-pool worker in Redis hash {keys.eval_workers} after {timeout_s:.0f}s; start a "
                    "ROLE=vllm worker with rollout.pool = 'eval' (or raise evaluator.router_wait_s, or set "
                    "evaluator.pin = 'never' to evaluate through the router)"
                )
            if time.monotonic() >= next_log:
                log.info(
                    "waiting for a live eval-pool worker (Redis hash %s); start a ROLE=vllm worker with "
                    "rollout.pool = 'eval'",
                    keys.eval_workers,
                )
                next_log = time.monotonic() + UNSETTLED_LOG_S
            await events.wait(deadline - time.monotonic())

    def candidates(self) -> list[int]:
        """Published versions with benchmarks due (up to until_version), newest first."""
        return sorted(
            (v for v in self.published if v not in self.pruned and self.due(v) and (self.until < 0 or v <= self.until)),
            reverse=True,
        )

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
        gone: list[int] = []
        due = self.candidates()
        for version in due:
            if Path(self.published[version]).is_dir():
                if gone:
                    self.log_pruned(gone)
                if version != due[-1]:
                    log.info(
                        "%d due versions not evaluated yet; evaluating the newest, %d, first (older ones "
                        "follow while their files are kept)",
                        len(due) - len(gone),
                        version,
                    )
                return version
            gone.append(version)
            self.pruned.add(version)
        if gone:
            self.log_pruned(gone)
        return None

    def log_pruned(self, versions: list[int]) -> None:
        log.warning(
            "weight version(s) %s were pruned (rollout.keep_versions = %d) before they were evaluated; "
            "skipping them (raise rollout.keep_versions to keep them)",
            sorted(versions),
            self.ctx.cfg.rollout.keep_versions,
        )

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
            await evict(
                self.client,
                keys,
                worker.id,
                f"loading weight version {version}: {exc}{why}",
                registry=keys.eval_workers,
                by="evaluator",
            )
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
                result = await evaluate(
                    bench,
                    worker.backend,
                    self.cache,
                    self.out_dir,
                    worker,
                    self.options,
                    self.max_concurrent,
                    self.chunk_cases,
                    expect=expect,
                )
            except VersionMoved as exc:
                # Only this evaluator loads weights into its worker: something else drives it (a second evaluator?).
                log.error(
                    "%s: eval worker %s changed from version %s to %s during the evaluation, but only this "
                    "evaluator loads it; is another evaluator using it? Discarding the chunk and reloading",
                    bench.name,
                    worker.id,
                    exc.expected,
                    exc.seen,
                )
                await announce(
                    self.client,
                    self.ctx.keys,
                    "evaluator",
                    "eval discarded",
                    benchmark=bench.name,
                    version=exc.expected,
                    seen=exc.seen,
                )
                worker.loaded = None
                return True
            await self.record(version, result)
        return True

    def finished(self) -> bool:
        """until_version is published (or passed) and every due version up to it is evaluated or pruned."""
        return 0 <= self.until <= max(self.published, default=-1) and not self.candidates()

    def recover(self, exc: RequestError | WorkerError) -> bool:
        if isinstance(exc, WorkerError):
            log.error("eval worker stopped answering (%s); looking for a live one", exc)
            self.worker = None
            return True
        return super().recover(exc)

    async def run(self) -> int:
        await self.find_worker(timeout_s=self.ctx.cfg.evaluator.router_wait_s)
        await self.read_log()
        if not self.published:
            log.info(
                "pin mode evaluates published versions only; waiting for the first publish (%s)",
                self.ctx.keys.weights_log,
            )
        return await super().run()


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
                    backend = Backend(
                        session,
                        url,
                        cfg.rollout.served_model_name,
                        ev.request_timeout_s,
                        RetryPolicy(),
                        cfg.router.auth_token,
                    )
                    await backend.wait_until_served(ev.router_wait_s)
                except (EvaluatorError, RequestError) as exc:
                    log.error("%s", exc)
                    return 2
                left = max(0.0, ev.router_wait_s - (time.monotonic() - started))
                mode = "verify" if ev.pin == "never" else await choose_mode(client, ctx.keys, left)
            if mode == "pin":
                log.info(
                    "evaluating %s on an eval-pool worker pinned to each version (every %d version(s))",
                    ", ".join(ev.benchmarks),
                    ev.every_n_versions,
                )
                try:
                    return await PinWatcher(ctx, client, plan, cache, metrics, session).run()
                except EvaluatorError as exc:
                    log.error("%s", exc)
                    return 2
            probe = FleetProbe(client, ctx.keys, session)
            await backend.choose_counter(tokenize_urls=tuple((await live_workers(client, ctx.keys)).values()))
            log.info(
                "evaluating %s through %s (every %d version(s))", ", ".join(ev.benchmarks), url, ev.every_n_versions
            )
            return await VerifyWatcher(ctx, client, plan, cache, metrics, backend, probe).run()
    finally:
        cache.close()
        metrics.close()
        await client.aclose()
