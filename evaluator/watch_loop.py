"""What both of the evaluator's modes share (evaluator/role.py runs the role): the record of what was
evaluated (the `evals` stream, DuckDB, the per-case files), which versions and benchmarks are due, the
evaluation of one version's due benchmarks, and the one loop (`Watcher.run`) that steps a mode, waits on
the weights log for the next publish, and backs off after a failed step."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import redis.asyncio

from common.metrics import MetricsWriter
from common.redis_client import entries
from common.roles import RunContext, announce
from common.weights.fleet import WorkerError
from evaluator.backend import Backend, RequestError
from evaluator.benchmark import Benchmark
from evaluator.cache import ResultCache
from evaluator.fleetview import StreamWait
from evaluator.runner import (
    EvalPlan,
    EvalResult,
    Snapshot,
    VersionMoved,
    VersionProbe,
    evaluate,
)

log = logging.getLogger(__name__)

EVALS_MAXLEN = 100_000
# The back-off after a failed step: nothing announces that a failing server recovered.
TRANSIENT_PAUSE_S = 2.0
# How often a wait for a settled fleet (or a worker) says it is still waiting.
UNSETTLED_LOG_S = 30.0


@dataclass(frozen=True)
class Inputs:
    """What the role gives either mode: its context and Redis client, the evaluation plan (the same one
    `slipstream eval --config` builds), the result cache and the metrics writer."""

    ctx: RunContext
    client: redis.asyncio.Redis
    plan: EvalPlan
    cache: ResultCache
    metrics: MetricsWriter


class Watcher:
    """What both modes share: the benchmarks, the record of what was evaluated, writing results, and the loop
    that steps (`step`: True if it did something, so step again at once) until `finished`, waiting for the
    next publish when a step found nothing to do."""

    def __init__(self, inputs: Inputs) -> None:
        ctx, plan = inputs.ctx, inputs.plan
        self.ctx, self.client = ctx, inputs.client
        self.benchmarks, self.cache, self.metrics = plan.benchmarks, inputs.cache, inputs.metrics
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

    async def evaluate_due(
        self, version: int, backend: Backend, probe: VersionProbe, expect: Snapshot
    ) -> tuple[str, VersionMoved] | None:
        """Evaluate every due benchmark of `version` and record each result. If the served version moves
        mid-evaluation, the benchmark's unfinished results are discarded (and the discard announced), and
        (benchmark, the VersionMoved) is returned for the mode to say why and what it does next."""
        for bench in self.due(version):
            try:
                result = await evaluate(
                    bench,
                    backend,
                    self.cache,
                    self.out_dir,
                    probe,
                    self.options,
                    self.max_concurrent,
                    self.chunk_cases,
                    expect=expect,
                )
            except VersionMoved as exc:
                await announce(
                    self.client,
                    self.ctx.keys,
                    "evaluator",
                    "eval discarded",
                    benchmark=bench.name,
                    version=exc.expected,
                    seen=exc.seen,
                )
                return bench.name, exc
            await self.record(version, result)
        return None

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
