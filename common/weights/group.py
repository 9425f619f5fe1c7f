"""The wire of the `collective` transport (collective.py): a version's safetensors shards, as the trainer ranks
make them, broadcast to the live workers through torch.distributed groups instead of read from the weight dir.

For one version there is one gloo group per trainer rank: that rank (group rank 0) and every worker taking the
version (group rank 1 + i), rendezvousing on the TCPStore trainer rank 0 serves, under a prefix of their own
(`GroupSpec`). Trainer rank r broadcasts each shard it writes, before writing its file: a header (shard index,
byte count, CRC-32) and then the bytes. A worker receives from every group at once (one thread per trainer rank)
and checks each shard's CRC-32 before the model sees it; the bytes are those of the shard file, so a delta shard
is decoded and checked per tensor exactly as a file's (delta.py). The files are written all the same: they are
what a late, restarted or evaluating worker loads, what a republish links and what a worker falls back to when a
group breaks (a member died, a join timed out): a sender that fails stops sending into its group, and each
worker reads the shards that group did not deliver from the files. Gloo only: it runs on CPUs and, staging
through host memory, beside GPUs (an NCCL group would move device tensors; not built).
"""

from __future__ import annotations

import datetime
import logging
import queue
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from common import net
from common.net import route_source

log = logging.getLogger(__name__)

_HEADER = 3  # shard index, byte count, CRC-32
_JOIN_POLL_S = 0.02


@dataclass(frozen=True)
class GroupSpec:
    """Where the groups of one version meet: trainer rank 0's store (`address`:`port`), the version's key prefix,
    the members of each trainer rank's group (1 + workers) and how long any join or transfer may take."""

    address: str
    port: int
    prefix: str
    size: int
    timeout_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupSpec:
        return cls(str(d["address"]), int(d["port"]), str(d["prefix"]), int(d["size"]), float(d["timeout_s"]))


def serve_store(host: str, timeout_s: float) -> dist.TCPStore:
    """Trainer rank 0's rendezvous store for every version's groups, on a free port of `host`, listening there only
    (as rank 0's process-group store: not on every interface)."""
    return net.serve_store(host, 0, 1, datetime.timedelta(seconds=timeout_s))


class GroupAborted(RuntimeError):
    """The version's groups were called off before they formed (a worker failed before joining)."""


