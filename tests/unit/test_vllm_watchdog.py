"""The watchdog that ends a worker's vLLM server when the worker role dies (rollout/vllm_plugin/
watchdog.py), on real processes: a stand-in for the role starts a stand-in for the server, which, like
a vLLM whose graceful shutdown never finishes, ignores SIGTERM and has a child of its own in its
process group. (vLLM itself: tests/e2e/test_rollout_vllm.py kills a worker role and checks its server.)"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from rollout.vllm_plugin import watchdog

REPO = Path(__file__).resolve().parents[2]

SERVER = r"""
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a shutdown that never finishes
from rollout.vllm_plugin import watchdog
assert watchdog.start(), "the watchdog did not start in the role's direct child"
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # the engine core
print(child.pid, flush=True)
time.sleep(600)
"""

ROLE = r"""
import os, subprocess, sys
from common.proc import die_with_parent
env = dict(os.environ, SLIPSTREAM_VLLM_PARENT_PID=str(os.getpid()))
server = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE, text=True,
                          start_new_session=True, preexec_fn=die_with_parent)
print(server.pid, server.stdout.readline().strip(), flush=True)
import time; time.sleep(600)
"""


def test_a_server_whose_role_was_killed_is_killed_with_its_group_after_the_grace_period():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    role = subprocess.Popen([sys.executable, "-c", ROLE, SERVER], env=env, stdout=subprocess.PIPE, text=True)
    assert role.stdout is not None
    server_pid, engine_pid = (int(x) for x in role.stdout.readline().split())
    procs = [psutil.Process(server_pid), psutil.Process(engine_pid)]
    try:
        time.sleep(2 * watchdog.POLL_S)
        assert all(p.is_running() for p in procs)
        role.kill()
        role.wait()
        killed = time.monotonic()
        _, alive = psutil.wait_procs(procs, timeout=watchdog.GRACE_S + 5)
        took = time.monotonic() - killed
        assert not alive, f"{[p.pid for p in alive]} outlived the role by {took:.1f} s"
        assert took >= watchdog.GRACE_S - 0.5, f"ended after {took:.1f} s: the graceful shutdown got no time"
    finally:
        for p in procs:
            if p.is_running():
                p.kill()


def test_only_the_roles_direct_child_watches():
    """vLLM loads our plugin in its engine and worker processes too; only the API server watches."""
    code = "from rollout.vllm_plugin import watchdog; print(watchdog.start())"
    env = dict(os.environ, PYTHONPATH=str(REPO), SLIPSTREAM_VLLM_PARENT_PID=str(os.getpid()))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
    grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {code!r}])"
    out = subprocess.run([sys.executable, "-c", grandchild], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=dict(os.environ, PYTHONPATH=str(REPO)),
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.strip() == "False"


def test_the_role_passes_its_pid_to_vllm():
    from rollout.worker import vllm_env

    with tempfile.TemporaryDirectory(prefix="ss-") as run_dir:  # short: vLLM's IPC socket paths live under it
        assert vllm_env(Path(run_dir), base={})[watchdog.PARENT_ENV] == str(os.getpid())
