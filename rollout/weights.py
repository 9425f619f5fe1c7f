"""Versioned weight publishing, the trainer side of weight sync (DESIGN section 6).

`WeightPublisher.publish(version, tensors)` exports the tensors in HF naming (fused expert tensors
are split into one name per expert, which vLLM's loaders require), writes them as safetensors
shards of `rollout.weight_shard_mb` to `<weight_dir>/v<N>/` atomically (a temporary directory
renamed into place; layout in rollout/weight_files.py) with an index recording each shard's size
and CRC-32, and drives every live worker through vLLM's RL endpoints: /pause?mode=...,
/start_weight_update, /update_weights, /finish_weight_update {weight_version},
/reset_prefix_cache, /resume. With `rollout.stream_weights` (the default) the
workers are paused and loading while the version is written: each loads shard i as soon as it is
whole, so a publish costs about max(write, load) instead of write + load, at the price of a pause
window that includes the write. Otherwise the whole version is written first and the workers are
paused only for the load. All workers are driven concurrently and every response is checked; a
publisher and a worker catching up by itself change its weights only under the worker's weight
lock. A worker that fails is evicted (removed from the `workers` hash and its liveness key, so the
router stops using it; the worker notices and exits to be restarted) and reported in the result
and as an event. `weights:current` advances only after
every live worker acknowledged the version; then the version is appended to `weights:log` and
version directories older than the newest `keep_versions` are removed. If writing fails, the
version is not published and the temporary directory is removed; workers that were streaming it
stop at the ABORTED marker, fail their update and are evicted (their weights are half-loaded).

Several trainer ranks (expert parallelism: each holds only its own experts) write one version
together: rank 0 calls `publish(..., peers=...)` with its tensors (the dense ones and its experts);
`PeerWriters` is the trainer's handle on the other ranks, each of which writes a `VersionPart` (its
`count_shards` shards, numbered after those of the ranks before it) into rank 0's temporary
directory. Rank 0 writes its own part meanwhile, then the index from every rank's `PartReport`, and
owns the directory, the commit and the workers; a failure of any rank fails the publish as above.
Left out: a failing rank does not stop the others (`PeerWriters.write` has no cancel); every writer
runs to its end before the directory is removed, and the ABORTED marker releases the workers early.

A version number names one set of weights for the whole experiment: a publish takes a number above
weights:current and every number on disk (`newest_version` also counts half-written ones). A trainer that
resumes from a checkpoint makes the workers serve older weights again with `republish(version, source)`:
the committed files of `source`, checksums verified, hard-linked under the new number. The trainer pins
(`pin_versions`) the versions its kept checkpoints need, which pruning leaves alone.

Transports: `file` (above; any machine that sees the weight dir) and `nccl` (`NcclTransport`,
vLLM's trainer-side NCCL engine; GPUs only, needs vLLM's GPU build in the trainer process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shutil
import time
import zlib
from collections.abc import Awaitable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import aiohttp
import redis.asyncio
import redis.exceptions
import torch

from common.config import RolloutConfig
from common.keys import Keys
from common.net import bearer
from common.roles import announce
from rollout.weight_files import (
    ABORT_MARKER,
    CorruptShardError,
    PartReport,
    ShardRecord,
    read_index,
    shard_name,
    verify_shard,
    write_index,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

WEIGHTS_LOG_MAXLEN = 10_000
# A weight update of a large model can take minutes; a stuck worker is still bounded by this.
UPDATE_TIMEOUT_S = 600.0
# How long a worker streaming a version waits for the publisher's next shard.
SHARD_WAIT_S = 300.0
# How often a driver checks that the worker it is updating still heartbeats.
LIVENESS_POLL_S = 0.5
_VERSION_DIR = re.compile(r"^v(\d+)$")
_TMP_DIR = re.compile(r"^\.v(\d+)\.\d+\.tmp$")
# Versions kept whatever keep_versions says (a JSON list in the weight dir).
PINS_NAME = "pinned.json"
# transformers keeps routed experts fused in memory: [E, 2I, H] gate|up and [E, H, I] down.
_FUSED_GATE_UP = re.compile(r"^(.*\.experts)\.gate_up_proj$")
_FUSED_DOWN = re.compile(r"^(.*\.experts)\.down_proj$")


class WorkerError(RuntimeError):
    """A worker answered a weight-sync call with an error (or not at all); names the call and the worker."""


class PublishError(RuntimeError):
    """A version could not be published (bad version number or tensors); nothing was changed."""


@dataclass
class WorkerOutcome:
    """How one worker took one version."""

    worker_id: str
    url: str
    ok: bool
    pause_window_s: float = 0.0
    load_s: float = 0.0
    """The /update_weights call: reading and loading the tensors (and, when streamed, waiting for the write)."""
    error: str = ""


@dataclass
class PublishResult:
    """What a publish did: where the version lives, how long each part took, who acknowledged it."""

    version: int
    location: str
    bytes: int
    export_s: float
    write_s: float
    drive_s: float
    """From the start of the write to the last worker's acknowledgement (the write overlaps it when streamed)."""
    total_s: float
    shards: int = 1
    streamed: bool = False
    """Workers loaded each shard as it was written (rollout.stream_weights) instead of after the whole version."""
    workers: list[WorkerOutcome] = field(default_factory=list)
    source: int | None = None
    """For a republish: the version whose files these are."""

    @property
    def evicted(self) -> list[WorkerOutcome]:
        return [w for w in self.workers if not w.ok]

    @property
    def max_pause_s(self) -> float:
        return max((w.pause_window_s for w in self.workers if w.ok), default=0.0)

    @property
    def max_load_s(self) -> float:
        return max((w.load_s for w in self.workers if w.ok), default=0.0)