def abort(spec: GroupSpec, reason: str) -> None:
    """Call off the version's groups: every member still waiting to join stops waiting (and reads the files).
    Through a store client of its own: a TCPStore client used by two threads at once garbles its replies."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    dist.TCPStore(spec.address, spec.port, is_master=False, timeout=timeout).set(f"{spec.prefix}/abort", reason)


def join(spec: GroupSpec, trainer_rank: int, rank: int, store: dist.Store | None = None) -> Any:
    """Join trainer rank `trainer_rank`'s group of the version as group rank `rank`. First every member announces
    itself in the store; this waits until all have (at most the spec's timeout) or the groups are called off
    (`abort`: GroupAborted), so a worker that failed before joining costs the others no timeout. A gloo backend
    object of its own (typed Any: torch's stubs give ProcessGroupGloo no collectives), apart from any default
    group of the process (vLLM's, the trainer's)."""
    timeout = datetime.timedelta(seconds=spec.timeout_s)
    if store is None:
        store = dist.TCPStore(spec.address, spec.port, is_master=False, timeout=timeout)
    here = f"{spec.prefix}/r{trainer_rank}/here"
    store.set(f"{here}/{rank}", "1")
    everyone = [f"{here}/{i}" for i in range(spec.size)]
    called_off = [f"{spec.prefix}/abort"]
    deadline = time.monotonic() + spec.timeout_s
    while not store.check(everyone):
        if store.check(called_off):
            raise GroupAborted(
                f"the weight groups of {spec.prefix} were called off: {store.get(called_off[0]).decode()}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"weight group {spec.prefix}/r{trainer_rank}: not every one of its {spec.size} members joined within "
                f"{spec.timeout_s:g} s (rollout.weight_group_timeout_s)"
            )
        time.sleep(_JOIN_POLL_S)
    prefixed = dist.PrefixStore(f"{spec.prefix}/r{trainer_rank}", store)
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # in the extension, not its stubs
    options._timeout = timeout
    # Gloo's default device is the address the host name resolves to, which on a host of several interfaces
    # (or in a network namespace) may not reach the others: the one that reaches the store does.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=route_source(spec.address))]
    return dist.ProcessGroupGloo(prefixed, rank, spec.size, options)


def _broadcast(pg: Any, t: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    pg.broadcast([t], opts).wait()


class ShardCaster:
    """A trainer rank's sending side for one version: `send` broadcasts one shard into its group. The first
    failure (a member gone, the join timed out) is logged and ends the sending; the workers read the rest from
    the files, so a publish never fails for it."""

    def __init__(self, spec: GroupSpec, trainer_rank: int, store: dist.Store | None = None) -> None:
        self.spec, self.trainer_rank, self.store = spec, trainer_rank, store
        self.pg: Any = None
        self.sent = 0
        self.error: str | None = None

    def send(self, index: int, data: bytes) -> None:
        if self.error is not None:
            return
        try:
            if self.pg is None:
                self.pg = join(self.spec, self.trainer_rank, 0, self.store)
            _broadcast(self.pg, torch.tensor([index, len(data), zlib.crc32(data)], dtype=torch.int64))
            _broadcast(self.pg, torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self.sent += 1
        except Exception as exc:  # gloo's errors are RuntimeErrors and DistBackendErrors of many messages
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning(
                "trainer rank %d: the weight group of %s broke after %d shard(s) (%s); its workers read the rest "
                "from the files",
                self.trainer_rank,
                self.spec.prefix,
                self.sent,
                self.error,
            )

    def close(self) -> None:
        self.pg = None  # gloo closes its pairs when the group object goes


class GroupShardError(RuntimeError):
    """A shard arrived through a group with bytes that do not match the CRC-32 its sender sent."""


def receive_shards(spec: GroupSpec, rank: int, owned: Sequence[Sequence[int]]) -> Iterator[tuple[int, bytes | None]]:
    """A worker's receiving side (group rank `rank` in every trainer rank's group): (shard index, bytes) as the
    shards arrive, trainer rank r sending the shards `owned[r]`; (index, None) for each shard a group did not
    deliver because it broke (the caller reads that one from the files). A shard whose bytes fail their CRC-32
    raises GroupShardError naming it."""
    arrived: queue.Queue[tuple[int, bytes | None] | BaseException | None] = queue.Queue(maxsize=2 * len(owned))
    stopped = threading.Event()  # the reader gave up (a load failed): the receivers stop handing shards over

    def put(item: tuple[int, bytes | None] | BaseException | None) -> None:
        while not stopped.is_set():
            try:
                arrived.put(item, timeout=0.5)
                return
            except queue.Full:
                continue

    def receive(trainer_rank: int, indices: Sequence[int]) -> None:
        got = 0
        try:
            if indices:
                pg = join(spec, trainer_rank, rank)  # a store client of its own: one is not shared across threads
                header = torch.zeros(_HEADER, dtype=torch.int64)
                for _ in indices:
                    _broadcast(pg, header)
                    index, nbytes, crc = (int(v) for v in header)
                    data = torch.empty(nbytes, dtype=torch.uint8)
                    _broadcast(pg, data)
                    raw = data.numpy().tobytes()
                    if zlib.crc32(raw) != crc:
                        raise GroupShardError(
                            f"shard {index} from trainer rank {trainer_rank} arrived through the weight group with "
                            f"CRC-32 {zlib.crc32(raw):#010x}, its sender sent {crc:#010x}"
                        )
                    put((index, raw))
                    got += 1
        except GroupShardError as exc:
            put(exc)
        except Exception as exc:  # the group broke: the rest of this rank's shards come from the files
            log.warning(
                "weight group %s/r%d broke after %d of %d shard(s) (%s: %s); reading the rest from the files",
                spec.prefix,
                trainer_rank,
                got,
                len(indices),
                type(exc).__name__,
                exc,
            )
            for index in indices[got:]:
                put((index, None))
        put(None)

    threads = [
        threading.Thread(target=receive, args=(r, list(ix)), name=f"weights-r{r}", daemon=True)
        for r, ix in enumerate(owned)
    ]
    for t in threads:
        t.start()
    done = 0
    try:
        while done < len(threads):
            item = arrived.get()
            if item is None:
                done += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        stopped.set()
