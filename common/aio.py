"""Stopping an asyncio task for good.

On Python 3.11 a task cancelled while it is inside a redis-py command (our clients have socket timeouts) can
lose the CancelledError and run on, "cancelling", for good: in tests/unit/test_task_stop.py's loop about one cancel in
three on this machine, with redis-py 5 to 8 (not on Python 3.12). The cancel is lost in `asyncio.wait_for`,
which redis-py wraps around writing a command when the client has a socket timeout: on 3.11, a cancel that
arrives when the inner write has just finished is dropped and the result returned (CPython gh-86296; 3.12
rewrote wait_for over asyncio.timeout). A trainer rank whose rank watch was lost that way never ended.
Our clients' connections now raise such a cancel again (common/redis_client.CancelKeepingConnection); a stop still
goes through `cancel_and_join`, which cancels again until the task has ended, within a bound, whatever else
(a library, a task's own code) swallows a cancel.
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