# ----------------------------------------------------------------------------------------------
# Export
# ----------------------------------------------------------------------------------------------


def hf_views(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with one name per expert, as views (no copies); see `hf_tensors`."""
    for name, t in tensors.items():
        t = t.detach()
        if (m := _FUSED_GATE_UP.match(name)) and t.dim() == 3:
            if t.shape[1] % 2:
                raise PublishError(f"{name}: fused gate_up_proj of shape {tuple(t.shape)} has an odd middle dim")
            gate, up = t.chunk(2, dim=1)
            for e in range(t.shape[0]):
                yield f"{m[1]}.{e}.gate_proj.weight", gate[e]
                yield f"{m[1]}.{e}.up_proj.weight", up[e]
        elif (m := _FUSED_DOWN.match(name)) and t.dim() == 3:
            for e in range(t.shape[0]):
                yield f"{m[1]}.{e}.down_proj.weight", t[e]
        else:
            yield name, t


def hf_tensors(tensors: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """HF-named tensors with one name per expert: fused transformers expert tensors are split.

    `...experts.gate_up_proj` [E, 2I, H] becomes `...experts.{e}.gate_proj.weight` [I, H] and
    `...experts.{e}.up_proj.weight` [I, H]; `...experts.down_proj` [E, H, I] becomes
    `...experts.{e}.down_proj.weight`. Everything else passes through; all come out contiguous on CPU.
    """
    for name, t in hf_views(tensors):
        yield name, t.contiguous().cpu()


def plan_shards(named: list[tuple[str, torch.Tensor]], shard_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Cut the tensors, in their order, into consecutive shards of at most `shard_bytes` each.

    A tensor larger than `shard_bytes` gets a shard of its own. Keeping the model's order keeps a
    layer's tensors together, so a worker can finish (and post-process) layers as shards arrive.
    """
    if shard_bytes < 1:
        raise PublishError(f"shard size must be >= 1 byte, got {shard_bytes}")
    shards: list[list[tuple[str, torch.Tensor]]] = []
    size = 0
    for name, t in named:
        nbytes = t.numel() * t.element_size()
        if not shards or (shards[-1] and size + nbytes > shard_bytes):
            shards.append([])
            size = 0
        shards[-1].append((name, t))
        size += nbytes
    return shards


def count_shards(tensors: Mapping[str, torch.Tensor], shard_bytes: int) -> int:
    """How many shards `VersionPart` cuts these tensors into (0 for none): what a rank announces before writing."""
    return len(plan_shards(list(hf_views(tensors)), shard_bytes))


def _mark_aborted(tmp: Path, exc: BaseException) -> None:
    """Leave the ABORTED marker for streaming readers; the first writer to fail gives the reason."""
    with contextlib.suppress(OSError), open(tmp / ABORT_MARKER, "x") as f:
        f.write(f"{type(exc).__name__}: {exc}")


class VersionPart:
    """One trainer rank's shards of a version, written into the version's existing temporary directory.

    The tensors are cut by `plan_shards` and written as shards `first_shard`, `first_shard + 1`, ... of
    `total_shards`, each renamed into its final name once whole. The part never creates, renames or
    removes the directory: rank 0's `VersionWriter` does. A failed write leaves the ABORTED marker.
    """

    def __init__(
        self,
        tmp: Path,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        shard_bytes: int,
        first_shard: int,
        total_shards: int,
    ) -> None:
        named = list(hf_views(tensors))
        self.shards = plan_shards(named, shard_bytes)
        if first_shard < 0 or first_shard + len(self.shards) > total_shards:
            raise PublishError(
                f"publish({version}): this part's {len(self.shards)} shard(s) from index {first_shard} do not fit in "
                f"{total_shards}; did the rank announce count_shards() of these same tensors and shard size?"
            )
        self.tmp, self.version = tmp, version
        self.first_shard, self.total_shards = first_shard, total_shards
        self.bytes = sum(t.numel() * t.element_size() for _, t in named)
        self.export_s = 0.0
        self.write_s = 0.0

    def write(self) -> PartReport:
        """Write every shard (blocking); what was written. On failure leave the ABORTED marker and raise."""
        from safetensors.torch import save

        report = PartReport({}, self.bytes)
        t0 = time.perf_counter()
        try:
            for i, shard in enumerate(self.shards, start=self.first_shard):
                t1 = time.perf_counter()
                tensors = {name: t.contiguous().cpu() for name, t in shard}
                self.export_s += time.perf_counter() - t1
                # Serialised in memory so the checksum costs no second read of the file.
                data = save(tensors, metadata={"slipstream_version": str(self.version)})
                path = self.tmp / shard_name(i, self.total_shards)
                partial = path.with_name(path.name + ".partial")
                partial.write_bytes(data)
                os.rename(partial, path)  # a streaming reader sees the whole shard or nothing
                report.shards[path.name] = ShardRecord(len(data), zlib.crc32(data), tuple(tensors))
        except BaseException as exc:
            _mark_aborted(self.tmp, exc)
            raise
        finally:
            self.write_s = time.perf_counter() - t0 - self.export_s
        return report


class PeerWriters(Protocol):
    """The other trainer ranks, each writing its own `VersionPart` of a version (rank 0 writes the first).

    The trainer implements this with torch.distributed; the publisher knows only this interface.
    """

    shard_counts: list[int]
    """How many shards each other rank will write (`count_shards` of its tensors), in rank order 1, 2, ..."""

    def write(self, tmp: Path, first_shard: list[int], total_shards: int) -> list[PartReport]:
        """Have rank r+1 write its part into `tmp` from shard `first_shard[r]` of `total_shards`; block until every
        rank is done; their reports in rank order. Raises if any rank failed (that rank left the ABORTED marker)."""
        ...


class VersionWriter:
    """Writes one version as safetensors shards (layout: rollout/weight_files.py), then moves it into place.

    The shards go to a temporary directory `root/.v<N>.<pid>.tmp/`, each renamed into its final name
    once whole, so workers can load shard i while shard i+1 is written. `write` writes rank 0's part
    (`VersionPart`, shards 0..) while `peers`, the other trainer ranks, write theirs (the shards after
    it), then the index. `commit` renames the directory to `root/v<N>/`: readers of a committed version
    see all of it or none of it. A failed write leaves the ABORTED marker for streaming readers;
    `discard` removes the directory.
    """

    def __init__(
        self,
        root: Path,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        shard_bytes: int,
        peer_shards: Sequence[int] = (),
    ) -> None:
        own = count_shards(tensors, shard_bytes)
        if own == 0:
            raise PublishError(f"publish({version}): no tensors given")
        if any(n < 0 for n in peer_shards):
            raise PublishError(
                f"publish({version}): the other ranks announced negative shard counts {list(peer_shards)}"
            )
        self.version = version
        self.final = root / f"v{version}"
        if self.final.exists():
            raise PublishError(
                f"publish({version}): {self.final} already exists; versions are immutable, publish {version + 1}"
            )
        self.tmp = root / f".v{version}.{os.getpid()}.tmp"
        self.total_shards = own + sum(peer_shards)
        self.peer_first_shards = [own + sum(peer_shards[:r]) for r in range(len(peer_shards))]
        self.part = VersionPart(self.tmp, version, tensors, shard_bytes, 0, self.total_shards)
        self.bytes = self.part.bytes  # rank 0's tensor bytes until `write` has every rank's report
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir(parents=True)

    @property
    def export_s(self) -> float:
        return self.part.export_s

    @property
    def write_s(self) -> float:
        return self.part.write_s

    def write(self, peers: PeerWriters | None = None) -> None:
        """Write rank 0's part while `peers` write theirs, then the index (blocking); returns when every writer
        has ended. On any failure leave the ABORTED marker and raise PublishError naming who failed."""
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"write-v{self.version}") as pool:
            mine = pool.submit(self.part.write)
            theirs = pool.submit(peers.write, self.tmp, self.peer_first_shards, self.total_shards) if peers else None
        # Both have ended (the pool's exit waits), so nothing writes into the directory after this.
        failures = [(who, exc) for who, f in (("rank 0", mine), ("the other ranks", theirs))
                    if f is not None and (exc := f.exception()) is not None]  # fmt: skip
        if failures:
            _mark_aborted(self.tmp, failures[0][1])
            raise PublishError("; ".join(f"{who}: {type(e).__name__}: {e}" for who, e in failures)) from failures[0][1]
        reports = [mine.result(), *(theirs.result() if theirs else [])]
        try:
            self.bytes = write_index(self.tmp, reports, self.total_shards)
        except (ValueError, OSError) as exc:
            _mark_aborted(self.tmp, exc)
            raise PublishError(f"the index of version {self.version}: {exc}") from exc

    def commit(self) -> Path:
        os.rename(self.tmp, self.final)
        return self.final

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def write_version(
    root: Path, version: int, tensors: Mapping[str, torch.Tensor], shard_bytes: int = 32 << 20
) -> tuple[Path, int, float, float]:
    """Write one whole version to root/v<N>/ (atomically); (dir, bytes, export_s, write_s)."""
    writer = VersionWriter(root, version, tensors, shard_bytes)
    try:
        writer.write()
    except BaseException:
        writer.discard()
        raise
    return writer.commit(), writer.bytes, writer.export_s, writer.write_s


