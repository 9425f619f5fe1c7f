"""Role dispatch and lifecycle against a real Redis: heartbeat key, up/down events, signals."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import load_config
from common.heartbeat import Heartbeat
from common.roles import RunContext, context_for, lifecycle

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def ctx(tmp_path):
    cfg = load_config(
        None,
        [f"run.root={tmp_path}", "rendezvous.heartbeat_period_s=0.2", "rendezvous.heartbeat_ttl_s=1.0"],
        environ={},
    )
    context = context_for(cfg, "router", environ={"SLIPSTREAM_EXP": "t-roles"})
    yield context
    context.rendezvous.close()


def events(ctx: RunContext) -> list[dict]:
    with ctx.redis as client:
        return [fields | {"detail": json.loads(fields["detail"])} for _, fields in client.xrange(ctx.keys.events)]


@pytest.mark.timeout(30)
def test_lifecycle_heartbeats_and_announces_up_and_down(ctx):
    seen: dict[str, object] = {}

    async def main(c: RunContext) -> int:
        client = c.async_redis()
        seen["alive"] = await client.exists(c.keys.role_alive(c.role, c.instance))
        await asyncio.sleep(0.5)  # longer than two heartbeat periods: the key must still be there
        seen["ttl_ms"] = await client.pttl(c.keys.role_alive(c.role, c.instance))
        await client.aclose()
        return 3

    assert asyncio.run(lifecycle(ctx, main)) == 3
    assert seen["alive"] == 1
    assert 0 < int(seen["ttl_ms"]) <= 1000  # type: ignore[arg-type]
    with ctx.redis as client:
        assert client.exists(ctx.keys.role_alive("router", ctx.instance)) == 0
    evs = events(ctx)
    assert [(e["role"], e["event"]) for e in evs] == [("router", "up"), ("router", "down")]
    assert evs[1]["detail"]["code"] == 3


@pytest.mark.timeout(30)
def test_sigterm_cancels_the_role_and_still_announces_down(ctx):
    cleaned = []

    async def main(c: RunContext) -> int:
        asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGTERM)
        try:
            await asyncio.Event().wait()
        finally:
            cleaned.append(True)
        return 0

    assert asyncio.run(lifecycle(ctx, main)) == 128 + signal.SIGTERM
    assert cleaned == [True]
    assert events(ctx)[-1]["detail"]["code"] == 143


@pytest.mark.timeout(30)
def test_the_sync_client_is_one_per_context_and_its_connection_closes_when_the_role_ends(ctx):
    seen: dict[str, object] = {}

    async def main(c: RunContext) -> int:
        seen["same"] = c.redis is c.redis
        seen["id"] = c.redis.client_id()
        return 0

    assert asyncio.run(lifecycle(ctx, main)) == 0
    assert seen["same"] is True
    assert ctx.rendezvous.info is not None
    with ctx.rendezvous.info.client() as probe:
        assert seen["id"] not in {int(c["id"]) for c in probe.client_list()}


@pytest.mark.timeout(30)
def test_heartbeat_key_expires_when_beats_stop(ctx):
    async def scenario() -> tuple[int, int]:
        client = ctx.async_redis()
        beat = Heartbeat(client, "ss:t-roles:probe", "x", period_s=0.1, ttl_s=0.3)
        await beat.start()
        await asyncio.sleep(0.5)
        alive = await client.exists("ss:t-roles:probe")
        await beat.stop(delete=False)
        await asyncio.sleep(0.5)
        gone = await client.exists("ss:t-roles:probe")
        await client.aclose()
        return alive, gone

    assert asyncio.run(scenario()) == (1, 0)


def test_heartbeat_refuses_a_ttl_shorter_than_two_periods(ctx):
    with pytest.raises(ValueError, match="at least twice"):
        Heartbeat(ctx.async_redis(), "k", "v", period_s=2.0, ttl_s=3.0)


@pytest.mark.parametrize(("role", "message"), [("", "ROLE is not set"), ("wizard", "unknown role 'wizard'")])
def test_run_without_a_valid_role_lists_the_roles(role, message):
    env = {k: v for k, v in os.environ.items() if k != "ROLE"} | ({"ROLE": role} if role else {})
    done = subprocess.run(
        [sys.executable, "-m", "common.runs.cli", "run", "configs/demo.toml"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert message in done.stderr
    assert "trainer, vllm, router, evaluator" in done.stderr
