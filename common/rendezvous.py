"""Rendezvous: every process of an experiment finds the one Redis through the shared meet directory.

The first process to create the generation's lock file with O_EXCL is the leader: it starts
`redis-server` (loopback by default, a free port, a random password, an append-only file in the meet
dir) and writes `redis.json` atomically (mode 0600). Everyone else waits for that file and connects. A
file that points at a dead server (connection refused and, on the same host, a dead pid) starts the
next generation's election, so exactly one process replaces a dead Redis. The leader stops its server
when it exits; the server also dies with the leader (PR_SET_PDEATHSIG), so nothing outlives a run.

A server that dies under a live leader (killed, OOM) is started again by the leader at once, on the same
port with the same password, and reads the run's state back from its append-only file (Redis hands each
write to the OS before it answers, so a killed server loses nothing it acknowledged; the file is not
fsynced, so a crash of the machine itself can lose the tail). Clients retry a lost connection for about
REDIS_RETRY_S, so every role rides through the restart without noticing more than a slow command.
The TTL liveness keys every role keeps alive are common/heartbeat.py's.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
import subprocess
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import psutil
import redis
import redis.asyncio
import redis.asyncio.retry
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.typing import StreamRangeResponse

from common.config import RendezvousConfig
from common.net import AddressError, advertised, free_port, refuses
from common.proc import die_with_parent

log = logging.getLogger(__name__)

INSTALL_HINT = "install it: apt-get install -y redis-server (Debian/Ubuntu), or set rendezvous.redis_server"
# The meet dir may be a shared filesystem where inotify sees nothing, so waiting for another
# process's file is a short poll; this is its period.
_POLL_S = 0.05
# Every role's liveness key, in every experiment of this Redis (common/keys.py's Keys.role_alive).
ROLE_ALIVE_PATTERN = "ss:*:role:*:alive"
# How long a client keeps retrying a lost connection (a restarted server is back well within it).
REDIS_RETRY_S = 8.0
# A stopping process's best-effort Redis writes (deregistering, its "down" event, deleting its liveness key)
# give up after this, each: when Redis went with the launcher that ran it, a stop must not wait out the retries.
STOP_WRITE_S = 2.0
_BACKOFF_CAP_S = 0.5
_RETRIES = int(REDIS_RETRY_S / _BACKOFF_CAP_S) + 5


def _backoff() -> ExponentialBackoff:
    return ExponentialBackoff(cap=_BACKOFF_CAP_S, base=0.02)


def text(reply: bytes | str) -> str:
    """A Redis reply as text: our clients decode replies (`decode_responses`), which redis-py's types cannot
    know, so they say bytes | str."""
    return reply.decode() if isinstance(reply, bytes) else reply


def entries(reply: StreamRangeResponse | None) -> list[tuple[str, dict[str, str]]]:
    """An XRANGE / XREVRANGE reply (or one stream's entries in an XREAD reply) as (id, fields) text."""
    return [(text(i or ""), {text(k): text(v) for k, v in (f or {}).items()}) for i, f in reply or []]


class RendezvousError(RuntimeError):
    """Redis could not be found or started; the message says what was tried and what to do."""


@dataclass(frozen=True)
class RedisInfo:
    """What redis.json holds: where the experiment's Redis is and who started it."""

    host: str
    port: int
    password: str
    pid: int
    hostname: str
    started_at: float
    generation: int
    stopped: bool = False

    def _options(self, timeout_s: float) -> dict[str, Any]:
        """Where the server is and how long to wait for it: the same for the sync and the async client."""
        return {
            "host": self.host,
            "port": self.port,
            "password": self.password,
            "socket_connect_timeout": timeout_s,
            "socket_timeout": timeout_s,
            "decode_responses": True,
        }

    def client(self, timeout_s: float = 5.0, retry: bool = True) -> redis.Redis:
        """A client that retries a lost connection for about REDIS_RETRY_S (`retry=False`: fails at once,
        for probes that ask whether the server is there)."""
        return redis.Redis(**self._options(timeout_s), retry=Retry(_backoff(), _RETRIES if retry else 0))

    def async_client(self, timeout_s: float = 5.0) -> redis.asyncio.Redis:
        """The asyncio twin of `client`, with the same retries, on connections that keep their task's cancel."""
        client = redis.asyncio.Redis(**self._options(timeout_s), retry=redis.asyncio.retry.Retry(_backoff(), _RETRIES))
        client.connection_pool.connection_class = CancelKeepingConnection  # the pool has made no connection yet
        return client


class CancelKeepingConnection(redis.asyncio.Connection):
    """A connection that does not lose its task's cancel. With a socket timeout, redis-py writes each command
    under `asyncio.wait_for`, and Python 3.11's wait_for drops a cancel that arrives as the write finishes
    (CPython gh-86296): the task then ran on as if never cancelled (a role that ignored its SIGTERM, a trainer
    rank that never ended; bench/RESULTS.md). A cancel asked for during the write that did not come out of it
    is raised here, after closing the connection, whose reply is then never read (as redis-py does for a
    cancel it lets through)."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        task = asyncio.current_task()
        asked = task.cancelling() if task is not None else 0
        await super().send_packed_command(command, check_health)
        if task is not None and task.cancelling() > asked:
            await self.disconnect(nowait=True)
            raise asyncio.CancelledError


def _lock_path(meet: Path, generation: int) -> Path:
    return meet / ("redis.lock" if generation == 1 else f"redis.lock.{generation}")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        return None  # a lock file being written right now; redis.json is always replaced atomically


def _pid_dead(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


class Rendezvous:
    """Connects this process to the experiment's Redis, electing and starting it when needed."""

    def __init__(self, meet_dir: str | os.PathLike[str], cfg: RendezvousConfig | None = None) -> None:
        self.meet = Path(meet_dir)
        self.cfg = cfg or RendezvousConfig()
        self.info: RedisInfo | None = None
        self._server: subprocess.Popen[bytes] | None = None
        self._closing = threading.Event()

    @property
    def is_leader(self) -> bool:
        return self._server is not None

    # -- public ------------------------------------------------------------------------------

    def connect(self, timeout_s: float | None = None, elect: bool = True) -> redis.Redis:
        """Return a client of the experiment's Redis, starting it if this process wins the election
        (`elect=False`: never start it, only wait for one)."""
        self._prepare_meet_dir()
        deadline = time.monotonic() + (self.cfg.wait_timeout_s if timeout_s is None else timeout_s)
        generation = 1
        last_state = "no redis.json yet"
        while True:
            data = _read_json(self.meet / "redis.json")
            if data is not None:
                info = RedisInfo(**data)
                state = self._probe(info)
                if state == "ok":
                    self.info = info
                    return info.client()
                last_state = f"redis.json generation {info.generation} points at a {state} server"
                if state == "dead":
                    generation = max(generation, info.generation + 1)
            if elect and (data is None or generation > data.get("generation", 0)):
                outcome = self._try_elect(generation)
                if outcome == "won":
                    assert self.info is not None
                    return self.info.client()
                if outcome == "failed":
                    generation += 1
                    continue
            if time.monotonic() > deadline:
                raise RendezvousError(
                    f"no Redis in meet dir {self.meet} after waiting: {last_state}. Is the leader still "
                    f"starting? Check {self.meet}/redis.log, or remove {self.meet} if the run is over."
                )
            time.sleep(_POLL_S)

    def live_server(self) -> RedisInfo | None:
        """The experiment's Redis named in the meet dir if it answers (the run is alive), else None."""
        data = _read_json(self.meet / "redis.json")
        if data is None:
            return None
        info = RedisInfo(**data)
        return info if self._probe(info) == "ok" else None

    def async_client(self) -> redis.asyncio.Redis:
        if self.info is None:
            raise RendezvousError("Rendezvous.async_client() called before connect()")
        return self.info.async_client()

    def close(self) -> None:
        """Stop the Redis server if this process started it (idempotent), once the other processes
        connected to it have gone or `leader_linger_s` has passed."""
        self._closing.set()
        server, self._server = self._server, None
        if server is None:
            return
        if self.info is not None:
            self._wait_for_other_clients(self.info, self.cfg.leader_linger_s)
            with contextlib.suppress(OSError):
                _write_atomic(self.meet / "redis.json", json.dumps(asdict(self.info) | {"stopped": True}))
        server.terminate()
        try:
            server.wait(timeout=5)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.info("stopped redis-server pid %d", server.pid)

    # -- internals ---------------------------------------------------------------------------

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
                time.sleep(_POLL_S)
        except redis.RedisError as exc:
            log.warning("cannot list Redis clients before stopping the server (%s); stopping it now", exc)
        finally:
            client.close()

    def _prepare_meet_dir(self) -> None:
        self.meet.mkdir(parents=True, exist_ok=True, mode=0o700)
        if self.meet.stat().st_uid == os.getuid():
            os.chmod(self.meet, 0o700)

    def _probe(self, info: RedisInfo) -> str:
        """'ok' if the server answers PING with our password, 'dead' if provably gone, else 'unreachable'."""
        if info.stopped:
            return "dead"
        try:
            with contextlib.closing(info.client(timeout_s=2.0, retry=False)) as client:
                client.ping()
            return "ok"
        except redis.AuthenticationError as exc:
            raise RendezvousError(
                f"the Redis at {info.host}:{info.port} named in {self.meet}/redis.json rejects its password "
                f"({exc}); another server took the port. Remove {self.meet}/redis.json to re-elect."
            ) from None
        except (redis.ConnectionError, redis.TimeoutError):
            pass
        if not refuses(info.host, info.port):
            return "unreachable"
        if info.hostname == socket.gethostname() and not _pid_dead(info.pid):
            return "unreachable"
        return "dead"

    def _try_elect(self, generation: int) -> str:
        """'won' (this process now runs Redis), 'failed' (that generation's leader died), or 'wait'."""
        lock = _lock_path(self.meet, generation)
        try:
            fd = os.open(lock, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            owner = _read_json(lock)
            if owner and owner["hostname"] == socket.gethostname() and _pid_dead(owner["pid"]):
                return "failed"
            return "wait"
        with os.fdopen(fd, "w") as fh:
            json.dump({"pid": os.getpid(), "hostname": socket.gethostname(), "ts": time.time()}, fh)
        self._start_server(generation)
        return "won"

    def _start_server(self, generation: int) -> None:
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
        previous = _read_json(self.meet / "redis.json") or {}
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
            _write_atomic(conf, "\n".join(lines) + "\n")
            server = subprocess.Popen(
                [binary, str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
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
                atexit.register(self.close)
                _write_atomic(self.meet / "redis.json", json.dumps(asdict(info)))
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
                return
            server.kill()
            server.wait()
            if self.cfg.redis_port:
                break
            log.warning("redis-server did not come up on port %d (attempt %d); trying another port", port, attempt + 1)
        tail = ""
        with contextlib.suppress(OSError):
            tail = (self.meet / "redis.log").read_text()[-2000:]
        raise RendezvousError(f"redis-server failed to start on {host} (see {self.meet}/redis.log):\n{tail}")

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
            restarted = subprocess.Popen(
                [binary, str(conf)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=die_with_parent,
            )
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
            _write_atomic(self.meet / "redis.json", json.dumps(asdict(info)))
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
                    time.sleep(_POLL_S)
        return False