def _link_version(src: Path, dst: Path, records: Mapping[str, ShardRecord]) -> None:
    """Hard-link a committed version's files into `dst`, checking every shard against its index first."""
    for name, record in records.items():
        verify_shard(src / name, (src / name).read_bytes(), record)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        os.link(f, dst / f.name)


def weight_root(ro: RolloutConfig, run_dir: str | os.PathLike[str]) -> Path:
    """Where a run publishes its versions (`v<N>/` directories): rollout.weight_dir, else `<run dir>/weights`."""
    return Path(ro.weight_dir) if ro.weight_dir else Path(run_dir) / "weights"


def committed_versions(root: Path) -> list[int]:
    """Numbers of the committed version directories under root, ascending."""
    return sorted(int(m[1]) for p in root.glob("v*") if (m := _VERSION_DIR.match(p.name)) and p.is_dir())


def unfinished_versions(root: Path) -> list[Path]:
    """Temporary directories of versions whose write never committed (a publisher died mid-write)."""
    return sorted(p for p in root.glob(".v*.tmp") if _TMP_DIR.match(p.name) and p.is_dir())


def pin_versions(root: Path, versions: Iterable[int]) -> None:
    """Keep these versions on disk whatever `keep_versions` says (the trainer pins the version its
    generators serve in each checkpoint it keeps: a resume republishes that version's files)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{PINS_NAME}.{os.getpid()}"
    tmp.write_text(json.dumps(sorted(set(versions))) + "\n")
    os.replace(tmp, root / PINS_NAME)


def pinned_versions(root: Path) -> set[int]:
    path = root / PINS_NAME
    return set(json.loads(path.read_text())) if path.exists() else set()


def prune_versions(root: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` version directories and the pinned ones; the removed paths."""
    found = committed_versions(root)
    pinned = pinned_versions(root)
    removed = [root / f"v{v}" for v in found[: max(0, len(found) - keep)] if v not in pinned]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
    return removed


