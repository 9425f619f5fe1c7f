"""Rendezvous against a real redis-server: one leader among racing processes, re-election after the
server dies, password enforcement, and no server left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import redis

from common.config import RendezvousConfig
from common.redis_client import RedisInfo, RendezvousError
from common.rendezvous import Rendezvous

CHILD = r"""
import json, sys, time
from common.rendezvous import Rendezvous
rz = Rendezvous(sys.argv[1])
t0 = time.monotonic()
client = rz.connect(timeout_s=30)
connect_s = time.monotonic() - t0
client.incr("joined")
print(json.dumps({"leader": rz.is_leader, "port": rz.info.port, "generation": rz.info.generation,
                  "connect_s": connect_s}), flush=True)
sys.stdin.read()  # hold the connection (and, for the leader, the server) until the test closes stdin
rz.close()
"""


def redis_servers_of(meet: Path) -> list[psutil.Process]:
    """redis-server processes of this meet dir (the server rewrites its title, but works in the meet dir)."""
    found = []
    for proc in psutil.process_iter(["name"]):
        try:
            if "redis" in (proc.info["name"] or "") and Path(proc.cwd()) == meet:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def start_child(meet: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, str(meet)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )


def read_report(child: subprocess.Popen[str]) -> dict:
    assert child.stdout is not None
    line = child.stdout.readline()
    assert line, f"child {child.pid} exited without connecting (code {child.wait()})"
    return json.loads(line)


def info_of(meet: Path) -> RedisInfo:
    return RedisInfo(**json.loads((meet / "redis.json").read_text()))


@pytest.mark.timeout(120)
def test_racing_processes_elect_one_leader_and_reelect_after_server_death(tmp_path):
    meet = tmp_path / "meet"
    children = [start_child(meet) for _ in range(8)]
    try:
        reports = [read_report(c) for c in children]
        assert sum(r["leader"] for r in reports) == 1
        assert len({r["port"] for r in reports}) == 1
        info = info_of(meet)
        assert oct(meet.stat().st_mode & 0o777) == "0o700"
        assert oct((meet / "redis.json").stat().st_mode & 0o777) == "0o600"
        assert info.host == "127.0.0.1"
        assert len(redis_servers_of(meet)) == 1
        with info.client() as client:
            assert int(client.get("joined")) == 8

        # A client with a wrong password, or none, is refused.
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=info.port, password="wrong", socket_timeout=2).ping()
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            redis.Redis(port=info.port, socket_timeout=2).ping()

        # Kill the leader: its server dies with it. A newcomer finds it dead and becomes the next
        # generation's leader, on the same port with the same password, with the state of the append-only file.
        leader = children[[r["leader"] for r in reports].index(True)]
        leader.kill()
        leader.wait()
        start = time.monotonic()
        newcomer = start_child(meet)
        children.append(newcomer)
        report = read_report(newcomer)
        elapsed = time.monotonic() - start
        assert report["leader"] and report["generation"] == 2
        # The election itself (finding the server dead, taking the next lock, starting redis-server);
        # the newcomer's interpreter start-up comes on top and varies with the machine's load.
        assert report["connect_s"] < 5.0, f"re-election took {report['connect_s']:.1f}s"
        assert elapsed < 30.0, f"a newcomer took {elapsed:.1f}s to start and take over"
        assert info_of(meet).pid != info.pid and info_of(meet).port == info.port
        with info.client() as old_client:  # the address every process already had still works
            assert int(old_client.get("joined")) == 9
    finally:
        for child in children:
            if child.poll() is None:
                child.stdin.close()  # type: ignore[union-attr]
        for child in children:
            child.wait(timeout=30)
    # Every leader stopped its server at exit.
    deadline = time.monotonic() + 5
    while redis_servers_of(meet) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert redis_servers_of(meet) == []


@pytest.mark.timeout(60)
def test_a_killed_server_is_started_again_by_its_leader_with_the_runs_state(tmp_path):
    """The leader lives, its redis-server is SIGKILLed: a client keeps working across the restart (it retries
    the lost connection) and finds every key it wrote, heartbeat TTLs included."""
    rz = Rendezvous(tmp_path / "meet")
    client = rz.connect(timeout_s=30)
    try:
        client.set("state", "kept")
        client.set("alive", "1", ex=60)
        client.xadd("log", {"version": 7})
        old = info_of(tmp_path / "meet")
        os.kill(old.pid, signal.SIGKILL)
        t0 = time.monotonic()
        assert client.get("state") == "kept"  # the first command after the kill: reconnects by itself
        took = time.monotonic() - t0
        assert 0 < client.ttl("alive") <= 60 and client.xrange("log")[0][1] == {"version": "7"}
        deadline = time.monotonic() + 5  # the leader rewrites redis.json once the server answers
        while (new := info_of(tmp_path / "meet")).pid == old.pid and time.monotonic() < deadline:
            time.sleep(0.05)
        assert new.pid != old.pid and (new.port, new.password, new.generation) == (old.port, old.password, 1)
        assert psutil.Process(new.pid).is_running() and took < 5.0, took
    finally:
        client.close()
        rz.close()
    assert redis_servers_of(tmp_path / "meet") == []


@pytest.mark.timeout(60)
def test_server_dies_with_a_killed_leader(tmp_path):
    meet = tmp_path / "meet"
    leader = start_child(meet)
    try:
        assert read_report(leader)["leader"]
        server_pid = info_of(meet).pid
        leader.kill()  # SIGKILL: no atexit, no cleanup code runs
        leader.wait()
        assert psutil.Process(server_pid).wait(timeout=5) is not None or not psutil.pid_exists(server_pid)
    finally:
        if leader.poll() is None:
            leader.kill()
    assert redis_servers_of(meet) == []


@pytest.mark.timeout(60)
def test_stale_lock_of_a_dead_candidate_moves_the_election_on(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir(mode=0o700)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    # A candidate won generation 1 and died before writing redis.json.
    import socket

    (meet / "redis.lock").write_text(json.dumps({"pid": dead.pid, "hostname": socket.gethostname(), "ts": 0}))
    rz = Rendezvous(meet)
    try:
        client = rz.connect(timeout_s=10)
        assert client.ping() and rz.is_leader and rz.info is not None and rz.info.generation == 2
    finally:
        rz.close()


@pytest.mark.timeout(60)
def test_follower_times_out_with_a_message_when_no_leader_appears(tmp_path):
    meet = tmp_path / "meet"
    meet.mkdir(mode=0o700)
    import socket

    # A live candidate (this test process) holds the lock but never writes redis.json.
    (meet / "redis.lock").write_text(json.dumps({"pid": os.getpid(), "hostname": socket.gethostname(), "ts": 0}))
    start = time.monotonic()
    with pytest.raises(RendezvousError, match=r"no Redis in meet dir .* after waiting"):
        Rendezvous(meet).connect(timeout_s=1.0)
    assert time.monotonic() - start < 5


def test_missing_redis_binary_prints_the_install_command(tmp_path):
    rz = Rendezvous(tmp_path / "meet", RendezvousConfig(redis_server="no-such-redis-server"))
    with pytest.raises(RendezvousError, match=r"apt-get install -y redis-server"):
        rz.connect(timeout_s=5)


@pytest.mark.timeout(60)
def test_clean_shutdown_lets_a_later_process_start_a_new_server(tmp_path):
    meet = tmp_path / "meet"
    first = Rendezvous(meet)
    first.connect()
    first.close()
    second = Rendezvous(meet)
    try:
        assert second.connect(timeout_s=10).ping()
        assert second.is_leader and second.info is not None and second.info.generation == 2
    finally:
        second.close()


PEER = r"""
import sys
import threading
from common.rendezvous import Rendezvous
client = Rendezvous(sys.argv[1]).connect(timeout_s=30)
client.ping()  # a client connects lazily: make the connection now
print("connected", flush=True)
sys.stdin.read()  # the test says when this peer ends
client.set("last-words", "written")  # a peer's last write, after the leader was asked to stop
"""


@pytest.mark.timeout(60)
def test_the_leader_keeps_redis_until_a_peer_still_ending_has_disconnected(tmp_path):
    """torchrun starts trainer ranks together and any of them may win the election; the winner can
    end first and must not take Redis away from a peer that still writes its last state."""
    meet = tmp_path / "meet"
    leader = Rendezvous(meet, RendezvousConfig(leader_linger_s=30))
    probe = leader.connect()
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(meet)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert peer.stdout is not None and peer.stdout.readline() == "connected\n"
        closing = threading.Thread(target=leader.close)
        closing.start()
        closing.join(timeout=1.0)
        assert closing.is_alive(), "the leader stopped Redis while a peer was still connected"
        assert peer.stdin is not None
        peer.stdin.close()
        assert peer.wait(timeout=20) == 0, "the peer's last write failed"
        closing.join(timeout=10)
        assert not closing.is_alive(), "the leader still waits after its peer left"
        assert redis_servers_of(meet) == []
    finally:
        if peer.poll() is None:
            peer.kill()
        probe.close()


@pytest.mark.timeout(60)
def test_the_leader_stops_redis_after_leader_linger_s_when_a_peer_stays(tmp_path):
    meet = tmp_path / "meet"
    leader = Rendezvous(meet, RendezvousConfig(leader_linger_s=0.5))
    leader.connect()
    peer = subprocess.Popen(
        [sys.executable, "-c", PEER, str(meet)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert peer.stdout is not None and peer.stdout.readline() == "connected\n"
        started = time.monotonic()
        leader.close()
        took = time.monotonic() - started
        assert 0.5 <= took < 10, f"close took {took:.2f} s with leader_linger_s = 0.5"
        assert redis_servers_of(meet) == []
    finally:
        peer.kill()
        peer.wait()


def test_a_process_that_may_not_elect_waits_for_a_leader_and_never_starts_redis(tmp_path):
    """Trainer ranks other than 0 started torchrun-style connect with elect=False (rank 0 holds Redis)."""
    meet = tmp_path / "meet"
    with pytest.raises(RendezvousError, match="no Redis in meet dir"):
        Rendezvous(meet).connect(timeout_s=1.0, elect=False)
    assert redis_servers_of(meet) == [] and not (meet / "redis.json").exists()
    leader = Rendezvous(meet)
    leader.connect()
    try:
        follower = Rendezvous(meet)
        assert follower.connect(timeout_s=10, elect=False).ping() and not follower.is_leader
    finally:
        leader.close()
