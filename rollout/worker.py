"""ROLE=vllm: one rollout worker, i.e. a vLLM OpenAI server child process registered in Redis.

The worker starts vLLM with the RL endpoints (`VLLM_SERVER_DEV_MODE=1`), the weight-transfer
engine of `rollout.weight_backend`, processed log-probs (after temperature, as importance ratios
need), the token-in/token-out route (`--enable-scale-out`), for MoE models the routed experts of every
position (`rollout.return_routed_experts`), a bounded KV cache, and every cache and temp dir under the
run dir, offline. It is ready only after /health passes, one real completion succeeds (some bad
configs pass /health and crash on the first request) and RL's sampling shapes have run alone and
batched (vLLM's CPU sampler compiles them on first sight, a stall of seconds). A worker of the train pool
(`rollout.pool`, the default) then catches up to `weights:current` if the run has published weights,
registers in the `workers` hash and heartbeats `worker_alive(id)`. While serving it watches three
things: vLLM exiting (the role exits non-zero), its registry entry vanishing (a publisher evicted it: a
train worker whose vLLM still answers loads `weights:current` whole, which also undoes a half-applied update
and resumes a server the failed update left paused, and registers again, so a host cut off mid-publish
rejoins when its link is back; an eval worker, or one whose reload fails 3 times, exits non-zero to be restarted,
never left on old weights), and `weights:current` moving past its
own version without it (a publish that raced its registration: it catches up itself, under the
same per-worker lock publishers take, so the two never interleave). A worker of
the eval pool registers in `eval_workers` instead, which neither the router nor the publisher
reads, and never follows `weights:current`: the evaluator loads the version it measures into it
(evaluator/pinned.py). On SIGTERM it deregisters and stops vLLM (SIGTERM to the API server, which
stops its engine, then SIGKILL to the whole process group after a grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
from redis.exceptions import RedisError

from common.aio import cancel_and_join
from common.config import Config, RolloutConfig
from common.heartbeat import Heartbeat
from common.net import advertised, free_port, url_host, vllm_session
from common.proc import die_with_parent
from common.redis_client import STOP_WRITE_S
from common.roles import RunContext, announce
from common.weights.fleet import WorkerError, WorkerRecord, current_version, read_record, register, set_worker_version
from common.weights.versions import FILE_BACKENDS
from common.weights.workers import apply_version, end_cut_update, is_paused, label_version, resume, weight_lock
from rollout.vllm_plugin import COLLECTIVE_BACKEND, FILE_BACKEND
from rollout.vllm_plugin.auth import KEY_ENV, MIDDLEWARE
from rollout.vllm_plugin.watchdog import PARENT_ENV
from trainer.tinykit import TINY_MODELS, resolve_model

log = logging.getLogger(__name__)

STOP_GRACE_S = 15.0
EXIT_VLLM_DIED = 3
EXIT_EVICTED = 4
# An evicted worker's whole reload is tried this many times, this far apart, before it exits to be restarted.
REJOIN_ATTEMPTS = 3
REJOIN_RETRY_S = 2.0


class WorkerStartError(RuntimeError):
    """vLLM did not become ready; the message says what was seen and where the log is."""


def is_deepseek(model_dir: Path) -> bool:
    arch = json.loads((model_dir / "config.json").read_text()).get("architectures", [""])[0]
    return arch.startswith("Deepseek")


def has_moe(model_dir: Path) -> bool:
    """Whether the checkpoint has routed experts (DeepSeek's n_routed_experts, Qwen3-MoE's num_experts,
    Mixtral's num_local_experts)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0) > 0


def serving_dtype(dtype: str, model_dir: Path) -> str:
    """The dtype vLLM will serve in: rollout.dtype, or the checkpoint's own for "auto"."""
    if dtype != "auto":
        return {"fp32": "float32", "float": "float32"}.get(dtype, dtype)
    cfg = json.loads((model_dir / "config.json").read_text())
    return str(cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")


def vllm_command(ro: RolloutConfig, model_dir: Path, host: str, port: int, cpu: bool) -> list[str]:
    """The vLLM OpenAI server command line of a worker (engine args pass through from the config)."""
    backend = {"file": FILE_BACKEND, "collective": COLLECTIVE_BACKEND}.get(ro.weight_backend, "nccl")
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_dir),
        "--served-model-name",
        ro.served_model_name,
        "--host",
        host,
        "--port",
        str(port),
        "--max-model-len",
        str(ro.max_model_len),
        "--dtype",
        ro.dtype,
        "--tensor-parallel-size",
        str(ro.tensor_parallel_size),
        "--weight-transfer-config",
        json.dumps({"backend": backend}),
        "--logprobs-mode",
        "processed_logprobs",
        "--enable-scale-out",
        "--disable-uvicorn-access-log",
    ]
    if cpu:
        cmd += ["--kv-cache-memory-bytes", str(ro.kv_cache_bytes)]
        if is_deepseek(model_dir):
            # vLLM 0.32's CPU rotary custom op is wrong for DeepSeek's query shape (0.19 nats off).
            cmd += ["--compilation-config", json.dumps({"custom_ops": ["-rotary_embedding"]})]
            if serving_dtype(ro.dtype, model_dir) == "float32" and "--attention-backend" not in ro.extra_args:
                # vLLM prefers its AMX MLA backend where AMX exists, but that one packs bf16/fp16 only
                # and fails at load on fp32 weights; the reference CPU MLA backend runs fp32.
                cmd += ["--attention-backend", "CPU_MLA"]
    else:
        cmd += ["--gpu-memory-utilization", str(ro.gpu_memory_utilization)]
    if ro.enforce_eager:
        cmd.append("--enforce-eager")
    if ro.return_routed_experts and has_moe(model_dir):
        cmd.append("--enable-return-routed-experts")
    if ro.api_key:
        cmd += ["--middleware", MIDDLEWARE]  # the key itself travels in the environment (vllm_env)
    return cmd + list(ro.extra_args)