# ----------------------------------------------------------------------------------------------
# Driving one worker
# ----------------------------------------------------------------------------------------------


async def _call(session: aiohttp.ClientSession, method: str, url: str, json: Any = None) -> Any:
    try:
        async with session.request(method, url, json=json, timeout=aiohttp.ClientTimeout(total=UPDATE_TIMEOUT_S)) as r:
            text = await r.text()
            if r.status != 200:
                raise WorkerError(f"{method} {url} -> HTTP {r.status}: {text[:500]}")
            return text
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise WorkerError(f"{method} {url} failed: {type(exc).__name__}: {exc}") from exc


async def label_version(session: aiohttp.ClientSession, url: str, version: int) -> None:
    """Set the version label vLLM attaches to tokens, without changing weights (version 0 at start)."""
    await _call(session, "POST", f"{url}/update_weight_version", {"new_version": str(version)})


async def apply_version(
    session: aiohttp.ClientSession,
    url: str,
    version: int,
    location: str,
    pause_mode: str,
    update_info: Mapping[str, Any] | None = None,
    timings: dict[str, float] | None = None,
) -> float:
    """Drive one worker through a whole update to `version`; the pause window in seconds.

    `timings`, when given, receives the seconds each call took, by route name.

    On any failure the worker is resumed if possible (so it does not hang requests) and WorkerError
    is raised; the caller must evict it, since its weights may be half-updated.
    """
    info = dict(update_info) if update_info is not None else {"path": location}
    took = {} if timings is None else timings

    async def call(route: str, json: Any = None) -> None:
        t0 = time.perf_counter()
        await _call(session, "POST", f"{url}/{route}", json)
        took[route.split("?")[0]] = time.perf_counter() - t0

    await call(f"pause?mode={pause_mode}")
    paused_at = time.perf_counter()
    try:
        await call("start_weight_update")
        await call("update_weights", {"update_info": info})
        await call("finish_weight_update", {"weight_version": str(version)})
        # A prefix cached under the old weights would be reused for new requests (10 nats off).
        await call("reset_prefix_cache")
    except WorkerError:
        with contextlib.suppress(WorkerError):
            await _call(session, "POST", f"{url}/resume")
        raise
    await call("resume")
    return time.perf_counter() - paused_at


