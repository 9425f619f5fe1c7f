"""Trainer ranks: which of the W trainer processes this one is, the torch.distributed bootstrap, the
control channel from rank 0 to the others, and the watch that ends every rank when one dies.

Two ways to start W ranks, one code path. torchrun, Slurm and Kubernetes set
RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and the group forms through that address.
Our launcher (`[launch.roles.trainer] replicas = W`) sets SLIPSTREAM_REPLICA and SLIPSTREAM_REPLICAS
instead: rank 0 opens a TCPStore and publishes its address under the experiment's `trainer:store`
key, the other ranks read it from Redis. The gradient group is gloo on CPUs and NCCL on GPUs; a gloo
group beside it carries the small Python objects rank 0 sends the others (what to train, publish or
save next), so the control messages never touch the GPUs; its collectives wait
`trainer.parallel.command_timeout_s`, since rank 0 may wait minutes for rollouts between two commands. `RankWatch` polls the other ranks'
liveness (pid on the same host, the role heartbeat otherwise) and names the rank that died.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.distributed as dist

from common.net import serve_store

log = logging.getLogger(__name__)

# How long a rank waits for rank 0's store address and for the whole group to form.
BOOTSTRAP_TIMEOUT_S = 120.0
# How long a finished rank waits for its process group to be destroyed (Ranks.close).
CLOSE_TIMEOUT_S = 10.0
_POLL_S = 0.2


class RankError(RuntimeError):
    """The ranks could not form a group, or one of them died; the message names the rank and the cause."""


@dataclass(frozen=True)
class RankInfo:
    """Where this process stands among the trainer ranks, read from the environment."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    source: str = "single"
    """torchrun (RANK/WORLD_SIZE/...), launcher (SLIPSTREAM_REPLICA/REPLICAS) or single (one rank)."""


def rank_info(environ: Mapping[str, str]) -> RankInfo:
    """This process's rank from torchrun-style variables, else from the launcher's, else rank 0 of 1."""

    def number(name: str) -> int:
        raw = environ[name]
        try:
            return int(raw)
        except ValueError:
            raise RankError(f"environment variable {name}={raw!r} is not an integer") from None

    if "RANK" in environ or "WORLD_SIZE" in environ:
        missing = [n for n in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if n not in environ]
        if missing:
            raise RankError(
                f"torchrun-style start without {', '.join(missing)}: set RANK, WORLD_SIZE, MASTER_ADDR and "
                "MASTER_PORT together (torchrun does), or none of them to start through the launcher"
            )
        info = RankInfo(
            number("RANK"), number("WORLD_SIZE"), number("LOCAL_RANK") if "LOCAL_RANK" in environ else 0, "torchrun"
        )
    elif "SLIPSTREAM_REPLICAS" in environ:
        rank = number("SLIPSTREAM_REPLICA") if "SLIPSTREAM_REPLICA" in environ else 0
        info = RankInfo(rank, number("SLIPSTREAM_REPLICAS"), rank, "launcher")
    else:
        return RankInfo()
    if not 0 <= info.rank < info.world:
        raise RankError(f"rank {info.rank} is outside a world of {info.world} ranks ({info.source} variables)")
    return info


