"""RLVR end to end with real processes: `slipstream launch` starts Redis, the router, a vLLM worker
(CPU build) and the trainer. The worker is killed with SIGKILL in the middle of the run; the launcher
restarts it, the run continues on the new worker, and the prompt ledger shows no prompt lost or
trained twice."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CONFIG = """
[run]
name = "rl-e2e"
root = "{root}"

[rendezvous]
heartbeat_period_s = 0.5
heartbeat_ttl_s = 2.0

[router]
health_interval_s = 0.5

[rollout]
model = "tiny-deepseek"
max_model_len = 64
max_tokens = 6
dtype = "float32"
startup_timeout_s = 300

[rollout.task]
max_value = 9

[flow]
strategy = "{strategy}"
prompts_per_step = 8
samples_per_prompt = 4
max_concurrent = 32
max_untrained_prompts = 16
max_staleness = 2

[trainer]
steps = {steps}
final_eval_wait_s = 0

[trainer.model]
max_seq_len = 64

[trainer.warmup]
steps = 20

[launch.roles.router]

[launch.roles.vllm]
restart = "on-failure"
max_restarts = 2
env = {{VLLM_CPU_KVCACHE_SPACE = "1"}}

[launch.roles.trainer]
critical = true
"""


class Launch:
    def __init__(self, tmp_path: Path, strategy: str, steps: int) -> None:
        cfg = tmp_path / "rl.toml"
        cfg.write_text(CONFIG.format(root=tmp_path / "runs", strategy=strategy, steps=steps))
        self.log_path = tmp_path / "launch.log"
        self.run_dir = tmp_path / "runs" / "rl-e2e-test"
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": "rl-e2e-test"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "common.cli", "launch", str(cfg)], cwd=REPO, env=env,
            stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT,
        )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str, timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log())
            if found:
                return found
            if self.proc.poll() is not None:
                raise AssertionError(f"launch exited ({self.proc.returncode}) before {pattern!r}:\n{self.log()[-4000:]}")
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} within {timeout_s}s:\n{self.log()[-4000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=60)


@pytest.fixture
def short_tmp(tmp_path):
    """A short run root: vLLM's IPC socket paths under <run dir>/cache/tmp must stay below 107 bytes,
    which pytest's deep tmp_path exceeds. The launch log is kept in tmp_path for inspection."""
    path = Path(tempfile.mkdtemp(prefix="ss-"))
    yield path
    if (path / "launch.log").exists():
        shutil.copy(path / "launch.log", tmp_path / "launch.log")
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_killing_the_worker_mid_run_loses_and_duplicates_no_prompt(short_tmp):
    tmp_path = short_tmp
    steps = 10
    run = Launch(tmp_path, "fully_async", steps)
    try:
        worker_pid = int(run.wait_for(r"started vllm/0 \(role vllm, pid (\d+)\)", 60).group(1))
        run.wait_for(r"step 2: reward", 600)
        os.kill(worker_pid, signal.SIGKILL)
        run.wait_for(r"vllm/0 exited with code 137: restarting \(1/2\)", 60)
        assert run.proc.wait(timeout=900) == 0, run.log()[-4000:]
    finally:
        run.stop()
    log = run.log()
    # The worker came back and the run finished on it.
    assert log.count("registered worker") >= 2
    steps_done = [json.loads(line) for line in (run.run_dir / "trained_prompts.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps_done] == list(range(steps))
    trained = [p for s in steps_done for p in s["prompt_ids"]]
    assert len(trained) == len(set(trained)) == steps * 8, "a prompt was trained twice"
    summary = json.loads((run.run_dir / "flow_summary.json").read_text())
    untrained = summary["untrained_prompts"]
    assert not set(trained) & set(untrained)
    # Every admitted prompt is accounted for: trained or still in the saved flow state (stale samples
    # are re-queued in this config, so nothing is dropped).
    assert summary["counters"]["dropped_prompts"] == 0
    assert sorted(trained + untrained) == list(range(summary["admitted_prompts"]))
