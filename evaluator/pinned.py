"""The evaluator's pin mode (`evaluator.pin`): it loads each due version into its own eval-pool worker,
which neither the router nor the weight publisher sees, evaluates against it, and backfills older due
versions after the newest; a worker that stops answering is evicted and another one is found."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from common.http import RetryPolicy
from common.redis_client import entries
from common.weights.fleet import WorkerError, evict, live_workers, set_worker_version, while_alive
from common.weights.versions import FILE_BACKENDS
from common.weights.workers import apply_version, served_version
from evaluator.backend import Backend, RequestError
from evaluator.fleetview import EvaluatorError, StreamWait
from evaluator.runner import (
    PIN_PAUSE_MODE,
    Snapshot,
)
from evaluator.watch_loop import UNSETTLED_LOG_S, Inputs, Watcher

log = logging.getLogger(__name__)


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

    def __init__(self, inputs: Inputs, session: aiohttp.ClientSession) -> None:
        super().__init__(inputs)
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
            if fields["backend"] not in FILE_BACKENDS:
                raise EvaluatorError(
                    f"weight version {fields['version']} was published with backend {fields['backend']!r}; pin mode "
                    "loads versions written as files only. Use rollout.weight_backend = 'file' or 'collective', or "
                    "evaluator.pin = 'never'"
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
        moved = await self.evaluate_due(version, worker.backend, worker, expect)
        if moved is not None:
            # Only this evaluator loads weights into its worker: something else drives it (a second evaluator?).
            bench, exc = moved
            log.error(
                "%s: eval worker %s changed from version %s to %s during the evaluation, but only this "
                "evaluator loads it; is another evaluator using it? Discarding the chunk and reloading",
                bench,
                worker.id,
                exc.expected,
                exc.seen,
            )
            worker.loaded = None
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