async def served_version(session: aiohttp.ClientSession, url: str) -> str | None:
    """The weight version label the worker reports on /weight_info."""
    return json.loads(await _call(session, "GET", f"{url}/weight_info"))["weight_version"]


async def current_version(client: redis.asyncio.Redis, keys: Keys) -> int | None:
    raw = await client.get(keys.weights_current)
    return None if raw is None else int(raw)


async def newest_version(client: redis.asyncio.Redis, keys: Keys, root: Path) -> int | None:
    """The highest version number this experiment ever used, or None: weights:current, the last entry of
    weights:log, the versions workers report, and every version directory under root, committed or not
    (a publisher that died mid-write used its number too: workers may have loaded part of it). A new
    publish takes a higher number, so a number never names two different sets of weights."""
    seen = committed_versions(root)
    seen += [int(_TMP_DIR.match(p.name)[1]) for p in unfinished_versions(root)]  # type: ignore[index]
    if (current := await current_version(client, keys)) is not None:
        seen.append(current)
    for _id, fields in await client.xrevrange(keys.weights_log, count=1):
        seen.append(int(fields["version"]))
    for raw in (await client.hgetall(keys.workers)).values():
        version = json.loads(raw).get("weight_version")
        if isinstance(version, int):
            seen.append(version)
    return max(seen, default=None)


async def live_workers(client: redis.asyncio.Redis, keys: Keys, registry: str = "") -> dict[str, str]:
    """worker_id -> url of the workers in the pool hash `registry` (default `keys.workers`) whose liveness key
    exists."""
    entries = await client.hgetall(registry or keys.workers)
    if not entries:
        return {}
    ids = list(entries)
    alive = await client.mget([keys.worker_alive(i) for i in ids])
    return {i: json.loads(entries[i])["url"] for i, a in zip(ids, alive, strict=True) if a is not None}


async def evict(
    client: redis.asyncio.Redis, keys: Keys, worker_id: str, reason: str, registry: str = "", by: str = "trainer"
) -> None:
    """Remove a worker from its pool (the router stops routing to it; the worker exits and restarts).

    `registry` is the pool's hash (default `keys.workers`; the evaluator passes `keys.eval_workers`), `by` the
    role that evicts, as the event names it.
    """
    await client.hdel(registry or keys.workers, worker_id)
    await client.delete(keys.worker_alive(worker_id))
    await announce(client, keys, by, "worker evicted", worker=worker_id, reason=reason[:1000])
    log.error("evicted worker %s: %s", worker_id, reason)


