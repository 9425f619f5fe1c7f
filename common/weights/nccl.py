"""The `nccl` transport (GPUs only): vLLM's trainer-side NCCL weight-transfer engine. The trainer (rank 0)
and a fixed set of workers (started with rollout.weight_backend = "nccl") form one NCCL group at the first
send; each version is then broadcast to all of them while vLLM's engine drives every worker's
/start_weight_update, /update_weights (names, dtypes and shapes) and /finish_weight_update (the version label).
Workers that join later cannot enter the group, so this transport is for fixed worker pools; use `file` for
elastic ones. Not testable here (no CUDA, no GPU vLLM): the constructor checks its preconditions and says what
is missing, and vLLM's NCCL modules are imported only when the group is formed. Left out: pausing the workers
(vLLM's engine does not), several trainer ranks (rank 0's tensors only), republishing an older version (nothing
is kept), evicting a worker (a failed broadcast fails the publish: the group is unusable afterwards).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from common.weights.base import PublishError, PublishResult, WeightTransport
from common.weights.export import per_expert_tensors
from common.weights.workers import UPDATE_TIMEOUT_S, WorkerDriver, WorkerOutcome

if TYPE_CHECKING:
    import torch

    from common.weights.writer import PeerWriters


@dataclass(frozen=True)
class NcclGroup:
    """Who forms the NCCL group: the fixed workers' URLs, and the trainer's rendezvous address and port."""

    urls: tuple[str, ...]
    master_address: str
    master_port: int


def _tensor_source() -> Any:
    """A vLLM WeightSource whose `tensors` (HF-named) the transport sets before each send; its class is made here
    so that CPU machines never import vLLM's NCCL modules."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class TensorSource(WeightSource):
        def __init__(self) -> None:
            self.tensors: dict[str, torch.Tensor] = {}

        def metadata(self) -> list[ParamMeta]:
            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors.items()]

        def __iter__(self):
            return iter(self.tensors.items())

    return TensorSource()


class _FanoutClient:
    """vLLM's VLLMWeightSyncClient protocol over several workers' HTTP routes (synchronous: vLLM's engine calls it
    from a thread). Worker i joins the group at rank 1 + i * tp, after the trainer's rank 0; /finish_weight_update
    carries `version`, which the transport sets before each send."""

    def __init__(self, urls: list[str], tp: int, timeout_s: float = UPDATE_TIMEOUT_S) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.clients = [HTTPVLLMWeightSyncClient(u, timeout=timeout_s) for u in urls]
        self.tp = tp
        self.version: str | None = None

    def _all(self, calls: list[Callable[[], None]]) -> None:
        """Run one call per worker concurrently; raise the first failure."""
        with ThreadPoolExecutor(max_workers=len(calls)) as ex:
            for f in [ex.submit(call) for call in calls]:
                f.result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all(
            [
                partial(c.init_weight_transfer_engine, {**init_info, "rank_offset": 1 + i * self.tp})
                for i, c in enumerate(self.clients)
            ]
        )

    def start_weight_update(self) -> None:
        self._all([c.start_weight_update for c in self.clients])

    def update_weights(self, update_info: Any) -> None:
        self._all([partial(c.update_weights, update_info) for c in self.clients])

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all([partial(c.finish_weight_update, weight_version or self.version) for c in self.clients])


class NcclTransport(WeightTransport):
    """Broadcasts each version over NCCL to the fixed workers at `urls` (see the module docstring); `driver`
    records each worker's new version in the pool hash."""

    backend = "nccl"

    def __init__(
        self,
        urls: list[str],
        master_address: str,
        master_port: int,
        tensor_parallel_size: int = 1,
        driver: WorkerDriver | None = None,
    ) -> None:
        if not urls:
            raise ValueError("NcclTransport needs at least one worker URL")
        if tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError(
                "the nccl weight transport needs CUDA GPUs in the trainer process (torch.cuda.is_available() is "
                "False); set rollout.weight_backend = 'file' on CPU machines"
            )
        self.urls, self.tp, self.driver = [u.rstrip("/") for u in urls], tensor_parallel_size, driver
        self.world_size = 1 + len(urls) * tensor_parallel_size
        self.master_address, self.master_port = master_address, master_port
        self.engine: Any = None
        self.client: _FanoutClient | None = None
        self.source: Any = None
        self._tensors: dict[str, torch.Tensor] | None = None  # the prepared version, HF-named
        self._export_s = 0.0

    def connect(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Form the NCCL group with every worker (blocking; the first send does it)."""
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.client = _FanoutClient(self.urls, self.tp)
        self.source = _tensor_source()
        self.source.tensors = dict(tensors)
        info = NCCLTrainerInitInfo(
            master_address=self.master_address, master_port=self.master_port, world_size=self.world_size, rank=0
        )
        self.engine = WeightTransferTrainerFactory.trainer_init(info, client=self.client, source=self.source)

    async def prepare(
        self, version: int, tensors: Mapping[str, torch.Tensor], peers: PeerWriters | None = None
    ) -> None:
        if peers is not None:
            raise PublishError(
                f"publish({version}): the nccl transport sends rank 0's tensors only, but other "
                "trainer ranks hold parts of this version; use rollout.weight_backend = 'file'"
            )
        t0 = time.perf_counter()
        self._tensors = await asyncio.to_thread(lambda: dict(per_expert_tensors(tensors)))
        self._export_s = time.perf_counter() - t0

    async def send(self, version: int, workers: Mapping[str, str], pause_mode: str) -> PublishResult:
        if self.driver is None:
            raise RuntimeError("NcclTransport.send needs driver= (a WorkerDriver) to record the workers' version")
        tensors = self._tensors
        if tensors is None:
            raise RuntimeError(f"NcclTransport.send({version}) without prepare({version}) first")
        if sorted(workers.values()) != sorted(self.urls):
            raise PublishError(
                f"publish({version}): the live workers {sorted(workers.values())} are not the NCCL group's "
                f"{sorted(self.urls)}; the nccl transport serves a fixed pool (rollout.weight_backend = 'file' "
                "serves an elastic one)"
            )
        t1 = time.perf_counter()
        await asyncio.to_thread(self._broadcast, version, tensors)
        took = time.perf_counter() - t1
        for worker_id in workers:
            await self.driver.record_version(worker_id, version)
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        outcomes = [WorkerOutcome(w, url, True, load_s=took) for w, url in workers.items()]
        return PublishResult(version, self.backend, size, self._export_s, 0.0, took, 0.0, workers=outcomes)

    def _broadcast(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Send one version (start, update, finish with the version label) to every worker (blocking)."""
        if self.engine is None:
            self.connect(tensors)
        assert self.client is not None
        self.source.tensors = tensors
        self.client.version = str(version)
        self.engine.send_weights()

    async def finish(self, published: bool) -> None:
        self._tensors = None
