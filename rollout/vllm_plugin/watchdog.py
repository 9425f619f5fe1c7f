"""vLLM dies with its worker role: a watchdog thread in the vLLM server the role started.

The worker role starts vLLM in its own process group with a parent-death SIGTERM, which vLLM answers
with a graceful shutdown. Usually that ends everything within a second; but CI twice found the API
server of a SIGKILLed worker role orphaned and alive 20 to 60 minutes later (the cause was not
reproduced: a shutdown that never finished). The role passes its pid in PARENT_ENV; in the process
whose parent that is (the API server, not vLLM's engine processes), this thread notices the parent's
death and, GRACE_S later, SIGKILLs the whole process group: API server, engine core and workers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)

PARENT_ENV = "SLIPSTREAM_VLLM_PARENT_PID"
POLL_S = 0.5
GRACE_S = 5.0


_started = False


def start() -> bool:
    """Start the watchdog in this process if the worker role that started vLLM is its parent."""
    global _started
    raw = os.environ.get(PARENT_ENV, "")
    if _started or not raw or os.getppid() != int(raw):
        return _started
    _started = True
    threading.Thread(target=_watch, args=(int(raw),), name="slipstream parent watchdog", daemon=True).start()
    return True


def _watch(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    log.warning("worker role pid %d is gone; ending this vLLM server's process group in %.0fs", parent, GRACE_S)
    time.sleep(GRACE_S)
    os.killpg(os.getpgid(0), signal.SIGKILL)