async def while_alive(client: redis.asyncio.Redis, keys: Keys, worker_id: str, call: Awaitable[T]) -> T:
    """Await `call` (an update of one worker) unless the worker's liveness key vanishes first.

    A worker role that died (kill -9) can leave its vLLM server half shut down, taking requests and
    never answering them (/pause waits on a dead engine); without this a publish would hang for the
    whole UPDATE_TIMEOUT_S. Raises WorkerError naming the worker; the call is cancelled.
    """
    task = asyncio.ensure_future(call)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=LIVENESS_POLL_S)
            if done:
                return task.result()
            if not await client.exists(keys.worker_alive(worker_id)):
                raise WorkerError(f"worker {worker_id} stopped heartbeating during the weight update (its role died)")
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, WorkerError):
                await task


def weight_lock(client: redis.asyncio.Redis, keys: Keys, worker_id: str):
    """The lock around any change of one worker's weights: a publisher driving it and the worker catching
    up by itself never interleave their pause/update/resume calls on the same vLLM server. It expires
    after UPDATE_TIMEOUT_S if its holder dies; waiting for it is bounded the same way."""
    return client.lock(keys.worker_sync(worker_id), timeout=UPDATE_TIMEOUT_S, blocking_timeout=UPDATE_TIMEOUT_S)


async def set_worker_version(client: redis.asyncio.Redis, registry: str, worker_id: str, version: int) -> None:
    """Record in the pool's hash `registry` that the worker now serves `version` (a missing entry stays missing)."""
    raw = await client.hget(registry, worker_id)
    if raw is not None:
        entry = json.loads(raw)
        entry["weight_version"] = version
        await client.hset(registry, worker_id, json.dumps(entry))


# ----------------------------------------------------------------------------------------------
# The publisher
# ----------------------------------------------------------------------------------------------


