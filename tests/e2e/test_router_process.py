"""The router as its role process (`ROLE=router python -m common.runs.cli run CFG`): it publishes its URL
in Redis, serves through it, refuses to start a second time under the same name while naming the
running one, withdraws its URL when stopped by SIGTERM, and, restarted after a kill -9, takes its name
over from its dead predecessor at once."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.config import RendezvousConfig
from common.keys import Keys
from common.rendezvous import Rendezvous
from tests.support.fake_openai import start_backends, start_router_process, token, wait_published

EXP = "routerproc"


@pytest.fixture
def rz(tmp_path: Path) -> Iterator[Rendezvous]:
    rz = Rendezvous(tmp_path / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    yield rz
    rz.close()


def router_config(tmp_path: Path, period_s: float, ttl_s: float) -> Path:
    """The config of router 'main' with the given heartbeat period and TTL."""
    config = tmp_path / "router.toml"
    config.write_text(
        f'[run]\nname = "rp"\nroot = "{tmp_path / "runs"}"\n'
        f"[rendezvous]\nheartbeat_period_s = {period_s}\nheartbeat_ttl_s = {ttl_s}\n"
        '[router]\nname = "main"\nhealth_interval_s = 0.2\npolicy = "least_outstanding"\n'
    )
    return config


def start_router(config: Path, meet: Path) -> subprocess.Popen[str]:
    return start_router_process(config, meet, EXP, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_router_role_publishes_serves_refuses_a_duplicate_and_withdraws(rz: Rendezvous, tmp_path: Path):
    config = router_config(tmp_path, period_s=0.2, ttl_s=1.0)
    (backend,) = start_backends(["w0"], rz.meet, EXP)
    redis = rz.info.client()  # type: ignore[union-attr]
    key = Keys(EXP).router("main")
    first = start_router(config, rz.meet)
    try:
        url = wait_published(first, redis, key)
        request = urllib.request.Request(
            url + "/v1/completions", data=json.dumps({"prompt": "p"}).encode(), method="POST", headers=token(rz.meet)
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.loads(resp.read())["worker"] == "w0"

        second = start_router(config, rz.meet)
        _, err = second.communicate(timeout=30)
        assert second.returncode == 2
        assert f"router 'main' of experiment {EXP} is already running at {url}" in err
        assert redis.get(key) == url

        first.send_signal(signal.SIGTERM)
        first.wait(timeout=15)
        assert first.returncode == 128 + signal.SIGTERM
        assert redis.get(key) is None
    finally:
        if first.poll() is None:
            first.kill()
        first.communicate()
        backend.stop()
        redis.close()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_router_restarted_after_kill_9_takes_over_its_name_before_the_dead_claim_expires(rz, tmp_path):
    """The launcher restarts a killed router at once; its name claim must not wait out the heartbeat TTL
    (10 s here): the dead holder's address refuses connections, which proves it dead."""
    config = tmp_path / "router.toml"
    config.write_text(
        f'[run]\nname = "rp"\nroot = "{tmp_path / "runs"}"\n'
        "[rendezvous]\nheartbeat_period_s = 2.0\nheartbeat_ttl_s = 10.0\n"
        '[router]\nname = "main"\nhealth_interval_s = 0.2\npolicy = "least_outstanding"\n'
    )
    (backend,) = start_backends(["w0"], rz.meet, EXP)
    redis = rz.info.client()  # type: ignore[union-attr]
    key = Keys(EXP).router("main")
    first = start_router(config, rz.meet)
    second = None
    try:
        dead_url = wait_published(first, redis, key)
        first.kill()
        first.wait()
        killed = time.monotonic()
        second = start_router(config, rz.meet)
        while (url := redis.get(key)) == dead_url:
            assert second.poll() is None, second.communicate()[1][-3000:]
            assert time.monotonic() - killed < 8.0, "the restarted router waited for the dead claim to expire"
            time.sleep(0.05)
        took = time.monotonic() - killed
        assert url is not None and url != dead_url
        request = urllib.request.Request(
            url + "/v1/completions", data=json.dumps({"prompt": "p"}).encode(), method="POST", headers=token(rz.meet)
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            assert json.loads(resp.read())["worker"] == "w0"
        second.send_signal(signal.SIGTERM)
        _, err = second.communicate(timeout=15)
        assert f"the previous holder at {dead_url} refuses connections (dead); taking over its name" in err
        print(f"restarted router took over the name {took:.2f} s after the kill (TTL 10 s)")
    finally:
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
        backend.stop()
        redis.close()