class Ranks:
    """The formed group of this process (or a lone rank without torch.distributed)."""

    def __init__(self, info: RankInfo, device: torch.device, control: dist.ProcessGroup | None) -> None:
        self.rank, self.world, self.local_rank = info.rank, info.world, info.local_rank
        self.info = info
        self.device = device
        self.control = control

    @classmethod
    def single(cls, device: torch.device) -> Ranks:
        return cls(RankInfo(), device, None)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.control is not None

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj`, on every rank (pickled over the gloo control group)."""
        if self.control is None:
            return obj
        box = [obj if self.is_main else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.control, 0), group=self.control)
        return box[0]

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, in rank order, on every rank."""
        if self.control is None:
            return [obj]
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.control)
        return out

    def barrier(self) -> None:
        if self.control is not None:
            dist.barrier(group=self.control)

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> None:
        """Destroy the process group, waiting at most `timeout_s`: a gloo group whose peer has already exited
        can block its teardown until a signal comes, and a role that is done must not hang on it. Past the
        wait the role goes on to exit without it."""
        if not dist.is_initialized():
            return
        closing = threading.Thread(target=dist.destroy_process_group, name="destroy-process-group", daemon=True)
        closing.start()
        closing.join(timeout_s)
        if closing.is_alive():
            log.warning(
                "the process group did not close within %.0fs (a peer left first); exiting without it", timeout_s
            )


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def form_group(
    info: RankInfo,
    device: torch.device,
    store_address: Any = None,
    timeout_s: float = BOOTSTRAP_TIMEOUT_S,
    store_host: str = "127.0.0.1",
    command_timeout_s: float = BOOTSTRAP_TIMEOUT_S,
) -> Ranks:
    """Initialise torch.distributed for `info` (a group of one too: the same path at every size).

    `timeout_s` bounds the bootstrap and the training collectives; the control group (rank 0's commands) is a
    gloo group of its own whose collectives wait `command_timeout_s` (trainer.parallel.command_timeout_s): the
    other ranks wait there while rank 0 waits for rollouts.

    torchrun-style ranks meet at MASTER_ADDR/MASTER_PORT. Launcher ranks need `store_address`, an object
    with `publish(addr: str)` (rank 0) and `wait(timeout_s) -> str` (the others): rank 0 opens the store and
    publishes "store_host:port"; the others connect to what they read. `store_host` is this rank's advertised
    address: rank 0's store listens there only (see `_serve_store`), and gloo and NCCL open their sockets on
    its interface unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME say otherwise.
    """
    env = os.environ
    timeout = datetime.timedelta(seconds=timeout_s)
    backend = _backend(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pin_socket_interface(store_host, os.environ)
    if info.source == "torchrun":
        host, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent serves the store (on every interface: torch offers it no address to bind).
            store = dist.TCPStore(host, port, info.world, is_master=False, timeout=timeout)
        elif info.rank == 0:
            listen = torchrun_listen_host(host)
            if listen is None:
                store = dist.TCPStore(host, port, info.world, is_master=True, timeout=timeout, wait_for_workers=False)
            else:
                store = _serve_store(listen, port, info.world, timeout, "MASTER_ADDR")
        else:
            store = dist.TCPStore(host, port, info.world, is_master=False, timeout=timeout)
    elif info.rank == 0:
        store = _serve_store(store_host, 0, info.world, timeout, "trainer.parallel.store_advertise_host")
        if store_address is not None:
            store_address.publish(f"{store_host}:{store.port}")
    else:
        if store_address is None:
            raise RankError(f"rank {info.rank} of {info.world} has no way to find rank 0's store")
        store = _connect_store(store_address, info, timeout_s)
    dist.init_process_group(backend, store=store, rank=info.rank, world_size=info.world, timeout=timeout)
    control = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=command_timeout_s))
    log.info("trainer rank %d of %d formed its %s group (%s start)", info.rank, info.world, backend, info.source)
    return Ranks(info, device, control)


def _serve_store(host: str, port: int, world: int, timeout: datetime.timedelta, field: str) -> dist.TCPStore:
    """Rank 0's TCPStore, listening on `host` only (common/net.py `serve_store`)."""
    try:
        return serve_store(host, port, world, timeout)
    except OSError as exc:
        raise RankError(
            f"trainer rank 0 cannot listen on {host}:{port} for its process-group store ({exc}); {field} must be "
            "an address of rank 0's own machine"
        ) from None


def torchrun_listen_host(master_addr: str) -> str | None:
    """The address of this machine that MASTER_ADDR names, for rank 0's store to listen on; None (torch's own
    socket, every interface, with a warning saying why) when MASTER_ADDR does not resolve here (a Kubernetes
    pod's DNS name before the pod is published) or names no address of this machine, or a loopback address
    under a host name (Debian maps its own host name to 127.0.1.1: the other hosts reach it otherwise)."""
    try:
        resolved = [str(info[4][0]) for info in socket.getaddrinfo(master_addr, None, proto=socket.IPPROTO_TCP)]
    except OSError as exc:
        why = f"it does not resolve here ({exc})"
    else:
        local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
        ours = [ip for ip in resolved if ip in local or ipaddress.ip_address(ip.split("%")[0]).is_loopback]
        literal = master_addr == "localhost" or master_addr in resolved
        if ours and (literal or not ipaddress.ip_address(ours[0].split("%")[0]).is_loopback):
            return ours[0]
        why = f"it resolves to {resolved}, " + ("a loopback address" if ours else "no address of this machine")
    log.warning(
        "rank 0's process-group store listens on every interface: MASTER_ADDR = %r names no single address to "
        "listen on (%s); set MASTER_ADDR to rank 0's address",
        master_addr,
        why,
    )
    return None


def pin_socket_interface(host: str, environ: MutableMapping[str, str]) -> None:
    """Point gloo and NCCL at the interface that holds `host` (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME in
    `environ`, this process's environment in use), unless they are set already; an address no interface of this
    machine holds (a NAT's) leaves them alone, with a warning."""
    wanted = [name for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME") if not environ.get(name)]
    if not wanted:
        return
    try:
        ips = {info[4][0] for info in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        ips = set()
    owners = [name for name, addrs in psutil.net_if_addrs().items() if any(a.address in ips for a in addrs)]
    if not owners:
        log.warning(
            "%s is no address of this machine: gloo and NCCL choose their interface themselves (set "
            "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to pin it)",
            host,
        )
        return
    for name in wanted:
        environ[name] = owners[0]


def _connect_store(store_address: Any, info: RankInfo, timeout_s: float) -> dist.TCPStore:
    """Connect to rank 0's store; an address left by an earlier trainer is refused and read again."""
    deadline = time.monotonic() + timeout_s
    last = ""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise RankError(
                f"trainer rank {info.rank} could not reach rank 0's process-group store within {timeout_s:.0f}s "
                f"(last address {last or 'none published'}); is rank 0 running?"
            )
        addr = store_address.wait(remaining)
        host, _, port = addr.rpartition(":")
        try:
            return dist.TCPStore(
                host,
                int(port),
                info.world,
                is_master=False,
                timeout=datetime.timedelta(seconds=max(1.0, min(10.0, remaining))),
            )
        except (RuntimeError, OSError) as exc:
            last = f"{addr}: {exc}"
            time.sleep(_POLL_S)


class RedisStoreAddress:
    """Rank 0's store address under `trainer:store` (synchronous Redis client)."""

    def __init__(self, client: Any, key: str) -> None:
        self.client, self.key = client, key

    def publish(self, addr: str) -> None:
        self.client.set(self.key, json.dumps({"addr": addr, "pid": os.getpid(), "ts": time.time()}))

    def wait(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            raw = self.client.get(self.key)
            if raw is not None:
                return json.loads(raw)["addr"]
            time.sleep(_POLL_S)
        raise RankError(f"no trainer rank 0 published its store under {self.key} within {timeout_s:.0f}s")


# ----------------------------------------------------------------------------------------------
# Liveness of the other ranks
# ----------------------------------------------------------------------------------------------


def rank_record(instance: str) -> dict[str, Any]:
    """What `trainer:ranks` holds for this rank: where it runs and which role heartbeat is its liveness."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "instance": instance, "state": "running"}


def dead_ranks(records: Mapping[int, dict[str, Any]], alive: Mapping[int, bool], me: int) -> list[tuple[int, str]]:
    """(rank, why) for every other rank that is gone: its process (same host) or its heartbeat (other hosts).

    A rank that finished cleanly marks itself done and is not dead."""
    host = socket.gethostname()
    gone = []
    for rank, rec in sorted(records.items()):
        if rank == me or rec.get("state") == "done":
            continue
        if rec.get("host") == host:
            # Same host: the process itself is the truth (a loaded machine can delay a heartbeat past its TTL).
            if not _running(int(rec["pid"])):
                gone.append((rank, f"process {rec['pid']} on {host} is gone"))
        elif not alive.get(rank, False):
            gone.append((rank, f"its heartbeat (pid {rec.get('pid')} on {rec.get('host')}) expired"))
    return gone


def _running(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped yet)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