def vllm_env(
    run_dir: Path, base: dict[str, str] | None = None, api_key: str = "", cache_dir: str | Path = ""
) -> dict[str, str]:
    """vLLM's environment: RL endpoints on, offline, caches and temp files under the run dir (vLLM's own cache
    in `cache_dir` where one is given: rollout.vllm_cache_dir), and the bearer token of the auth middleware when
    `api_key` is set."""
    env = dict(os.environ if base is None else base)
    env[PARENT_ENV] = str(os.getpid())  # vLLM's watchdog ends the server when this process dies
    if api_key:
        env[KEY_ENV] = api_key
    cache = Path(run_dir) / "cache"
    dirs = {
        "VLLM_CACHE_ROOT": Path(cache_dir).expanduser().resolve() if cache_dir else cache / "vllm",
        "TORCHINDUCTOR_CACHE_DIR": cache / "inductor",
        "XDG_CACHE_HOME": cache / "xdg",
        "TMPDIR": cache / "tmp",
    }
    # vLLM puts ZeroMQ IPC sockets in TMPDIR, named by a 36-character uuid; a Unix socket path
    # holds at most 107 bytes, and a longer one kills vLLM deep in its start-up.
    socket_path = len(str(dirs["TMPDIR"].resolve())) + len("/") + 36
    if socket_path > 107:
        raise WorkerStartError(
            f"run dir {run_dir} is too deep for vLLM's IPC sockets ({socket_path} > 107 bytes under "
            f"{dirs['TMPDIR']}); use a shorter run.root or run.dir"
        )
    for name, path in dirs.items():
        path.mkdir(parents=True, exist_ok=True)
        env[name] = str(path)
    env.update(
        VLLM_SERVER_DEV_MODE="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
    )
    # Binding OpenMP threads to both cores halved throughput here (docs/vllm-cpu.md).
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "auto")
    return env


