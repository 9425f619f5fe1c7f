"""Shared fixtures: `redis_client` (an async client of a fresh experiment Redis under the test's tmp
dir), `tiny_model` (the small DeepSeek-V3 shape of the multi-rank CPU tests), `short_root` (a run root
short enough for vLLM's socket paths). vLLM servers are expensive (30-60 s and 2 GiB each on CPU), so each tiny
architecture gets ONE session-scoped run (Redis, a worker role process serving vLLM, and for
DeepSeek a router role process) that every slow rollout test reuses. Tests that change the served
weights publish the original weights back before they end, so the order of tests does not matter.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest

from common import log
from common.config import Config, ModelConfig, RendezvousConfig, load_config
from common.keys import Keys
from common.net import bearer
from common.rendezvous import Rendezvous
from common.run_secrets import RunSecrets, apply_secrets, read_secrets

ROOT = Path(__file__).resolve().parent.parent
VLLM_READY_TIMEOUT_S = 300.0
# Long enough that requests of nearly this many tokens stay in flight across a weight publish even
# on an idle machine (the pause tests of test_rollout_vllm.py rely on it).
MAX_MODEL_LEN = 2048
# Liveness TTL of the shared runs' roles. While vLLM's CPU engine core and worker fill both cores of a
# small machine, Redis, the router and the worker role have been measured waiting up to 4.5 s on the
# run queue (/proc/<pid>/schedstat) without being scheduled; a TTL shorter than that lets the router's
# URL key or a worker's liveness key expire under a running test (NoRouterError, or the router dropping
# the worker: HTTP 503). A worker killed with -9 (test_rollout_vllm.py) now leaves within this TTL.
HEARTBEAT_TTL_S = 10.0


@dataclass
class VllmRun:
    """One experiment with real vLLM workers: its config file, Redis, keys and role processes."""

    exp: str
    config: Path
    run_dir: Path
    rz: Rendezvous
    keys: Keys
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def redis(self):
        return self.rz.info.client()  # type: ignore[union-attr]

    @property
    def secrets(self) -> RunSecrets:
        """The tokens the run's roles generated in its meet dir (the router asks for `router`, workers `workers`)."""
        found = read_secrets(self.rz.meet)
        assert found is not None, f"no secrets in {self.rz.meet}: has a role of the run started?"
        return found

    def cfg(self) -> Config:
        """The run's config as its roles see it: the generated tokens filled in."""
        cfg = load_config(self.config)
        apply_secrets(cfg, self.secrets)
        return cfg

    def worker_session(self) -> aiohttp.ClientSession:
        """A client session that the workers' routes accept (it sends rollout.api_key)."""
        return aiohttp.ClientSession(headers=bearer(self.secrets.workers))

    def start_role(self, role: str, log_name: str) -> subprocess.Popen:
        env = os.environ | {
            "ROLE": role,
            "SLIPSTREAM_MEET_DIR": str(self.rz.meet),
            "SLIPSTREAM_EXP": self.exp,
            "SLIPSTREAM_REPLICA": str(len(self.procs)),
            "PYTHONPATH": str(ROOT),
        }
        log = (self.run_dir / f"{log_name}.log").open("ab")
        cmd = [sys.executable, "-m", "common.runs.cli", "run", str(self.config)]
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def workers(self) -> dict[str, dict]:
        return {k: json.loads(v) for k, v in self.redis.hgetall(self.keys.workers).items()}

    def wait_for(self, what: str, predicate, proc: subprocess.Popen | None, timeout_s: float):
        """Poll predicate() until truthy; fail naming `what` if the role process dies or time runs out."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"{what}: role process exited with {proc.returncode}; see logs in {self.run_dir}")
            time.sleep(0.1)
        raise AssertionError(f"{what}: not within {timeout_s:.0f}s; see logs in {self.run_dir}")

    def start_worker(self, name: str) -> tuple[subprocess.Popen, str]:
        """Start a worker role process and wait until it registers; (process, worker id)."""
        before = set(self.workers())
        proc = self.start_role("vllm", name)
        new = self.wait_for(
            f"worker {name} registration", lambda: set(self.workers()) - before, proc, VLLM_READY_TIMEOUT_S
        )
        return proc, new.pop()

    def router_url(self) -> str | None:
        return self.redis.get(self.keys.router())

    def router_workers(self) -> list[dict]:
        url = self.router_url()
        request = urllib.request.Request(f"{url}/workers", headers=bearer(self.secrets.router))
        with urllib.request.urlopen(request, timeout=5) as r:
            return json.loads(r.read())["workers"]

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.rz.close()


def _vllm_run(base: Path, exp: str, arch: str, router: bool) -> Iterator[VllmRun]:
    base.mkdir(parents=True, exist_ok=True)
    model = {"deepseek_v3": "tiny-deepseek", "qwen3_moe": "tiny-qwen3"}[arch]
    extra = "n_shared_experts = 0\n" if arch == "qwen3_moe" else ""
    config = base / "run.toml"
    config.write_text(
        f'[run]\nname = "{exp}"\ndir = "{base / "run"}"\n'
        f"[rendezvous]\nheartbeat_period_s = 0.5\nheartbeat_ttl_s = {HEARTBEAT_TTL_S}\n"
        "[router]\nhealth_interval_s = 0.5\n"
        f'[rollout]\nmodel = "{model}"\ndtype = "float32"\nmax_model_len = {MAX_MODEL_LEN}\nstartup_timeout_s = 280\n'
        f'[trainer.model]\narch = "{arch}"\nmax_seq_len = {MAX_MODEL_LEN}\n{extra}'
    )
    cfg = load_config(config)
    run_dir = base / "run"
    run_dir.mkdir(exist_ok=True)
    rz = Rendezvous(base / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    run = VllmRun(exp, config, run_dir, rz, Keys(exp))
    try:
        if router:
            proc = run.start_role("router", "router")
            run.wait_for("router URL", run.router_url, proc, 60)
        proc, worker_id = run.start_worker("worker-a")
        if router:
            run.wait_for("router picking up the worker", lambda: run.router_workers(), proc, 30)
        assert cfg.rollout.model == model
        yield run
    finally:
        run.stop()


# The environment override every run of this session reads (common/config/load.py): one vLLM cache for all the
# session's servers (rollout.vllm_cache_dir), so that vLLM inspects each model class once, not in a 10-15 s
# subprocess at every one of the suite's few dozen server starts.
VLLM_CACHE_ENV = "SLIPSTREAM__rollout__vllm_cache_dir"


def launch_env(**extra: str) -> dict[str, str]:
    """This process's environment for a run a test launches: none of its SLIPSTREAM* variables but the session's
    vLLM cache (VLLM_CACHE_ENV), and `extra`."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM") or k == VLLM_CACHE_ENV} | extra


