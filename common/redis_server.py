"""The rendezvous leader's redis-server: written a config in the meet dir (the password in a 0600 file,
not on the command line), started on a free port (or the configured one, or the last generation's), and
started again on the same port with the same password whenever it dies while the leader lives: it reads
the run's state back from its append-only file (Redis hands each write to the OS before it answers, so a
killed server loses nothing it acknowledged; the file is not fsynced, so a crash of the machine itself can
lose the tail). The server dies with the leader (PR_SET_PDEATHSIG); the leader stops it once the others
have left. Which process leads is common/rendezvous.py's election.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import psutil
import redis

from common.config import RendezvousConfig
from common.net import AddressError, advertised, free_port
from common.proc import die_with_parent
from common.redis_client import POLL_S, RedisInfo, RendezvousError, read_json, write_atomic

log = logging.getLogger(__name__)

INSTALL_HINT = "install it: apt-get install -y redis-server (Debian/Ubuntu), or set rendezvous.redis_server"
# Every role's liveness key, in every experiment of this Redis (common/keys.py's Keys.role_alive).
ROLE_ALIVE_PATTERN = "ss:*:role:*:alive"


class RedisServer:
    """One redis-server child of this process, and the thread that starts it again when it dies."""

    def __init__(self, meet: Path, cfg: RendezvousConfig) -> None:
        self.meet, self.cfg = meet, cfg
        self.info: RedisInfo | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._closing = threading.Event()

    def start(self, generation: int) -> RedisInfo:
        """Start the server of this election generation and write redis.json (RendezvousError if it cannot)."""
        binary = shutil.which(self.cfg.redis_server)
        if binary is None:
            raise RendezvousError(f"redis-server binary {self.cfg.redis_server!r} not found on PATH; {INSTALL_HINT}")
        host = self.cfg.bind_host
        try:
            advertise = advertised(host, self.cfg.advertise_host, None, "rendezvous.advertise_host")
        except AddressError as exc:
            raise RendezvousError(str(exc)) from None
        # A re-election (the last leader died with its server) keeps the address and password where it can:
        # the others' clients then reconnect by themselves, to the state the append-only file kept.
        previous = read_json(self.meet / "redis.json") or {}
        password = previous.get("password") or secrets.token_hex(24)
        for attempt in range(3):
            port = self.cfg.redis_port or (attempt == 0 and previous.get("port")) or free_port(host)
            conf = self.meet / "redis.conf"
            lines = [
                f"bind {host}",
                f"port {port}",
                f"requirepass {password}",
                f"dir {self.meet}",
                f"logfile {self.meet / 'redis.log'}",
                "daemonize no",
                "protected-mode yes",
            ]
            if self.cfg.redis_persistence:
                # appendfsync no: Redis still hands every write to the OS before it answers, which is all a
                # killed server needs; an fsync schedule would only guard against a crash of the machine, and
                # under heavy disk load Redis delays its answers behind a slow fsync by up to 2 s, longer
                # than a short heartbeat TTL.
                lines += ['save ""', "appendonly yes", "appendfsync no"]
            else:
                lines += ['save ""', "appendonly no"]
            # The password lives in a 0600 file, not on the command line where `ps` would show it.
            write_atomic(conf, "\n".join(lines) + "\n")
            server = _spawn(binary, conf)
            info = RedisInfo(
                host=advertise,
                port=port,
                password=password,
                pid=server.pid,
                hostname=socket.gethostname(),
                started_at=time.time(),
                generation=generation,
            )
            if self._wait_ready(server, info):
                self._server, self.info = server, info
                write_atomic(self.meet / "redis.json", json.dumps(asdict(info)))
                log.info(
                    "started redis-server pid %d on %s:%d, advertised as %s (generation %d)",
                    server.pid,
                    host,
                    port,
                    advertise,
                    generation,
                )
                # The supervisor forks the restarted servers: their parent-death signal follows its thread,
                # which lives as long as they do.
                threading.Thread(
                    target=self._supervise, args=(binary, conf), daemon=True, name="redis-supervisor"
                ).start()
                return info
            server.kill()
            server.wait()
            if self.cfg.redis_port:
                break
            log.warning("redis-server did not come up on port %d (attempt %d); trying another port", port, attempt + 1)
        tail = ""
        with contextlib.suppress(OSError):
            tail = (self.meet / "redis.log").read_text()[-2000:]
        raise RendezvousError(f"redis-server failed to start on {host} (see {self.meet}/redis.log):\n{tail}")

    def stop(self) -> None:
        """Stop the server (idempotent), once the other processes connected to it have gone or
        `leader_linger_s` has passed."""
        self._closing.set()
        server, self._server = self._server, None
        if server is None:
            return
        if self.info is not None:
            self._wait_for_other_clients(self.info, self.cfg.leader_linger_s)
            with contextlib.suppress(OSError):
                write_atomic(self.meet / "redis.json", json.dumps(asdict(self.info) | {"stopped": True}))
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.info("stopped redis-server pid %d", server.pid)

    def _supervise(self, binary: str, conf: Path) -> None:
        """Start the server again whenever it dies while this leader lives (see the module docstring)."""
        while True:
            server = self._server
            if server is None:
                return
            code = server.wait()
            if self._closing.is_set() or self._server is not server or self.info is None:
                return
            t0 = time.monotonic()
            restarted = _spawn(binary, conf)
            info = replace(self.info, pid=restarted.pid, started_at=time.time())
            if not self._wait_ready(restarted, info):
                restarted.kill()
                restarted.wait()
                log.error(
                    "redis-server pid %d died (exit code %d) and could not be started again on port %d (see "
                    "%s/redis.log); the experiment's processes will lose Redis",
                    server.pid,
                    code,
                    info.port,
                    self.meet,
                )
                return
            if self._closing.is_set():
                restarted.terminate()
                restarted.wait()
                return
            self._server, self.info = restarted, info
            write_atomic(self.meet / "redis.json", json.dumps(asdict(info)))
            log.warning(
                "redis-server pid %d died (exit code %d): started it again as pid %d on port %d from its "
                "append-only file in %.2fs",
                server.pid,
                code,
                restarted.pid,
                info.port,
                time.monotonic() - t0,
            )

    @staticmethod
    def _wait_for_other_clients(info: RedisInfo, timeout_s: float) -> None:
        """Wait until every connection to Redis comes from this process (its own sockets, matched by
        address) and no role's liveness key is left, so a peer that is still ending (announcing `down`,
        deleting its heartbeat: the last thing a role writes) keeps its Redis even between two of its
        connections; give up after timeout_s with a warning naming who is still there."""
        deadline = time.monotonic() + timeout_s
        said = False
        client = info.client(retry=False)
        try:
            client.ping()  # open this connection first, so it counts among this process's own
            while True:
                mine = {f"{c.laddr.ip}:{c.laddr.port}" for c in psutil.Process().net_connections("tcp") if c.laddr}
                others = sorted(c["addr"] for c in client.client_list() if c["addr"] not in mine)
                others += sorted(client.scan_iter(match=ROLE_ALIVE_PATTERN, count=1000))
                if not others:
                    return
                if time.monotonic() > deadline:
                    log.warning(
                        "stopping redis-server although %d client(s) or role(s) are still there after %.1fs: %s",
                        len(others),
                        timeout_s,
                        ", ".join(others),
                    )
                    return
                if not said:
                    log.info(
                        "waiting up to %.1fs for %d other client(s) to leave Redis before stopping it",
                        timeout_s,
                        len(others),
                    )
                    said = True
                time.sleep(POLL_S)
        except redis.RedisError as exc:
            log.warning("cannot list Redis clients before stopping the server (%s); stopping it now", exc)
        finally:
            client.close()

    @staticmethod
    def _wait_ready(server: subprocess.Popen[bytes], info: RedisInfo, timeout_s: float = 10.0) -> bool:
        deadline = time.monotonic() + timeout_s
        with contextlib.closing(info.client(timeout_s=1.0, retry=False)) as client:
            while time.monotonic() < deadline:
                if server.poll() is not None:
                    return False
                try:
                    client.ping()
                    return True
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(POLL_S)
        return False


def _spawn(binary: str, conf: Path) -> subprocess.Popen[bytes]:
    """redis-server on its config file, silent, dying with this process (the first start and every restart)."""
    return subprocess.Popen(
        [binary, str(conf)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
