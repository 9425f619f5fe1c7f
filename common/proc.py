"""Child processes that cannot outlive their parent.

A role that starts a long-lived server (the rendezvous leader's redis-server, a worker's vLLM)
asks the kernel to send that child SIGTERM when the parent dies, even by SIGKILL, so a crashed
role never leaves a server running. `stop_process_trees` stops processes with everything they
started, politely and then not (the launcher's teardown). `experiment_processes` finds whatever of a
run is still alive (tests and the chaos benchmark check that nothing is). `parse_cpus` and `bind_to_cpus`
give a launched role its own CPUs (launch.roles.<entry>.cpus).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """`preexec_fn` for subprocess.Popen: SIGTERM this child when its parent thread dies (Linux).

    The kernel ties the signal to the thread that forked, so start such children from a thread
    that lives as long as the process (the main thread or the event loop's).
    """
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")


def parse_cpus(text: str, key: str = "cpus") -> list[int]:
    """CPU ids written as taskset and VLLM_CPU_OMP_THREADS_BIND write them ("1", "0,2", "4-7,12"), sorted and
    without repeats; a ValueError names `key` when the text is not such a list."""
    ids: set[int] = set()
    for part in text.split(","):
        lo, dash, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi if dash else lo)
        except ValueError:
            first, last = -1, -2
        if first < 0 or last < first:
            raise ValueError(
                f"{key} = {text!r}: {part.strip()!r} is not a CPU id or a range of them; write e.g. 1 or 0,2-3"
            )
        ids.update(range(first, last + 1))
    return sorted(ids)


def machine_cpus() -> set[int]:
    """The CPUs processes here may be bound to: the cgroup's (cpuset.cpus.effective) where it says, else every
    CPU of the machine. A process's own affinity is no limit: it may bind a child to CPUs it does not use."""
    cpuset = Path("/sys/fs/cgroup/cpuset.cpus.effective")
    text = cpuset.read_text().strip() if cpuset.is_file() else ""
    return set(parse_cpus(text, str(cpuset))) if text else set(range(os.cpu_count() or 1))


def bind_to_cpus(cpus: Sequence[int]) -> None:
    """Restrict the calling process, and what it starts later, to `cpus`."""
    os.sched_setaffinity(0, cpus)


def experiment_processes(exp: str) -> list[psutil.Process]:
    """Every live process of an experiment: each role, vLLM's engine and Redis inherit SLIPSTREAM_EXP."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.environ().get("SLIPSTREAM_EXP") == exp and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
    return found


def stop_process_trees(procs: Sequence[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Stop these role processes and everything they started; returns when all are gone.

    Each role gets SIGTERM first, alone: it stops its own children in order (a vLLM worker stops its API
    server, which stops its engine). After half the grace period, whatever is left of each role's process
    group and descendants gets SIGTERM too (a role that does not forward it); after the grace period,
    SIGKILL. Descendants are collected first: a child that set up its own session (vLLM does) is outside
    the group and would otherwise be orphaned.
    """
    live = [proc for proc in procs if proc.poll() is None]
    family: list[psutil.Process] = []
    for proc in live:
        with contextlib.suppress(psutil.NoSuchProcess):
            family += psutil.Process(proc.pid).children(recursive=True)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    half = time.monotonic() + grace_s / 2
    for proc in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, half - time.monotonic()))
    for proc in live:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    _, left = psutil.wait_procs(family, timeout=0)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    for proc in live:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    _, alive = psutil.wait_procs(left, timeout=max(0.0, deadline - time.monotonic()))
    for proc in live:
        if proc.poll() is None:
            log.warning("pid %d ignored SIGTERM for %.0fs: killing", proc.pid, grace_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