@pytest.fixture(scope="session", autouse=True)
def _one_vllm_cache_for_the_session(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """rollout.vllm_cache_dir of every run the session starts (the role processes inherit the environment):
    under pytest's own temporary directory, unset at the end; one set before the session is kept."""
    if os.environ.get(VLLM_CACHE_ENV):
        yield
        return
    os.environ[VLLM_CACHE_ENV] = str(tmp_path_factory.mktemp("vllm-cache"))
    yield
    os.environ.pop(VLLM_CACHE_ENV, None)


@pytest.fixture(autouse=True)
def _no_role_logging_left_behind() -> Iterator[None]:
    """A role's entry point run in-process (the launcher, `slipstream eval`) routes the root logger to the
    stderr pytest captured for that test (common.log.setup); once that stream is closed, every later test's
    log line there is a '--- Logging error ---' traceback in the output. Those handlers go after each test."""
    yield
    log.reset()


@pytest.fixture(scope="session")
def deepseek_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRun]:
    """The shared DeepSeek run: Redis, a router and one worker serving tiny-deepseek in fp32."""
    yield from _vllm_run(tmp_path_factory.mktemp("deepseek"), "ds", "deepseek_v3", router=True)


@pytest.fixture(scope="session")
def qwen3_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmRun]:
    """The shared Qwen3-MoE run: Redis and one worker serving tiny-qwen3 in fp32 (no router)."""
    yield from _vllm_run(tmp_path_factory.mktemp("qwen3"), "qw", "qwen3_moe", router=False)


@pytest.fixture
async def redis_client(tmp_path: Path):
    """An async client of a real Redis elected in this test's own meet dir (stopped afterwards)."""
    rz = Rendezvous(tmp_path / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    client = rz.async_client()
    yield client
    await client.aclose()
    rz.close()


@pytest.fixture
def tiny_model() -> ModelConfig:
    """A DeepSeek-V3 shape small enough for tests that run it on several CPU ranks: 3 layers (the first
    dense), 8 routed experts of which 2 per token, MLA with a 16-wide KV latent, a 64-token vocabulary."""
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        num_layers=3,
        first_k_dense=1,
        intermediate_size=64,
        moe_intermediate_size=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        num_heads=2,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=8,
        max_seq_len=32,
    )


@pytest.fixture
def short_root(tmp_path: Path) -> Iterator[Path]:
    """A short run root: vLLM's IPC socket paths under <run dir>/cache/tmp must stay below 107 bytes,
    which pytest's deep tmp_path exceeds. The logs written at its top are kept in tmp_path for inspection."""
    path = Path(tempfile.mkdtemp(prefix="ss-"))
    yield path
    for kept in path.glob("*.log"):
        shutil.copy(kept, tmp_path / kept.name)
    shutil.rmtree(path, ignore_errors=True)