class WeightPublisher:
    """Publishes versions of the policy to every live worker of one experiment (file transport)."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keys: Keys,
        cfg: RolloutConfig,
        run_dir: str | os.PathLike[str],
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if cfg.weight_backend != "file":
            raise ValueError(
                f"WeightPublisher writes files but rollout.weight_backend = {cfg.weight_backend!r}; "
                "use NcclTransport for 'nccl'"
            )
        self.client, self.keys, self.cfg = client, keys, cfg
        self.root = weight_root(cfg, run_dir)
        self._session = session
        self._own_session = session is None

    async def __aenter__(self) -> WeightPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None

    def _sess(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(headers=bearer(self.cfg.api_key))
        return self._session

    async def publish(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        pause_mode: str | None = None,
        peers: PeerWriters | None = None,
    ) -> PublishResult:
        """Write `version` and apply it on every live worker; see the module docstring for the contract.

        `tensors` are this rank's (rank 0's); `peers`, when given, are the other trainer ranks, which write
        their shards of the same version concurrently (`PeerWriters`). Versions only move forward: a
        number at or below weights:current is refused, and so is one whose directory exists.
        """
        t0 = time.perf_counter()
        mode = await self._check(version, pause_mode)
        workers = await live_workers(self.client, self.keys)
        peer_shards = list(peers.shard_counts) if peers is not None else []
        writer = await asyncio.to_thread(
            VersionWriter, self.root, version, tensors, self.cfg.weight_shard_mb << 20, peer_shards
        )
        streamed = self.cfg.stream_weights and bool(workers)
        t1 = time.perf_counter()
        write = asyncio.create_task(asyncio.to_thread(writer.write, peers))
        try:
            if streamed:
                # Workers pause and load shard i while shard i+1 is written (by whichever rank owns it).
                info = {"path": str(writer.tmp), "shards": writer.total_shards, "wait_s": SHARD_WAIT_S}
                drives = (self._drive(w, url, version, info, mode) for w, url in workers.items())
                outcomes = await asyncio.gather(*drives)
        except BaseException:
            await asyncio.wait({write})  # every writer runs to its end; then nothing is left behind
            writer.discard()
            raise
        await asyncio.wait({write})
        if (failure := write.exception()) is not None:
            writer.discard()
            evicted = "; the workers that were loading it were evicted" if streamed else ""
            raise PublishError(f"publish({version}): writing the version failed: {failure}{evicted}") from failure
        location = str(writer.commit())
        if not streamed:
            info = {"path": location}
            outcomes = await asyncio.gather(*(self._drive(w, url, version, info, mode) for w, url in workers.items()))
        result = PublishResult(version, location, writer.bytes, writer.export_s, writer.write_s,
                               time.perf_counter() - t1, 0.0, writer.total_shards, streamed, list(outcomes))  # fmt: skip
        return await self._commit(result, t0)

    async def republish(self, version: int, source: int, pause_mode: str | None = None) -> PublishResult:
        """Publish the committed files of version `source` again, as `version`, on every live worker.

        The files are hard-linked, not copied, and their checksums verified first. A trainer that resumes
        from a checkpoint uses it to make its generators serve the checkpoint's weights: the number is
        new because numbers are never reused (workers may already serve `source + 1` of the lost run).
        """
        t0 = time.perf_counter()
        mode = await self._check(version, pause_mode)
        src = self.root / f"v{source}"
        records = await asyncio.to_thread(read_index, src)
        if records is None:
            raise PublishError(f"republish({version}): {src} has no index with checksums; it cannot be republished")
        final = self.root / f"v{version}"
        if final.exists():
            raise PublishError(f"republish({version}): {final} already exists; versions are immutable")
        tmp = self.root / f".v{version}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            await asyncio.to_thread(_link_version, src, tmp, records)
            os.rename(tmp, final)
        except (OSError, CorruptShardError) as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise PublishError(f"republish({version}) of version {source}: {exc}") from exc
        t1 = time.perf_counter()
        workers = await live_workers(self.client, self.keys)
        info = {"path": str(final)}
        outcomes = await asyncio.gather(*(self._drive(w, url, version, info, mode) for w, url in workers.items()))
        size = sum(r.bytes for r in records.values())
        result = PublishResult(version, str(final), size, 0.0, t1 - t0, time.perf_counter() - t1, 0.0, len(records),
                               False, list(outcomes), source=source)  # fmt: skip
        return await self._commit(result, t0)

    async def _check(self, version: int, pause_mode: str | None) -> str:
        current = await current_version(self.client, self.keys)
        if current is not None and version <= current:
            raise PublishError(f"publish({version}): weights:current is already {current}; publish a newer version")
        mode = pause_mode or self.cfg.pause_mode
        if mode not in ("keep", "abort", "wait"):
            raise PublishError(f"pause mode {mode!r} is not one of keep, abort, wait")
        return mode

    async def _commit(self, result: PublishResult, t0: float) -> PublishResult:
        """Every worker still live has acknowledged (failures were evicted), so the version is current."""
        version = result.version
        await self.client.set(self.keys.weights_current, version)
        entry = {"version": version, "backend": "file", "location": result.location, "ts": f"{time.time():.3f}"}
        if result.source is not None:
            entry["source"] = result.source
        await self.client.xadd(self.keys.weights_log, entry, maxlen=WEIGHTS_LOG_MAXLEN, approximate=True)  # type: ignore[arg-type]
        result.total_s = time.perf_counter() - t0
        evicted = [w.worker_id for w in result.evicted]
        extra = {} if result.source is None else {"source": result.source}
        await announce(self.client, self.keys, "trainer", "version published", version=version,
                       workers=len(result.workers), evicted=evicted, **extra)  # fmt: skip
        for p in prune_versions(self.root, self.cfg.keep_versions):
            log.debug("removed old weight version %s", p)
        log.info(
            "published weight version %d%s (%.1f MB) to %d worker(s) in %.3fs (write %.3fs, max pause %.3fs)%s",
            version, "" if result.source is None else f" (the files of version {result.source})",
            result.bytes / 1e6, len(result.workers) - len(evicted), result.total_s, result.write_s,
            result.max_pause_s, f"; EVICTED {evicted}" if evicted else "",
        )  # fmt: skip
        return result

    async def _drive(self, worker_id: str, url: str, version: int, info: dict[str, Any], mode: str) -> WorkerOutcome:
        took: dict[str, float] = {}
        try:
            async with weight_lock(self.client, self.keys, worker_id):
                update = apply_version(self._sess(), url, version, info["path"], mode, info, took)
                pause = await while_alive(self.client, self.keys, worker_id, update)
                await set_worker_version(self.client, self.keys.workers, worker_id, version)
        except (WorkerError, redis.exceptions.LockError) as exc:
            await evict(self.client, self.keys, worker_id, f"weight version {version}: {exc}")
            return WorkerOutcome(worker_id, url, False, error=str(exc))
        return WorkerOutcome(worker_id, url, True, pause_window_s=pause, load_s=took["update_weights"])


# ----------------------------------------------------------------------------------------------
# NCCL (GPUs only)
# ----------------------------------------------------------------------------------------------


class _DictSource:
    """A vLLM WeightSource over HF-named tensors (built lazily so CPU machines never import vLLM's NCCL)."""

    @staticmethod
    def build(tensors: Mapping[str, torch.Tensor]):
        from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

        class DictSource(WeightSource):
            def __init__(self) -> None:
                self.tensors: dict[str, torch.Tensor] = {}

            def metadata(self) -> list[ParamMeta]:
                return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

            def __iter__(self):
                return iter(self.tensors.items())

        src = DictSource()
        src.tensors = dict(tensors)
        return src


class _FanoutClient:
    """vLLM's VLLMWeightSyncClient protocol over several workers' HTTP routes (synchronous, in a thread)."""

    def __init__(self, urls: list[str], timeout_s: float = UPDATE_TIMEOUT_S) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.clients = [HTTPVLLMWeightSyncClient(u, timeout=timeout_s) for u in urls]
        self.version: str | None = None

    def _all(self, fn: str, *args: Any) -> None:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(max_workers=len(self.clients)) as ex:
            for f in [ex.submit(getattr(c, fn), *args) for c in self.clients]:
                f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        # Each worker joins at its own rank offset in the trainer+workers NCCL group.
        from concurrent.futures import ThreadPoolExecutor

        tp = init_info.pop("_tp")
        with ThreadPoolExecutor(max_workers=len(self.clients)) as ex:
            futs = [ex.submit(c.init_weight_transfer_engine, {**init_info, "rank_offset": 1 + i * tp})
                    for i, c in enumerate(self.clients)]  # fmt: skip
            for f in futs:
                f.result()

    def start_weight_update(self) -> None:
        self._all("start_weight_update")

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", weight_version or self.version)


class NcclTransport:
    """GPU-only transport through vLLM's NCCL engine: a fixed set of workers joins one NCCL group.

    The trainer (rank 0) broadcasts every tensor; workers (started with weight_backend = "nccl")
    receive and load them. Workers that join later cannot enter the group, so this transport is for
    fixed worker pools; use `file` for elastic ones. Not testable here (no CUDA, no GPU vLLM): the
    constructor checks its preconditions and says what is missing.
    """

    def __init__(self, urls: list[str], master_address: str, master_port: int, tensor_parallel_size: int = 1) -> None:
        if not urls:
            raise ValueError("NcclTransport needs at least one worker URL")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        if not torch.cuda.is_available():
            raise RuntimeError(
                "the nccl weight transport needs CUDA GPUs in the trainer process (torch.cuda.is_available() is "
                "False); set rollout.weight_backend = 'file' on CPU machines"
            )
        self.urls, self.tp = list(urls), tensor_parallel_size
        self.world_size = 1 + len(urls) * tensor_parallel_size
        self.master_address, self.master_port = master_address, master_port
        self.engine = None
        self.client: _FanoutClient | None = None

    def connect(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Form the NCCL group with every worker (blocking; call once before the first send)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.client = _FanoutClient(self.urls)
        info = NCCLTrainerInitInfo(master_address=self.master_address, master_port=self.master_port,
                                   world_size=self.world_size, rank=0)  # fmt: skip
        self.source = _DictSource.build(dict(hf_tensors(tensors)))
        original = self.client.init_weight_transfer_engine
        self.client.init_weight_transfer_engine = lambda init: original({**init, "_tp": self.tp})  # type: ignore[method-assign]
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    def send(self, version: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Broadcast one version (start, update, finish with the version label) to every worker."""
        if self.engine is None or self.client is None:
            raise RuntimeError("NcclTransport.send before connect(); call connect(tensors) once first")
        self.source.tensors = dict(hf_tensors(tensors))
        self.client.version = str(version)
        self.engine.send_weights()
