"""The GenerationController: one uvloop event loop in a daemon thread of the caller's process that runs
generation requests ("items") through a genable (an async callable producing the result of one item,
e.g. a vLLM completion through the router). It owns the global in-flight cap (a slot count checked at
the single place where attempts start, so no more than `max_concurrent` genable calls ever run at
once), completion delivery (a callback per item, a poll queue, or a `generate` iterator in completion
order), per-item timeouts, retries of transient errors (after common/http's RetryPolicy delay: capped,
jittered exponential backoff), a progress bar, and an error budget. Nothing that goes wrong inside the loop kills it or hangs the caller: a failed item is
counted, logged and reported; past the budget, and on any exception from a callback, the error is
raised in the caller's thread at its next `generate`/`poll`/`check`/`close` call.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import functools
import logging
import queue
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import uvloop

from common.config import FlowConfig
from common.http import RetryPolicy
from rollout.outcomes import (
    CallbackError,
    ControllerClosed,
    ControllerStats,
    ErrorBudgetExceeded,
    Outcome,
    is_transient,
)

log = logging.getLogger(__name__)

R = TypeVar("R")

Genable = Callable[[Any], Awaitable[Any]]


@dataclass
class _Job:
    ticket: int
    item: Any
    callback: Callable[[Outcome], None] | None
    attempts: int = 0
    task: asyncio.Task | None = None
    timer: asyncio.TimerHandle | None = None
    cancelled: bool = False
    errors: list[BaseException] = field(default_factory=list)


_WAKE = object()  # put into waiting queues when a fatal error or close() must wake the caller


class GenerationController:
    """Runs items through a genable on a private event loop with at most `max_concurrent` in flight."""

    def __init__(
        self,
        genable: Genable,
        flow: FlowConfig,
        *,
        name: str = "generation",
        on_close: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """A controller with the cap, retries, timeout and error budget of the flow config section.

        `on_close` is awaited on the controller's loop when it closes, after the work in flight stopped: what
        the genable opened on that loop (its HTTP session) is closed there, whichever thread closes the
        controller (a stop on SIGTERM closes it from another thread before the flow's own end does)."""
        if flow.max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {flow.max_concurrent}")
        if flow.max_retries < 0 or flow.retry_backoff_s < 0 or flow.error_budget < 0:
            raise ValueError(
                f"max_retries ({flow.max_retries}), retry_backoff_s ({flow.retry_backoff_s}) and error_budget "
                f"({flow.error_budget}) must be >= 0"
            )
        if flow.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {flow.request_timeout_s}")
        self.genable = genable
        self.max_concurrent = flow.max_concurrent
        self.retry = RetryPolicy(flow.max_retries, flow.retry_backoff_s)
        self.request_timeout_s = flow.request_timeout_s
        self.error_budget = flow.error_budget
        self.name = name
        self._on_close = on_close

        self._stats = ControllerStats()
        self._next_ticket = 0
        self._inbox: collections.deque[_Job] = collections.deque()  # caller threads -> loop
        self._inbox_lock = threading.Lock()
        self._drain_scheduled = False
        self._queue: collections.deque[_Job] = collections.deque()  # loop side: waiting for a slot
        self._jobs: dict[int, _Job] = {}  # loop side: every live job
        self._in_flight = 0
        self._outbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # outcomes of callback-less items
        self._waiters: set[queue.SimpleQueue[Any]] = {self._outbox}
        self._waiters_lock = threading.Lock()
        self._fatal: BaseException | None = None
        self._fatal_raised = False
        self._closed = False
        self._bar: Any = None

        # Made here, run by the thread: callers may schedule onto it as soon as the constructor returns.
        self._loop = uvloop.new_event_loop()
        self._loop.set_exception_handler(self._on_loop_error)
        self._thread = threading.Thread(target=self._thread_main, name=f"{name}-loop", daemon=True)
        self._thread.start()

    # -- caller-thread API ---------------------------------------------------------------------

    def submit(self, item: Any, callback: Callable[[Outcome], None] | None = None) -> int:
        """Queue one item; returns its ticket. The callback runs in the loop thread with the item's
        Outcome (keep it short); without one, the Outcome goes to `poll()`. Thread-safe."""
        self._ensure_open()
        with self._inbox_lock:
            ticket = self._next_ticket
            self._next_ticket += 1
            self._inbox.append(_Job(ticket, item, callback))
            self._stats.submitted += 1
            wake = not self._drain_scheduled
            self._drain_scheduled = True
        if wake:  # one wake-up per burst of submissions, not per item
            self._loop.call_soon_threadsafe(self._drain)
        return ticket

    def cancel(self, ticket: int) -> None:
        """Cancel an item (queued, in flight or waiting to retry); no Outcome is delivered for it."""
        if not self._closed:
            self._loop.call_soon_threadsafe(self._cancel, ticket)

    def generate(self, items: Iterable[Any]) -> Iterator[Outcome]:
        """Submit every item and yield their Outcomes in completion order. Failed items (within the
        error budget) are yielded with `error` set; past the budget the error is raised here.
        Leaving the loop early cancels what is left."""
        results: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.wake_on_error(results)
        tickets = [self.submit(item, results.put) for item in items]
        pending = set(tickets)
        try:
            while pending:
                out = results.get()
                self.check()
                if out is _WAKE:
                    continue
                pending.discard(out.ticket)
                yield out
        finally:
            self._forget_waiter(results)
            for ticket in pending:
                self.cancel(ticket)

    def poll(self, timeout: float | None = None) -> Outcome | None:
        """The next Outcome of an item submitted without a callback, in completion order; None after
        `timeout` seconds. Raises the pending error, if any."""
        self.check()
        try:
            out = self._outbox.get(timeout=timeout)
        except queue.Empty:
            return None
        self.check()
        return None if out is _WAKE else out

    def check(self) -> None:
        """Raise the error that stopped the run (error budget, callback error), or ControllerClosed."""
        if self._fatal is not None:
            self._fatal_raised = True
            raise self._fatal
        self._ensure_open()

    def wake_on_error(self, waiter: queue.SimpleQueue[Any]) -> None:
        """Have a fatal error or close() put a wake-up marker into `waiter`, so a caller blocked on its
        own queue returns and calls `check()`."""
        with self._waiters_lock:
            self._waiters.add(waiter)
        if self._fatal is not None or self._closed:
            waiter.put(_WAKE)

    def call_soon(self, fn: Callable[[], R]) -> concurrent.futures.Future[R]:
        """Run `fn()` in the loop thread; its result (or exception) lands in the returned future. An
        exception is also recorded as fatal, so it is never lost even if nobody waits."""
        self._ensure_open()
        fut: concurrent.futures.Future[R] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except Exception as exc:
                self._set_fatal(CallbackError(f"{fn!r} raised in the {self.name} loop: {exc!r}"), exc)
                fut.set_exception(exc)

        self._loop.call_soon_threadsafe(run)
        return fut

    def run_coroutine(self, coro: Coroutine[Any, Any, R]) -> concurrent.futures.Future[R]:
        """Run a coroutine on the loop (for example closing the genable's HTTP session, which must
        happen on the loop that opened it); its result (or exception) lands in the returned future."""
        self._ensure_open()
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def set_tqdm(self, disabled: bool, total: int | None = None, desc: str = "") -> None:
        """Show (or hide) a progress bar advanced by every finished item."""
        from tqdm.auto import tqdm

        old, self._bar = self._bar, tqdm(total=total, desc=desc or self.name, disable=disabled, dynamic_ncols=True)
        if old is not None:
            old.close()

    def stats(self) -> ControllerStats:
        snap = ControllerStats(**vars(self._stats))
        snap.in_flight = self._in_flight
        return snap

    def close(self, timeout: float = 5.0) -> None:
        """Cancel everything in flight, stop the loop and join its thread (waiting at most `timeout`
        seconds). Raises the pending fatal error if the caller has not seen it yet."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("close() called from the controller's own loop thread; call it from the caller")
        if not self._closed:
            self._closed = True
            fut = asyncio.run_coroutine_threadsafe(self._shutdown(timeout), self._loop)
            try:
                fut.result(timeout + 1.0)
            except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError):
                log.warning("%s controller: in-flight requests did not stop within %.1fs", self.name, timeout)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.warning("%s controller: loop thread still alive after %.1fs; left as a daemon", self.name, timeout)
            self._wake_all()
            if self._bar is not None:
                self._bar.close()
        if self._fatal is not None and not self._fatal_raised:
            self._fatal_raised = True
            raise self._fatal

    def __enter__(self) -> GenerationController:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is None:
            self.close()
        else:  # an error is already propagating: do not mask it with ours
            try:
                self.close()
            except Exception:
                log.exception("%s controller: error while closing after another error", self.name)

    # -- loop thread ---------------------------------------------------------------------------

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _on_loop_error(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        log.error("%s loop: %s", self.name, context.get("message"), exc_info=exc)
        if isinstance(exc, Exception):
            self._set_fatal(CallbackError(f"unexpected error in the {self.name} loop: {exc!r}"), exc)

    def _ensure_open(self) -> None:
        if self._closed:
            raise ControllerClosed(f"{self.name} controller is closed; create a new one to generate again")

    def _drain(self) -> None:
        with self._inbox_lock:
            jobs = list(self._inbox)
            self._inbox.clear()
            self._drain_scheduled = False
        for job in jobs:
            self._jobs[job.ticket] = job
        self._queue.extend(jobs)
        self._pump()

    def _pump(self) -> None:
        """The dispatch point: the only place an attempt starts, and only into a free slot."""
        if self._fatal is not None or self._closed:
            return
        while self._queue and self._in_flight < self.max_concurrent:
            job = self._queue.popleft()
            if job.cancelled:
                continue
            self._in_flight += 1
            if self._in_flight > self._stats.max_in_flight:
                self._stats.max_in_flight = self._in_flight
            job.task = self._loop.create_task(self._attempt(job))
            # Released by the body before it delivers, and here in case the task was cancelled before
            # its first step (then the body never runs).
            job.task.add_done_callback(functools.partial(self._release, job))

    async def _attempt(self, job: _Job) -> None:
        job.attempts += 1
        self._stats.attempts += 1
        try:
            async with asyncio.timeout(self.request_timeout_s):
                result = await self.genable(job.item)
        except asyncio.CancelledError:
            return
        except Exception as exc:
            self._release(job, asyncio.current_task())
            if job.cancelled:
                return
            if isinstance(exc, TimeoutError):
                self._stats.timeouts += 1
                exc = TimeoutError(f"request {job.ticket} took longer than request_timeout_s={self.request_timeout_s}s")
            job.errors.append(exc)
            if is_transient(exc) and job.attempts <= self.retry.max_retries:
                delay = self.retry.delay(job.attempts - 1)
                self._stats.retried += 1
                log.debug("%s: item %d attempt %d: %r; retry in %.2fs", self.name, job.ticket, job.attempts, exc, delay)
                job.timer = self._loop.call_later(delay, self._requeue, job)
            else:
                self._fail(job, exc)
            return
        self._release(job, asyncio.current_task())
        if not job.cancelled:
            self._stats.succeeded += 1
            self._deliver(job, Outcome(job.ticket, job.item, result, None, job.attempts))

    def _release(self, job: _Job, task: asyncio.Task | None) -> None:
        if job.task is None or job.task is not task:  # released already (maybe retried since)
            return
        job.task = None
        self._in_flight -= 1
        self._pump()

    def _requeue(self, job: _Job) -> None:
        job.timer = None
        if not job.cancelled:
            self._queue.appendleft(job)  # it was admitted before anything queued after it
            self._pump()

    def _fail(self, job: _Job, exc: BaseException) -> None:
        self._stats.failed += 1
        log.warning(
            "%s: item %d failed after %d attempt(s): %r (%d/%d of the error budget)",
            self.name,
            job.ticket,
            job.attempts,
            exc,
            self._stats.failed,
            self.error_budget,
        )
        if self._stats.failed > self.error_budget:
            self._set_fatal(
                ErrorBudgetExceeded(
                    f"{self._stats.failed} {self.name} requests failed after retries, more than the error budget "
                    f"of {self.error_budget} (flow.error_budget); last error: {exc!r}. Fix the backend or raise "
                    "flow.error_budget"
                ),
                exc,
            )
        self._deliver(job, Outcome(job.ticket, job.item, None, exc, job.attempts))

    def _deliver(self, job: _Job, outcome: Outcome) -> None:
        self._jobs.pop(job.ticket, None)
        if self._bar is not None:
            self._bar.update(1)
        if job.callback is None:
            self._outbox.put(outcome)
            return
        try:
            job.callback(outcome)
        except Exception as exc:
            self._stats.callback_errors += 1
            log.error("%s: completion callback raised for item %d: %r", self.name, job.ticket, exc)
            self._set_fatal(
                CallbackError(f"completion callback {job.callback!r} raised for item {job.ticket}: {exc!r}"), exc
            )

    def _cancel(self, ticket: int) -> None:
        job = self._jobs.pop(ticket, None)
        if job is None or job.cancelled:
            return
        job.cancelled = True
        self._stats.cancelled += 1
        if job.timer is not None:
            job.timer.cancel()
        if job.task is not None:
            job.task.cancel()  # its slot is released when the task ends

    async def _shutdown(self, timeout: float) -> None:
        self._drain()
        for ticket in list(self._jobs):
            self._cancel(ticket)
        self._queue.clear()
        tasks = [t for t in asyncio.all_tasks(self._loop) if t is not asyncio.current_task()]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
        if self._on_close is not None:
            try:
                await asyncio.wait_for(self._on_close(), timeout)
            except Exception as exc:  # closing must not stop the close; say what was left open
                log.warning("%s controller: closing its genable failed: %r", self.name, exc)

    def _set_fatal(self, error: BaseException, cause: BaseException) -> None:
        if self._fatal is None:
            error.__cause__ = cause
            self._fatal = error
            self._wake_all()

    def _wake_all(self) -> None:
        with self._waiters_lock:
            waiters = list(self._waiters)
        for waiter in waiters:
            waiter.put(_WAKE)

    def _forget_waiter(self, waiter: queue.SimpleQueue[Any]) -> None:
        with self._waiters_lock:
            self._waiters.discard(waiter)
