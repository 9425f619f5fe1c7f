"""GenerationController against fake async backends: the cap, completion order, retries, timeouts,
the error budget, raising callbacks and shutdown. Every test that involves a fault has a timeout guard."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from common.config import FlowConfig
from rollout.controller import GenerationController
from rollout.outcomes import CallbackError, ControllerClosed, ErrorBudgetExceeded, TransientError, is_transient


class Backend:
    """A fake async backend that records how many calls run at once."""

    def __init__(self, latency=lambda item: 0.0):
        self.latency = latency
        self.running = 0
        self.max_running = 0
        self.calls: dict = {}
        self.cancelled = 0

    async def __call__(self, item):
        self.calls[item] = self.calls.get(item, 0) + 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.latency(item))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        return item * 10


@pytest.mark.timeout(20)
def test_in_flight_never_exceeds_the_cap_and_the_cap_is_used():
    backend = Backend(latency=lambda i: 0.001 * (i % 5))
    with GenerationController(backend, FlowConfig(max_concurrent=7)) as ctl:
        outs = list(ctl.generate(range(300)))
        stats = ctl.stats()
    assert sorted(o.result for o in outs) == [i * 10 for i in range(300)]
    assert backend.max_running == 7
    assert stats.max_in_flight == 7 and stats.succeeded == 300 and stats.in_flight == 0


@pytest.mark.timeout(20)
def test_generate_yields_in_completion_order():
    delays = {0: 0.15, 1: 0.01, 2: 0.08}
    with GenerationController(Backend(latency=delays.__getitem__), FlowConfig(max_concurrent=3)) as ctl:
        assert [o.item for o in ctl.generate([0, 1, 2])] == [1, 2, 0]


@pytest.mark.timeout(20)
def test_submit_callbacks_run_in_the_loop_thread_and_poll_gets_callbackless_outcomes():
    seen = []
    done = threading.Event()
    with GenerationController(Backend(), FlowConfig(max_concurrent=2), name="gen") as ctl:

        def callback(out):
            seen.append((out.item, out.result, threading.current_thread().name))
            done.set()

        ctl.submit(4, callback)
        ctl.submit(5)
        assert done.wait(5)
        out = ctl.poll(timeout=5)
    assert seen == [(4, 40, "gen-loop")]
    assert out.ok and out.item == 5 and out.result == 50 and out.attempts == 1


@pytest.mark.timeout(20)
def test_transient_errors_are_retried_with_exponential_backoff():
    failures = {"n": 0}

    async def flaky(item):
        if failures["n"] < 2:
            failures["n"] += 1
            raise TransientError("overloaded")
        return "ok"

    t0 = time.monotonic()
    with GenerationController(flaky, FlowConfig(max_retries=3, retry_backoff_s=0.05)) as ctl:
        (out,) = list(ctl.generate(["x"]))
        stats = ctl.stats()
    elapsed = time.monotonic() - t0
    assert out.ok and out.result == "ok" and out.attempts == 3
    assert stats.retried == 2 and stats.failed == 0
    assert elapsed >= (0.05 + 0.10) / 2  # waited 0.05 s then 0.10 s, each scaled by a jitter in [0.5, 1)


@pytest.mark.timeout(20)
def test_a_non_transient_error_is_not_retried_and_is_reported_within_the_budget():
    async def broken(item):
        raise ValueError(f"bad prompt {item}")

    with GenerationController(broken, FlowConfig(max_retries=3, error_budget=5)) as ctl:
        outs = list(ctl.generate([1, 2]))
        stats = ctl.stats()
    assert [type(o.error) for o in outs] == [ValueError, ValueError]
    assert all(o.attempts == 1 for o in outs)
    assert stats.failed == 2 and stats.retried == 0


@pytest.mark.timeout(20)
def test_a_genable_that_raises_synchronously_does_not_kill_the_loop():
    def not_async(item):
        raise KeyError(item)

    with GenerationController(not_async, FlowConfig(error_budget=10)) as ctl:
        (out,) = list(ctl.generate([3]))
        assert isinstance(out.error, KeyError)
        ctl.genable = Backend()
        assert [o.result for o in ctl.generate([3])] == [30]


@pytest.mark.timeout(20)
def test_past_the_error_budget_the_error_is_raised_in_the_callers_thread():
    async def broken(item):
        raise ValueError("backend is down")

    ctl = GenerationController(broken, FlowConfig(error_budget=2))
    with pytest.raises(ErrorBudgetExceeded, match="error budget of 2") as info:
        list(ctl.generate(range(10)))
    assert isinstance(info.value.__cause__, ValueError)
    ctl.close()  # the caller saw the error already: close does not raise it again


@pytest.mark.timeout(20)
def test_a_genable_that_hangs_past_its_timeout_is_retried_then_reported():
    backend = Backend(latency=lambda item: 3600.0)
    t0 = time.monotonic()
    with GenerationController(backend, FlowConfig(request_timeout_s=0.05, max_retries=2, retry_backoff_s=0.01)) as ctl:
        (out,) = list(ctl.generate(["slow"]))
        stats = ctl.stats()
    assert isinstance(out.error, TimeoutError) and "request_timeout_s=0.05" in str(out.error)
    assert out.attempts == 3 and stats.timeouts == 3
    assert backend.cancelled == 3  # each hung attempt was cancelled, not leaked
    assert time.monotonic() - t0 < 2.0


@pytest.mark.timeout(20)
def test_a_raising_callback_is_raised_in_the_caller_and_close_does_not_hang():
    def callback(out):
        raise RuntimeError("bug in the consumer")

    ctl = GenerationController(Backend(), FlowConfig(max_concurrent=2))
    ctl.submit(1, callback)
    with pytest.raises(CallbackError, match="bug in the consumer"):
        ctl.poll(timeout=5)  # woken by the error, not by the timeout
    assert ctl.stats().callback_errors == 1
    ctl.close(timeout=1.0)
    assert not ctl._thread.is_alive()


@pytest.mark.timeout(20)
def test_an_unseen_fatal_error_is_raised_by_close():
    def callback(out):
        raise RuntimeError("unseen")

    ctl = GenerationController(Backend(), FlowConfig())
    done = threading.Event()
    ctl.submit(1, callback)
    ctl.submit(2, lambda out: done.set())
    done.wait(5)
    with pytest.raises(CallbackError):
        ctl.close()


@pytest.mark.timeout(20)
def test_close_cancels_in_flight_requests_and_joins_quickly():
    backend = Backend(latency=lambda item: 3600.0)
    ctl = GenerationController(backend, FlowConfig(max_concurrent=4))
    for i in range(10):
        ctl.submit(i)
    while backend.running < 4:
        time.sleep(0.01)
    t0 = time.monotonic()
    ctl.close(timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    assert backend.cancelled == 4 and not ctl._thread.is_alive()
    with pytest.raises(ControllerClosed):
        ctl.submit(99)


@pytest.mark.timeout(20)
def test_cancel_removes_an_item_and_frees_its_slot():
    backend = Backend(latency=lambda item: 3600.0 if item == "hang" else 0.0)
    with GenerationController(backend, FlowConfig(max_concurrent=1)) as ctl:
        ticket = ctl.submit("hang")
        ctl.submit("quick")
        ctl.cancel(ticket)
        out = ctl.poll(timeout=5)
    assert out.item == "quick"  # the cancelled item delivered nothing and gave its slot away


@pytest.mark.timeout(20)
def test_leaving_generate_early_cancels_the_rest():
    backend = Backend(latency=lambda item: 0.0 if item == 0 else 3600.0)
    with GenerationController(backend, FlowConfig(max_concurrent=4)) as ctl:
        for out in ctl.generate(range(4)):
            assert out.item == 0
            break
        deadline = time.monotonic() + 5
        while ctl.stats().in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ctl.stats().in_flight == 0 and ctl.stats().cancelled == 3


@pytest.mark.timeout(20)
def test_call_soon_runs_in_the_loop_and_its_errors_are_fatal():
    with GenerationController(Backend(), FlowConfig(), name="gen") as ctl:
        assert ctl.call_soon(lambda: threading.current_thread().name).result(5) == "gen-loop"
        fut = ctl.call_soon(lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            fut.result(5)
        with pytest.raises(CallbackError):
            ctl.check()


def test_transient_classification():
    assert is_transient(TransientError()) and is_transient(TimeoutError()) and is_transient(ConnectionResetError())

    class Marked(Exception):
        transient = True

    assert is_transient(Marked()) and not is_transient(ValueError())


@pytest.mark.timeout(20)
def test_the_controller_takes_the_flow_sections_knobs_and_tqdm_counts_items():
    cfg = FlowConfig(max_concurrent=3, max_retries=1, retry_backoff_s=0.2, request_timeout_s=9.0, error_budget=4)
    with GenerationController(Backend(), cfg) as ctl:
        assert (ctl.max_concurrent, ctl.retry.max_retries, ctl.retry.backoff_s) == (3, 1, 0.2)
        assert (ctl.request_timeout_s, ctl.error_budget) == (9.0, 4)
        ctl.set_tqdm(disabled=False, total=5, desc="gen")
        list(ctl.generate(range(5)))
        assert ctl._bar.n == 5


class SessionBackend:
    """A genable holding an aiohttp session opened on the controller's loop (as SampleGenerator does)."""

    def __init__(self):
        self.session = None
        self.closed_on: str | None = None

    async def __call__(self, item):
        import aiohttp

        if self.session is None:
            self.session = aiohttp.ClientSession()
        await asyncio.sleep(30)  # in flight when the controller closes
        return item

    async def close(self):
        await self.session.close()
        self.closed_on = threading.current_thread().name


@pytest.mark.timeout(20)
def test_closing_from_another_thread_closes_the_genables_session_on_the_controllers_loop():
    """A stop (SIGTERM) closes the controller from another thread while a request is in flight: `on_close` runs
    on the controller's loop after the request was cancelled, so the session opened there is closed there."""
    backend = SessionBackend()
    ctl = GenerationController(backend, FlowConfig(), name="gen", on_close=backend.close)
    ctl.submit(1)
    deadline = time.monotonic() + 5
    while backend.session is None:
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)
    closer = threading.Thread(target=ctl.close, name="stopper")
    closer.start()
    closer.join(10)
    assert backend.session.closed and backend.closed_on == "gen-loop"