class VllmProcess:
    """The vLLM server child: started in its own process group, its output forwarded to our log."""

    def __init__(
        self, cmd: list[str], env: dict[str, str], url: str, log_path: Path, prefix: str, echo: bool = True
    ) -> None:
        self.cmd, self.env, self.url, self.log_path, self.prefix = cmd, env, url, log_path, prefix
        self.echo = echo  # forward each line to our stderr too (else only to log_path)
        self.proc: asyncio.subprocess.Process | None = None
        self._pump: asyncio.Task[None] | None = None
        self._tail: list[str] = []

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = await asyncio.create_subprocess_exec(
            *self.cmd,
            env=self.env,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            # Own session (a process group stopped as a whole); SIGTERM from the kernel if the worker dies.
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        self._pump = asyncio.create_task(self._forward(), name="vllm log")
        log.info("started vLLM pid %d at %s (log %s)", self.proc.pid, self.url, self.log_path)

    async def _forward(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        # Unbuffered: whoever reads the log (a person tailing it, a test) sees each line as the server writes it.
        with self.log_path.open("ab", buffering=0) as fh:
            async for raw in self.proc.stdout:
                fh.write(raw)
                line = raw.decode(errors="replace").rstrip()
                self._tail = (self._tail + [line])[-30:]
                if self.echo:
                    print(f"{self.prefix} {line}", file=sys.stderr, flush=True)

    def tail(self) -> str:
        return "\n".join(self._tail)

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.returncode

    async def wait(self) -> int:
        assert self.proc is not None
        code = await self.proc.wait()
        if self._pump is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._pump
        return code

    async def stop(self, grace_s: float = STOP_GRACE_S) -> None:
        """SIGTERM the API server, SIGKILL its whole process group after grace_s, and reap the child.

        Only the API server gets SIGTERM: it stops its engine itself, in order. An engine core that gets
        SIGTERM too dies under the server's feet, whose output handler then logs an EngineDeadError
        traceback into an ordinary shutdown."""
        if self.proc is None or self.proc.returncode is not None:
            return
        pgid = self.proc.pid  # setsid made the child its group leader
        with contextlib.suppress(ProcessLookupError):
            os.kill(pgid, signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), grace_s)
        except TimeoutError:
            log.warning("vLLM pid %d ignored SIGTERM for %.0fs; killing its process group", pgid, grace_s)
        # Engine-core processes of the group may outlive the API server: kill whatever is left.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        await self.wait()
        log.info("stopped vLLM pid %d (exit code %s)", pgid, self.proc.returncode)


def on_cpu() -> bool:
    """Whether vLLM runs on CPU here (no CUDA device, or no torch at all)."""
    try:
        import torch

        return not torch.cuda.is_available()
    except ImportError:
        return True


def worker_vllm(
    ro: RolloutConfig,
    run_dir: Path,
    model_dir: Path,
    bind: tuple[str, int],
    url: str,
    log_path: Path,
    name: str,
    base_env: Mapping[str, str] | None = None,
    echo: bool = True,
) -> VllmProcess:
    """The vLLM server a worker of this run starts (not started yet): `vllm_command` listening on `bind`,
    `vllm_env` over `base_env` (default: this process's environment), its output appended to `log_path`.
    Its routes but /health always ask for `ro.api_key` (a run's roles get the run's generated one)."""
    if not ro.api_key:
        raise ValueError(
            f"worker {name}: rollout.api_key is empty; a worker's vLLM always asks for a bearer token (a role of "
            "the run gets the run's generated one, see common/run_secrets.py; elsewhere set rollout.api_key)"
        )
    cmd = vllm_command(ro, model_dir, bind[0], bind[1], on_cpu())
    env = vllm_env(run_dir, None if base_env is None else dict(base_env), ro.api_key, ro.vllm_cache_dir)
    return VllmProcess(cmd, env, url, log_path, f"[vllm {name}]", echo)


# The sampling shapes of RL traffic that the sampler compiles on first sight: vLLM's CPU sampler
# torch.compiles the sampled token's rank (any request with log-probs) and the unseeded random sample,
# once for a batch of one and again, with a dynamic batch, for the first larger batch. Each compile
# stalls the engine for 5-15 s on two cores, so a worker that skipped them would stall the first
# rollouts it serves (and a publish timed against them).
WARMUP_SAMPLING: tuple[dict[str, Any], ...] = (
    {"temperature": 1.0, "top_k": 4, "top_p": 0.9, "seed": 0, "logprobs": 0},
    {"temperature": 1.0, "logprobs": 0},
    {"temperature": 0.7, "seed": 1, "logprobs": 0},
)


async def _complete(session: aiohttp.ClientSession, vllm: VllmProcess, served_model: str, sampling: dict) -> None:
    """One short completion; WorkerStartError naming the HTTP status and the log when vLLM refuses it."""
    body = {"model": served_model, "prompt": "1+1=", "max_tokens": 4, **sampling}
    async with session.post(f"{vllm.url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=120)) as r:
        if r.status != 200:
            raise WorkerStartError(
                f"vLLM's completion {sampling} failed with HTTP {r.status}: {(await r.text())[:500]}; "
                f"the model config is probably unsupported here (see {vllm.log_path})"
            )
        await r.json()


async def warm_sampler(session: aiohttp.ClientSession, vllm: VllmProcess, served_model: str) -> None:
    """Run RL's sampling shapes alone and then together (batch sizes one and several), so the sampler's
    compiles happen before the worker takes traffic."""
    await _complete(session, vllm, served_model, WARMUP_SAMPLING[0])
    await asyncio.gather(*(_complete(session, vllm, served_model, s) for s in WARMUP_SAMPLING))


async def wait_ready(session: aiohttp.ClientSession, vllm: VllmProcess, served_model: str, timeout_s: float) -> float:
    """Wait for /health, one real completion and the sampler's warm-up (`warm_sampler`); seconds taken.
    WorkerStartError if vLLM dies or is late."""
    start = time.monotonic()
    deadline = start + timeout_s
    stage = "waiting for /health"
    while True:
        if vllm.returncode is not None:
            raise WorkerStartError(
                f"vLLM exited with code {vllm.returncode} while {stage}; last lines:\n{vllm.tail()}\n"
                f"(full log: {vllm.log_path})"
            )
        if time.monotonic() > deadline:
            raise WorkerStartError(
                f"vLLM at {vllm.url} not ready after {timeout_s:.0f}s ({stage}); raise rollout.startup_timeout_s "
                f"if the machine is slow, or see {vllm.log_path}"
            )
        try:
            if stage == "waiting for /health":
                async with session.get(f"{vllm.url}/health", timeout=aiohttp.ClientTimeout(total=5)) as r:
                    if r.status == 200:
                        stage = "running the first completion"
                        continue
            else:
                await _complete(session, vllm, served_model, {"temperature": 0.0})
                await warm_sampler(session, vllm, served_model)
                return time.monotonic() - start
        except (aiohttp.ClientConnectionError, TimeoutError):
            if stage != "waiting for /health":
                # The engine died during the first request: report it with vLLM's own last words.
                await asyncio.sleep(1.0)
                if vllm.returncode is not None:
                    continue
                raise
        await asyncio.sleep(0.5)


async def catch_up(ctx: RunContext, client, session: aiohttp.ClientSession, url: str, have: int | None) -> int:
    """Apply weights:current to the server at url if it is newer than `have`; the version now served.

    `have = None` means the server still holds the checkpoint it started from, which no published
    version is: any published version replaces it, version 0 included (the trainer publishes its
    warm-started initial policy as version 0).
    """
    current = await current_version(client, ctx.keys)
    if current is None:
        return 0 if have is None else have
    if have is not None and current <= have:
        return have
    location = await _location_of(client, ctx, current)
    log.info(
        "catching up from weight version %s to %d (%s)",
        "<start checkpoint>" if have is None else have,
        current,
        location,
    )
    await apply_version(session, url, current, location, ctx.cfg.rollout.pause_mode)
    return current


async def follow_current(ctx: RunContext, client, session: aiohttp.ClientSession, worker_id: str, url: str) -> int:
    """Catch a registered train-pool worker up to weights:current; the version it serves afterwards.

    Runs under the worker's weight lock, the one publishers take to drive it, and re-reads the
    worker's own version under it: a publish that drove the worker in the meantime is not undone,
    and the two never interleave their calls on the server.
    """
    async with weight_lock(client, ctx.keys, worker_id):
        record = await read_record(client, ctx.keys.workers, worker_id)
        if record is None:
            return -1  # evicted meanwhile: the serve loop exits on its next look
        have = record.weight_version
        version = await catch_up(ctx, client, session, url, have)
        if version != have:
            await set_worker_version(client, ctx.keys.workers, worker_id, version)
            log.info("worker %s caught up to weight version %d", worker_id, version)
        return version


# How long a server may stay paused with nobody holding the worker's weight lock before the worker resumes it.
UNHELD_PAUSE_GRACE_S = 30.0


class UnheldPause:
    """Resumes the server once it has stayed paused for UNHELD_PAUSE_GRACE_S with nobody holding the worker's
    weight lock.

    Every pause of the run's own is made under that lock (a publisher, the worker's catch-up) and undone before it
    is released. One that is not: a publisher cut off by a partition mid-update gives up on its calls, but a
    request its kernel still had to send arrives once the link is back, after the worker has rejoined and resumed,
    and pauses it with nobody left to resume it (seen in the multihost test: generation stopped for good). Each
    look takes the lock itself (only tries it: held by someone means the pause is theirs), so it never undoes the
    pause of an update under way; the grace leaves a pause made just before an update takes the lock alone."""

    def __init__(self, grace_s: float = UNHELD_PAUSE_GRACE_S) -> None:
        self.grace_s = grace_s
        self.since: float | None = None

    async def look(self, ctx: RunContext, client, session: aiohttp.ClientSession, worker_id: str, url: str) -> bool:
        """One look; True if it resumed the server."""
        try:
            async with weight_lock(client, ctx.keys, worker_id, wait_s=0.05):
                if not await is_paused(session, url):
                    self.since = None
                    return False
                now = time.monotonic()
                self.since = now if self.since is None else self.since
                if now - self.since < self.grace_s:
                    return False
                await resume(session, url)
                self.since = None
        except (WorkerError, RedisError) as exc:  # the lock is someone's (LockError), or the server is out of reach now
            log.debug("unheld-pause look: %s", exc)
            self.since = None
            return False
        log.warning(
            "worker %s: its server stayed paused for %.0f s with nobody holding its weight lock (a cut-off "
            "publisher's request that arrived late); resumed it",
            worker_id,
            self.grace_s,
        )
        return True


async def _location_of(client, ctx: RunContext, version: int) -> str:
    for _id, fields in await client.xrevrange(ctx.keys.weights_log, count=1000):
        if int(fields["version"]) == version:
            if fields["backend"] not in FILE_BACKENDS:
                raise WorkerError(
                    f"weights:current = {version} was published with backend {fields['backend']!r}; a new worker can "
                    "only load versions written as files by itself. Use rollout.weight_backend = 'file' or "
                    "'collective' for elastic workers."
                )
            return fields["location"]
    raise WorkerError(f"weights:current = {version} has no entry in {ctx.keys.weights_log}; the publisher is broken")


async def main(ctx: RunContext) -> int:
    """Run one worker until SIGTERM (exit via cancellation), vLLM's death or eviction."""
    cfg: Config = ctx.cfg
    ro = cfg.rollout
    worker_id = ctx.instance
    registry = ctx.keys.workers if ro.pool == "train" else ctx.keys.eval_workers
    model_dir = await asyncio.to_thread(resolve_model, cfg, ctx.run_dir)
    port = free_port(ro.bind_host)
    assert ctx.rendezvous.info is not None
    host = advertised(ro.bind_host, ro.advertise_host, ctx.rendezvous.info.host, "rollout.advertise_host")
    url = f"http://{url_host(host)}:{port}"
    vllm = worker_vllm(
        ro, ctx.run_dir, model_dir, (ro.bind_host, port), url, ctx.run_dir / "logs" / f"vllm-{worker_id}.log", worker_id
    )
    if "--enable-return-routed-experts" in vllm.cmd:
        log.info("vLLM returns the routed experts of every position (rollout.return_routed_experts)")
    client = ctx.async_redis()
    rz = cfg.rendezvous
    beat = Heartbeat(client, ctx.keys.worker_alive(worker_id), url, rz.heartbeat_period_s, rz.heartbeat_ttl_s)
    registered = False
    try:
        async with vllm_session(ro.api_key) as session:
            await vllm.start()
            took = await wait_ready(session, vllm, ro.served_model_name, ro.startup_timeout_s)
            log.info("vLLM ready after %.1fs (model %s)", took, model_dir)
            # Label the initial weights version 0 so every token carries a version.
            await label_version(session, url, 0)
            # An eval worker serves whatever version the evaluator loads into it, never weights:current.
            version = await catch_up(ctx, client, session, url, None) if ro.pool == "train" else 0
            record = WorkerRecord(worker_id, url, ro.served_model_name, version, time.time())
            await beat.start()
            await register(client, registry, record)
            registered = True
            await announce(
                client, ctx.keys, "vllm", "worker registered", worker=worker_id, url=url, version=version, pool=ro.pool
            )
            log.info("registered worker %s at %s serving weight version %d (%s pool)", worker_id, url, version, ro.pool)
            return await _serve(ctx, client, session, vllm, worker_id, record, registry)
    finally:
        if registered:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(STOP_WRITE_S):
                    await client.hdel(registry, worker_id)
                async with asyncio.timeout(STOP_WRITE_S):
                    await announce(client, ctx.keys, "vllm", "worker deregistered", worker=worker_id)
        await beat.stop()
        await vllm.stop()
        await client.aclose()


async def _rejoin(ctx: RunContext, client, session: aiohttp.ClientSession, record: WorkerRecord) -> bool:
    """Register an evicted train worker again after loading `weights:current` into its live server; False
    when that fails REJOIN_ATTEMPTS times (the caller exits to be restarted).

    A publisher evicts a worker whose update failed: an error, or the worker out of reach (its heartbeat
    expired: a partitioned host). Its weights may be half-updated and its server left paused; a whole load of
    the current version replaces every tensor (vLLM's layer-wise reload takes a layer whose reload had
    begun; an update the publisher started and never finished is finished first, `end_cut_update`) and ends
    with /resume. A whole load can be repeated, so an attempt that fails on a transient error (a Redis blip
    as the link comes back, a dropped connection) is tried again. Under the worker's weight lock, as publishers
    drive it; a version published meanwhile is followed by the serve loop as after a first registration."""
    log.warning(
        "worker %s was evicted (a weight update failed on it, or it was out of reach): loading weights:current "
        "whole and registering again",
        record.id,
    )
    for attempt in range(1, REJOIN_ATTEMPTS + 1):
        try:
            async with weight_lock(client, ctx.keys, record.id):
                await end_cut_update(session, record.url)
                version = await catch_up(ctx, client, session, record.url, None)
                await register(
                    client, ctx.keys.workers, replace(record, weight_version=version, started_at=time.time())
                )
            break
        except (WorkerError, RedisError, aiohttp.ClientError, TimeoutError) as exc:
            log.error(
                "worker %s could not load weights:current again (attempt %d of %d): %s",
                record.id,
                attempt,
                REJOIN_ATTEMPTS,
                exc,
            )
            if attempt == REJOIN_ATTEMPTS:
                return False
            await asyncio.sleep(REJOIN_RETRY_S)
    await announce(
        client, ctx.keys, "vllm", "worker registered", worker=record.id, url=record.url, version=version, pool="train"
    )
    log.info("registered worker %s again at %s serving weight version %d", record.id, record.url, version)
    return True


async def _serve(
    ctx: RunContext, client, session, vllm: VllmProcess, worker_id: str, record: WorkerRecord, registry: str
) -> int:
    period = ctx.cfg.rendezvous.heartbeat_period_s
    died = asyncio.create_task(vllm.wait(), name="vllm exit")
    unheld = UnheldPause()
    try:
        while True:
            done, _ = await asyncio.wait({died}, timeout=period)
            if done:
                log.error("vLLM exited with code %s; last lines:\n%s", vllm.returncode, vllm.tail())
                await announce(client, ctx.keys, "vllm", "vllm died", worker=worker_id, code=vllm.returncode)
                return EXIT_VLLM_DIED
            entry = await read_record(client, registry, worker_id)
            if entry is None:
                if registry != ctx.keys.workers or not await _rejoin(ctx, client, session, record):
                    log.error(
                        "worker %s was evicted (a weight update failed on it); exiting to be restarted", worker_id
                    )
                    return EXIT_EVICTED
                continue
            if registry != ctx.keys.workers:
                continue  # an eval worker's version is the evaluator's to set
            current = await current_version(client, ctx.keys)
            if current is not None and (entry.weight_version is None or current > entry.weight_version):
                # A publish finished without driving us (it started before we registered).
                await follow_current(ctx, client, session, worker_id, record.url)
            await unheld.look(ctx, client, session, worker_id, record.url)
    finally:
        await cancel_and_join(died, 5.0, "the worker's watch of its vLLM server")


__all__ = ["TINY_MODELS", "main", "vllm_command", "vllm_env", "worker_vllm"]
