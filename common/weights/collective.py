"""The `collective` transport: each version goes to the live workers through torch.distributed groups, straight
from the trainer ranks that hold its parts, and is written as files too (the `file` transport's layout).

Every trainer rank broadcasts each shard of its part (dense shards and its experts, the same safetensors bytes,
deltas included, that it writes) into its own gloo group with the workers (the wire: group.py), before writing
the shard's file. The workers are paused and take the version through the `file` engine of our vLLM plugin, which
receives the shards from every group at once, checks each one's CRC-32 and, for a delta, every tensor's, and reads
from the files only what a broken group did not deliver. The files stay the path of everything that is not a live
worker taking the newest version: a late or restarted worker catching up, the evaluator's pinned workers, a
republish, and the decode base of a worker that missed a version. So the pause window and the workers' reads no
longer wait on the shared filesystem, which the trainer still writes (and `keep_versions` still prunes).

Workers must join within `rollout.weight_group_timeout_s`. A worker whose update fails (before it joined, or
while the others wait) calls the version's groups off: the members still waiting stop at once and read the files;
one that hangs without failing costs the others the timeout. Tensor-parallel workers are refused by the config
(every TP rank of a worker would need a group rank of its own; not built).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from common.weights.base import PublishError, PublishResult
from common.weights.file import SHARD_WAIT_S, FileTransport
from common.weights.group import GroupSpec, ShardCaster, abort, serve_store
from common.weights.workers import WorkerDriver, WorkerOutcome

log = logging.getLogger(__name__)


class CollectiveTransport(FileTransport):
    """Versions broadcast from the trainer ranks to the live workers, and written under `root` (see the module
    docstring); `host` is the address the workers reach trainer rank 0's rendezvous store at."""

    backend = "collective"

    def __init__(
        self,
        root: Path,
        driver: WorkerDriver,
        shard_bytes: int,
        keep_versions: int,
        host: str,
        timeout_s: float,
        model_files: Path | None = None,
        delta: bool = False,
        snapshot_every: int = 1,
    ) -> None:
        super().__init__(root, driver, shard_bytes, True, keep_versions, model_files, delta, snapshot_every)
        self.host, self.timeout_s = host, timeout_s
        self._store: dist.TCPStore | None = None
        # Groups of this publisher's versions never meet those of an earlier trainer on the same store address.
        self._nonce = uuid.uuid4().hex[:12]

    async def send(self, version: int, workers: Mapping[str, str], pause_mode: str) -> PublishResult:
        if self._copy is not None or not workers:
            return await super().send(version, workers, pause_mode)  # a republish links files: workers read them
        writer = self._writer
        if writer is None or writer.version != version:
            raise RuntimeError(f"CollectiveTransport.send({version}) without prepare({version}) first")
        t1 = time.perf_counter()
        if self._store is None:
            try:
                self._store = await asyncio.to_thread(serve_store, self.host, self.timeout_s)
            except Exception as exc:
                raise PublishError(
                    f"publish({version}): the collective transport cannot serve its rendezvous store on "
                    f"{self.host} ({exc}); set rollout.weight_group_host to an address of this host the workers reach"
                ) from exc
        spec = GroupSpec(self.host, self._store.port, f"{self._nonce}/v{version}", 1 + len(workers), self.timeout_s)
        caster = ShardCaster(spec, 0, self._store)
        writer.part.sink = caster.send
        counts = [len(writer.part.shards), *(self._peers.shard_counts if self._peers is not None else [])]
        firsts = [0, *writer.peer_first_shards]
        group: dict[str, Any] = {**spec.to_dict(), "owned": [[f, n] for f, n in zip(firsts, counts, strict=True)]}
        base = {"path": str(writer.tmp), "shards": writer.total_shards, "wait_s": SHARD_WAIT_S}
        infos = {w: {**base, "group": {**group, "rank": 1 + i}} for i, w in enumerate(workers)}

        async def update(worker_id: str, url: str) -> WorkerOutcome:
            outcome = await self.driver.update(worker_id, url, version, infos[worker_id], pause_mode)
            if not outcome.ok:  # it will never join (or has left): the others stop waiting for it
                await asyncio.to_thread(abort, spec, f"worker {worker_id} failed: {outcome.error[:300]}")
            return outcome

        self._write = write = asyncio.ensure_future(asyncio.to_thread(writer.write, self._peers, spec))
        outcomes = list(await asyncio.gather(*(update(w, url) for w, url in workers.items())))
        await asyncio.wait({write})
        caster.close()
        if (failure := write.exception()) is not None:
            raise PublishError(
                f"publish({version}): writing the version failed: {failure}; the workers that were loading it were "
                "evicted"
            ) from failure
        if caster.error is not None:
            log.warning("publish(%d): rank 0's shards after the %d-th went through the files", version, caster.sent)
        location = writer.commit()
        return PublishResult(
            version,
            str(location),
            writer.bytes,
            writer.export_s,
            writer.write_s,
            time.perf_counter() - t1,
            0.0,
            writer.total_shards,
            True,
            outcomes,
            delta_base=writer.delta_base,
        )
