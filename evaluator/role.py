"""ROLE=evaluator: evaluate every published policy version (or every Nth) while training runs, each result
tied to the exact version it measured, without ever blocking the trainer.

`evaluator.pin` chooses how exactness is had: pin (`PinWatcher`: each version is loaded into the evaluator's
own eval-pool worker, which neither the router nor the publisher sees) or verify (`VerifyWatcher`: evaluate
through the router and discard a chunk during which the fleet's served version moved); "auto" decides once
at start (`choose_mode`). The `evals` stream is the record, so a restarted evaluator repeats no (version,
benchmark), and the result cache under `<run dir>/evals/` lets it finish a half-done version without
regenerating. Results go to `evals`, to DuckDB as `eval/<benchmark>/<metric>` at step = version, and to the
runner's files under `<run dir>/evals/`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from common.http import RetryPolicy
from common.metric_sinks import open_metrics
from common.net import vllm_session
from common.roles import RunContext
from common.weights.fleet import live_workers
from evaluator.backend import Backend, RequestError
from evaluator.cache import ResultCache
from evaluator.fleetview import (
    EvaluatorError,
    FleetProbe,
    FleetSnapshot,
    StreamWait,
    choose_mode,
    wait_for_router,
)
from evaluator.pinned import PinWatcher
from evaluator.runner import eval_plan, follows_chat_template
from evaluator.watch_loop import UNSETTLED_LOG_S, Inputs, Watcher

log = logging.getLogger(__name__)


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

    def __init__(self, inputs: Inputs, backend: Backend, probe: FleetProbe) -> None:
        super().__init__(inputs)
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
        moved = await self.evaluate_due(version, self.backend, self.probe, snap)
        if moved is not None:
            bench, exc = moved
            log.warning(
                "%s: version %s stopped being served during the evaluation (now %s); its unfinished "
                "results are discarded, moving to the newest version",
                bench,
                exc.expected,
                exc.seen,
            )
            return True
        self.served = version
        return False

    def finished(self) -> bool:
        return 0 <= self.until <= self.served and not self.due(self.until)


async def main(ctx: RunContext) -> int:
    """`ROLE=evaluator slipstream run CFG`: evaluate published versions until cancelled (or until_version)."""
    cfg = ctx.cfg
    ev = cfg.evaluator
    # The same plan `slipstream eval --config` builds, so the command reproduces these scores.
    chat = await asyncio.to_thread(follows_chat_template, cfg, ctx.run_dir)
    plan = eval_plan(ev, cfg.rollout.task, chat, cfg.rollout.episode)
    client = ctx.async_redis()
    metrics = open_metrics(cfg, ctx.run_dir, ctx.exp, "evaluator", 0)
    cache = ResultCache(ctx.run_dir / "evals" / "cache.jsonl")
    inputs = Inputs(ctx, client, plan, cache, metrics)
    try:
        # Requests to workers carry their key; the router's Backend sends the router's token instead.
        async with vllm_session(cfg.rollout.api_key) as session:
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
                    return await PinWatcher(inputs, session).run()
                except EvaluatorError as exc:
                    log.error("%s", exc)
                    return 2
            probe = FleetProbe(client, ctx.keys, session)
            await backend.choose_counter(tokenize_urls=tuple((await live_workers(client, ctx.keys)).values()))
            log.info(
                "evaluating %s through %s (every %d version(s))", ", ".join(ev.benchmarks), url, ev.every_n_versions
            )
            return await VerifyWatcher(inputs, backend, probe).run()
    finally:
        cache.close()
        metrics.close()
        await client.aclose()
