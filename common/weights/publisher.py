"""The publisher, the trainer side of weight sync (docs/ARCHITECTURE.md): `WeightPublisher.publish(version,
tensors)` checks that the version number moves forward, sends the version to every live train worker through
the transport `rollout.weight_backend` names (factory.py), and commits it: `weights:current` advances only
after every live worker acknowledged the version (a worker that failed was evicted, so the router stops using
it and it exits to be restarted), the version is appended to `weights:log`, and the publish is announced as
an event. `republish(version, source)` makes the workers serve the weights of an older version again under a
new number (a trainer resuming from a checkpoint); a publisher and a worker catching up by itself change its
weights only under the worker's weight lock (workers.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import redis.asyncio

from common.config import RolloutConfig
from common.keys import Keys
from common.net import is_loopback, route_source
from common.roles import announce
from common.weights.base import PublishError, PublishResult
from common.weights.factory import make_transport
from common.weights.fleet import current_version, live_workers, read_records
from common.weights.nccl import NcclGroup
from common.weights.versions import FILE_BACKENDS, weight_root
from common.weights.workers import WorkerDriver

if TYPE_CHECKING:
    import torch

    from common.weights.writer import PeerWriters

log = logging.getLogger(__name__)

WEIGHTS_LOG_MAXLEN = 10_000


class WeightPublisher:
    """Publishes versions of the policy to every live worker of one experiment."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        keys: Keys,
        cfg: RolloutConfig,
        run_dir: str | os.PathLike[str],
        session: aiohttp.ClientSession | None = None,
        nccl_group: NcclGroup | None = None,
        model_files: Path | None = None,
    ) -> None:
        """`model_files`: the HF directory of the run's model; its config, tokenizer and chat template travel
        with every version written as files."""
        self.client, self.keys, self.cfg = client, keys, cfg
        self.root = weight_root(cfg, run_dir)
        self.driver = WorkerDriver(client, keys, cfg.api_key, session)
        group_host = ""
        if cfg.weight_backend == "collective":
            group_host = cfg.weight_group_host
            if group_host == "auto":
                redis_host = str(client.connection_pool.connection_kwargs.get("host", "127.0.0.1"))
                group_host = "127.0.0.1" if is_loopback(redis_host) else route_source(redis_host)
        self.transport = make_transport(cfg, self.root, self.driver, nccl_group, model_files, group_host)

    async def __aenter__(self) -> WeightPublisher:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.driver.close()

    async def publish(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        pause_mode: str | None = None,
        peers: PeerWriters | None = None,
    ) -> PublishResult:
        """Send `version` to every live worker and make it current; see the module docstring for the contract.

        `tensors` are this rank's (rank 0's); `peers`, when given, are the other trainer ranks, which write
        their shards of the same version concurrently (writer.py's `PeerWriters`). Versions only move forward:
        a number at or below weights:current is refused, and so is one whose directory exists.
        """
        t0 = time.perf_counter()
        mode = await self._check(version, pause_mode)
        workers = await live_workers(self.client, self.keys)
        await self.transport.prepare(version, tensors, peers)
        return await self._send(version, workers, mode, t0)

    async def republish(self, version: int, source: int, pause_mode: str | None = None) -> PublishResult:
        """Publish the weights of version `source` again, as `version`, on every live worker.

        The file transport hard-links the committed files, checksums verified first. A trainer that resumes
        from a checkpoint uses it to make its generators serve the checkpoint's weights: the number is
        new because numbers are never reused (workers may already serve `source + 1` of the lost run).
        """
        t0 = time.perf_counter()
        mode = await self._check(version, pause_mode)
        workers = await live_workers(self.client, self.keys)
        await self.transport.prepare_copy(version, source)
        return await self._send(version, workers, mode, t0)

    async def _check(self, version: int, pause_mode: str | None) -> str:
        current = await current_version(self.client, self.keys)
        if current is not None and version <= current:
            raise PublishError(f"publish({version}): weights:current is already {current}; publish a newer version")
        mode = pause_mode or self.cfg.pause_mode
        if mode not in ("keep", "abort", "wait"):
            raise PublishError(f"pause mode {mode!r} is not one of keep, abort, wait")
        return mode

    async def _send(self, version: int, workers: Mapping[str, str], mode: str, t0: float) -> PublishResult:
        published = False
        try:
            result = await self.transport.send(version, workers, mode)
            await self._commit(result, t0)
            published = True
            if self.transport.backend in FILE_BACKENDS:
                await self._bring_late_joiners(result, workers, mode)
        finally:
            await self.transport.finish(published)
        return result

    async def _bring_late_joiners(self, result: PublishResult, sent_to: Mapping[str, str], mode: str) -> None:
        """Bring to the version, from its files, the workers that registered while it was sent: one that restarted
        or was readmitted caught up to weights:current, then the version before, and registered after this publish
        chose its workers. Before the publish returns, because the next batch is generated right after it, and
        on-policy refuses a sample of the version before."""
        records = await read_records(self.client, self.keys.workers)
        late = {
            w: url
            for w, url in (await live_workers(self.client, self.keys)).items()
            if w not in sent_to and w in records and (records[w].weight_version or -1) < result.version
        }
        if not late:
            return
        info = {"path": result.location}
        outcomes = await asyncio.gather(
            *(self.driver.update(w, url, result.version, info, mode) for w, url in late.items())
        )
        result.workers += outcomes
        log.info(
            "brought %d worker(s) that registered during the publish to weight version %d%s",
            sum(o.ok for o in outcomes),
            result.version,
            "; EVICTED " + str([o.worker_id for o in outcomes if not o.ok]) if not all(o.ok for o in outcomes) else "",
        )

    async def _commit(self, result: PublishResult, t0: float) -> None:
        """Every worker still live has acknowledged (failures were evicted), so the version is current."""
        version = result.version
        await self.client.set(self.keys.weights_current, version)
        entry = {
            "version": version,
            "backend": self.transport.backend,
            "location": result.location,
            "ts": f"{time.time():.3f}",
        }
        if result.source is not None:
            entry["source"] = result.source
        await self.client.xadd(self.keys.weights_log, entry, maxlen=WEIGHTS_LOG_MAXLEN, approximate=True)  # type: ignore[arg-type]
        result.total_s = time.perf_counter() - t0
        evicted = [w.worker_id for w in result.evicted]
        extra = {} if result.source is None else {"source": result.source}
        await announce(
            self.client,
            self.keys,
            "trainer",
            "version published",
            version=version,
            workers=len(result.workers),
            evicted=evicted,
            **extra,
        )
        if result.source is not None:
            what = f" (the files of version {result.source})"
        elif result.delta_base is not None:
            what = f" (a delta of version {result.delta_base})"
        else:
            what = ""
        log.info(
            "published weight version %d%s (%.1f MB) to %d worker(s) in %.3fs (write %.3fs, max pause %.3fs)%s",
            version,
            what,
            result.bytes / 1e6,
            len(result.workers) - len(evicted),
            result.total_s,
            result.write_s,
            result.max_pause_s,
            f"; EVICTED {evicted}" if evicted else "",
        )
