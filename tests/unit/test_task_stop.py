"""Tasks that poll a real redis-server (through the clients our roles use: socket timeouts, retries) end when
stopped. On Python 3.11 redis-py's write of a command under asyncio.wait_for can drop a cancel (about one stop in
three with a plain client); our clients' connections raise it again (common/redis_client.CancelKeepingConnection),
so one cancel ends the task, and `cancel_and_join` cancels again until it ends, within a bound (common/aio.py)."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.aio import cancel_and_join

STOPS = 60


def poller(r, rng: random.Random):
    async def poll() -> None:  # the shape of the trainer's rank watch and of the heartbeat
        while True:
            await asyncio.sleep(rng.choice([0, 0.001]))
            await r.hgetall("h")
            await r.mget(["a", "b"])

    return poll


async def stop_pollers(r, seed: int, stop) -> None:
    """STOPS pollers on client `r`, each stopped a moment in by `await stop(task, i)`; the client works afterwards."""
    rng = random.Random(seed)
    await r.hset("h", mapping={"0": "x"})
    poll = poller(r, rng)
    for i in range(STOPS):
        task = asyncio.ensure_future(poll())
        await asyncio.sleep(rng.random() * 0.01)
        await stop(task, i)
    assert await r.hget("h", "0") == "x"


@pytest.mark.timeout(120)
async def test_one_cancel_ends_a_polling_task_and_the_client_still_works(redis_client):
    async def one_cancel(task: asyncio.Future, i: int) -> None:
        task.cancel()
        await asyncio.wait({task}, timeout=5.0)
        assert task.cancelled(), f"stop {i}: one cancel did not end the task: {task!r}"

    await stop_pollers(redis_client, 1, one_cancel)


@pytest.mark.timeout(120)
async def test_every_polling_task_ends_when_stopped_and_the_client_still_works(redis_client):
    async def join(task: asyncio.Future, i: int) -> None:
        assert await cancel_and_join(task, 5.0, "the poller"), f"stop {i}: still running: {task!r}"
        assert task.cancelled()

    await stop_pollers(redis_client, 0, join)


@pytest.mark.timeout(60)
async def test_a_task_that_refuses_to_end_is_left_after_the_bound_with_an_error(caplog):
    release = asyncio.Event()

    async def stubborn() -> None:
        while not release.is_set():
            try:
                await asyncio.sleep(0.05)
            except asyncio.CancelledError:
                pass

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    assert not await cancel_and_join(task, 0.5, "the stubborn task")
    assert not task.done() and "the stubborn task did not end within 0s of being cancelled" in caplog.text
    release.set()
    await task
