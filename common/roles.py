"""Role dispatch and the per-process run context.

`slipstream run` resolves the experiment id, run dir and meet dir, connects to the experiment's
Redis (electing and starting it if this process is first), then runs the role named by ROLE inside
one event loop, wrapped in its lifecycle: a liveness heartbeat and `role up` / `role down` events.
SIGTERM and SIGINT cancel the role's task, so its cleanup (deregistering, stopping children) runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis
import redis.asyncio
from redis.asyncio import Redis as AsyncRedis
from redis.typing import EncodableT, FieldT

from common.config import ROLES, Config
from common.heartbeat import Heartbeat
from common.keys import Keys
from common.redis_client import STOP_WRITE_S
from common.rendezvous import Rendezvous
from common.run_secrets import apply_secrets, ensure_secrets

log = logging.getLogger(__name__)

# role -> "module:function"; the function is `async def main(ctx: RunContext) -> int`.
ROLE_MAINS = {
    "trainer": "trainer.role:main",
    "vllm": "rollout.worker:main",
    "router": "router.server:main",
    "evaluator": "evaluator.role:main",
}
EVENTS_MAXLEN = 10_000
# The experiment id of a run dir, written by its first launch: `--resume RUN_DIR` and the dashboard read it.
RUN_FILE = "run.json"
# The trainer's end-of-run report (table and summary) in the run dir; the launcher's console prints it.
REPORT_FILE = "report.txt"


class RoleError(RuntimeError):
    """ROLE is missing, unknown, or names a role this checkout does not contain."""


def new_exp_id(name: str) -> str:
    """A fresh experiment id: the run name plus a short random suffix."""
    return f"{name}-{secrets.token_hex(3)}"


def resolve_exp(cfg: Config, environ: Mapping[str, str]) -> str:
    """SLIPSTREAM_EXP when set (the launcher and scripts set it), else the config's run.name."""
    return environ.get("SLIPSTREAM_EXP") or cfg.run.name


def resolve_run_dir(cfg: Config, exp: str) -> Path:
    return Path(cfg.run.dir) if cfg.run.dir else Path(cfg.run.root) / exp


def resolve_meet_dir(cfg: Config, run_dir: Path, environ: Mapping[str, str]) -> Path:
    return Path(environ.get("SLIPSTREAM_MEET_DIR") or cfg.rendezvous.meet_dir or run_dir / "meet")


@dataclass
class RunContext:
    """What a role needs to know about the run it belongs to."""

    cfg: Config
    role: str
    exp: str
    run_dir: Path
    meet_dir: Path
    instance: str
    rendezvous: Rendezvous
    keys: Keys
    config_path: str | None = None
    _redis: redis.Redis | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def redis(self) -> redis.Redis:
        """The context's synchronous client (for code outside the event loop; safe to share between threads),
        made on first use and closed by `close()` when the role ends. It rides through a Redis restart on the
        same address by itself (its retries reconnect), so it is never made again for that."""
        if self._redis is None:
            assert self.rendezvous.info is not None
            self._redis = self.rendezvous.info.client()
        return self._redis

    def close(self) -> None:
        """Close the synchronous client, if one was made (the next use of `redis` makes a new one)."""
        client, self._redis = self._redis, None
        if client is not None:
            client.close()

    def async_redis(self) -> AsyncRedis:
        return self.rendezvous.async_client()


def context_for(
    cfg: Config,
    role: str,
    environ: Mapping[str, str] | None = None,
    config_path: str | None = None,
    connect: bool = True,
) -> RunContext:
    """Build the run context of this process and (by default) connect it to the experiment's Redis."""
    env = os.environ if environ is None else environ
    exp = resolve_exp(cfg, env)
    run_dir = resolve_run_dir(cfg, exp)
    run_dir.mkdir(parents=True, exist_ok=True)
    meet = resolve_meet_dir(cfg, run_dir, env)
    replica = env.get("SLIPSTREAM_REPLICA", "0")
    instance = f"{socket.gethostname()}-{os.getpid()}-{replica}"
    # The run's generated tokens stand in for a router.auth_token / rollout.api_key the config leaves empty,
    # so every server of the run asks for one and every client of it sends it.
    apply_secrets(cfg, ensure_secrets(meet))
    rz = Rendezvous(meet, cfg.rendezvous)
    if connect:
        # Trainer ranks started torchrun-style start together, and the one holding Redis stops it when it
        # ends: rank 0, which ends last (it reports the run), must be the one. The other ranks only wait.
        rz.connect(elect=not (role == "trainer" and env.get("RANK", "0") != "0"))
    return RunContext(cfg, role, exp, run_dir, meet, instance, rz, Keys(exp), config_path)


async def announce(client: redis.asyncio.Redis, keys: Keys, role: str, event: str, **detail: object) -> None:
    """Append one lifecycle event to the experiment's events stream."""
    fields: dict[FieldT, EncodableT] = {
        "role": role,
        "event": event,
        "detail": json.dumps(detail),
        "ts": f"{time.time():.3f}",
    }
    await client.xadd(keys.events, fields, maxlen=EVENTS_MAXLEN, approximate=True)


def role_main(role: str) -> Callable[[RunContext], Awaitable[int]]:
    """The entry function of a role, imported lazily so one role never imports another's dependencies."""
    if role not in ROLE_MAINS:
        raise RoleError(f"unknown role {role!r}; set ROLE to one of: {', '.join(ROLES)}")
    module_name, func = ROLE_MAINS[role].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name == module_name:
            raise RoleError(f"role {role!r} needs module {module_name}, which this checkout does not contain") from None
        raise
    return getattr(module, func)


async def lifecycle(ctx: RunContext, main: Callable[[RunContext], Awaitable[int]]) -> int:
    """Run a role's main with a heartbeat and up/down events; SIGTERM/SIGINT cancel it cleanly."""
    client = ctx.async_redis()
    rz = ctx.cfg.rendezvous
    beat = Heartbeat(
        client,
        ctx.keys.role_alive(ctx.role, ctx.instance),
        json.dumps({"pid": os.getpid(), "host": socket.gethostname()}),
        rz.heartbeat_period_s,
        rz.heartbeat_ttl_s,
    )
    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        assert task is not None
        task.cancel()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    await beat.start()
    await announce(client, ctx.keys, ctx.role, "up", instance=ctx.instance, pid=os.getpid())
    log.info("role up (instance %s, run dir %s)", ctx.instance, ctx.run_dir)
    code = 1
    try:
        code = await main(ctx)
    except asyncio.CancelledError:
        if not received:
            raise
        code = 128 + received[0]
        log.info("stopped by %s", signal.Signals(received[0]).name)
    finally:
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(signum)
        try:
            with contextlib.suppress(redis.ConnectionError, redis.TimeoutError, TimeoutError):
                async with asyncio.timeout(STOP_WRITE_S):
                    await announce(client, ctx.keys, ctx.role, "down", instance=ctx.instance, code=code)
            await beat.stop()
        finally:
            ctx.close()
            await client.aclose()
        log.info("role down (exit code %d)", code)
    return code
