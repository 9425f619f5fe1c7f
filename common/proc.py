"""Child processes that cannot outlive their parent.

A role that starts a long-lived server (the rendezvous leader's redis-server, a worker's vLLM)
asks the kernel to send that child SIGTERM when the parent dies, even by SIGKILL, so a crashed
role never leaves a server running. `experiment_processes` finds whatever of a run is still alive
(tests and the chaos benchmark check that nothing is).
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

import psutil

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for subprocess.Popen: SIGTERM this child when its parent thread dies (Linux).

    The kernel ties the signal to the thread that forked, so start such children from a thread
    that lives as long as the process (the main thread or the event loop's).
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def experiment_processes(exp: str) -> list[psutil.Process]:
    """Every live process of an experiment: each role, vLLM's engine and Redis inherit SLIPSTREAM_EXP."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("SLIPSTREAM_EXP") == exp and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found
