"""Stopping an asyncio task for good: `cancel_and_join` cancels again until the task has ended, within a bound.

A single cancel is not enough on Python 3.11: `asyncio.wait_for`, which redis-py wraps around writing a
command when the client has a socket timeout, drops a cancel that arrives just as the write finishes
(CPython gh-86296; 3.12 rewrote wait_for), and the task runs on, "cancelling", for good. Our Redis clients'
connections raise such a cancel again (`CancelKeepingConnection`), and every stop still goes through here,
whatever else (a library, a task's own code) swallows a cancel.
"""

from __future__ import annotations

import asyncio
import logging

log = logging.getLogger(__name__)

# How long a cancelled task gets before it is cancelled again.
RECANCEL_S = 0.1


async def cancel_and_join(task: asyncio.Future, timeout_s: float, what: str) -> bool:
    """Cancel `task` and wait until it has ended, cancelling it again every RECANCEL_S while it runs on; False
    (logged, the task left running) if it still runs after `timeout_s`. The task's own result or error is not
    raised (its error is retrieved); a cancel of the caller while it waits propagates."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not task.done():
        remaining = deadline - loop.time()
        if remaining <= 0:
            log.error("%s did not end within %.0fs of being cancelled; left running", what, timeout_s)
            return False
        task.cancel()
        await asyncio.wait({task}, timeout=min(RECANCEL_S, remaining))
    if not task.cancelled():
        task.exception()
    return True
