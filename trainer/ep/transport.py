"""Transports: how expert-parallel rows travel between ranks, behind one interface. Each moves rows
in two directions by a `DispatchPlan`: `dispatch` takes a source's expert-sorted rows to the owners'
expert-major buffers, `combine` brings the owners' results back to the fixed slot of each row on its
source. The backward of either is the other. `LocalTransport` is the one-rank case (in process);
`ProcessGroupTransport` uses torch.distributed point-to-point sends (gloo on CPU, NCCL on GPU), one
message per (source, owner) pair and never an all-to-all collective; `SymmetricMemoryTransport` puts
rows straight into the peers' buffers over NVLink through torch.distributed._symmetric_memory
(one-sided writes, a device barrier, no multicast). Staging buffers grow to the high-water mark of
the exchanged counts and are reused; `allocated_bytes` says how much is held."""

from __future__ import annotations

import os
import warnings
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from trainer.ep.plan import DispatchPlan

if TYPE_CHECKING:
    from torch._C._distributed_c10d import _SymmetricMemory


class TransportUnavailable(RuntimeError):
    """An explicitly chosen transport cannot run here; the message says why and what to do."""


class Transport(ABC):
    """Moves rows between the ranks of one expert-parallel group."""

    group: dist.ProcessGroup | None
    rank: int
    world: int

    @abstractmethod
    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """This rank's rows per global expert [E] -> every rank's counts [W, E] (int64, on the host)."""

    @abstractmethod
    def dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Expert-sorted rows [rows_out, H] -> this rank's expert-major rows [rows_in, H] (a fresh tensor)."""

    @abstractmethod
    def combine(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """Expert-major results [rows_in, H] -> this rank's rows back in sorted order [rows_out, H] (fresh)."""

    @property
    @abstractmethod
    def allocated_bytes(self) -> int:
        """Bytes of reusable staging buffers held (grows to the high-water mark of the counts, never shrinks)."""


class LocalTransport(Transport):
    """One rank, nothing leaves the process: dispatch and combine are the plan's permutation."""

    def __init__(self) -> None:
        self.group = None
        self.rank = 0
        self.world = 1

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.to("cpu", torch.int64).unsqueeze(0)

    def dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        out = rows.new_empty(plan.rows_in, rows.shape[1])
        return out.index_copy_(0, plan.recv_index, rows)

    def combine(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        return rows.index_select(0, plan.recv_index)

    @property
    def allocated_bytes(self) -> int:
        return 0


def _group_or_world(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """`group`, or the default group of an initialised torch.distributed."""
    if group is not None:
        return group
    world = dist.group.WORLD
    if world is None:
        raise TransportUnavailable("no process group given and torch.distributed has no default group yet")
    return world


class _StagingBuffers:
    """One reusable buffer per (device, dtype, width), grown to exactly the largest request seen."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}

    def get(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (device, dtype, width)
        buf = self.buffers.get(key)
        if buf is None or buf.shape[0] < rows:
            buf = torch.empty(rows, width, dtype=dtype, device=device)
            self.buffers[key] = buf
        return buf[:rows]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class ProcessGroupTransport(Transport):
    """torch.distributed isend/irecv (batched), one message per (source, owner) pair with rows.

    Owners receive source-major into a staging buffer and place each row at its expert-major offset
    with one index copy; the combine gathers results source-major and sends each source its segment,
    which lands directly in the source's output at the segment's offset. A rank's own segment is a
    local copy."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise TransportUnavailable(
                "ProcessGroupTransport needs torch.distributed: call dist.init_process_group first "
                "(gloo on CPU, nccl on GPU), or use LocalTransport for one rank"
            )
        self.group: dist.ProcessGroup = _group_or_world(group)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self._peers = [dist.get_global_rank(self.group, r) for r in range(self.world)]
        self._staging = _StagingBuffers()

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(torch.int64).contiguous()
        out = counts.new_empty(self.world, counts.numel())
        out[self.rank].copy_(counts)
        others = [r for r in range(self.world) if r != self.rank]
        self._exchange([(r, counts) for r in others], [(r, out[r]) for r in others])
        return out.cpu()

    def _exchange(self, sends: list[tuple[int, torch.Tensor]], recvs: list[tuple[int, torch.Tensor]]) -> None:
        ops = [dist.P2POp(dist.isend, t, self._peers[r], self.group) for r, t in sends if t.numel() > 0]
        ops += [dist.P2POp(dist.irecv, t, self._peers[r], self.group) for r, t in recvs if t.numel() > 0]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

    def dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        rows = rows.contiguous()
        me, H = self.rank, rows.shape[1]
        stage = self._staging.get(plan.rows_in, H, rows.dtype, rows.device)
        send = [rows.narrow(0, plan.send_offsets[r], plan.send_splits[r]) for r in range(self.world)]
        recv = [stage.narrow(0, plan.recv_offsets[s], plan.recv_splits[s]) for s in range(self.world)]
        recv[me].copy_(send[me])
        others = [r for r in range(self.world) if r != me]
        self._exchange([(r, send[r]) for r in others], [(s, recv[s]) for s in others])
        return rows.new_empty(plan.rows_in, H).index_copy_(0, plan.recv_index, stage)

    def combine(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        me, H = self.rank, rows.shape[1]
        stage = self._staging.get(plan.rows_in, H, rows.dtype, rows.device)
        torch.index_select(rows, 0, plan.recv_index, out=stage)  # source-major: one segment per source
        out = rows.new_empty(plan.rows_out, H)
        send = [stage.narrow(0, plan.recv_offsets[s], plan.recv_splits[s]) for s in range(self.world)]
        recv = [out.narrow(0, plan.send_offsets[r], plan.send_splits[r]) for r in range(self.world)]
        recv[me].copy_(send[me])
        others = [r for r in range(self.world) if r != me]
        self._exchange([(s, send[s]) for s in others], [(r, recv[r]) for r in others])
        return out

    @property
    def allocated_bytes(self) -> int:
        return self._staging.nbytes


class SymmetricMemoryTransport(Transport):
    """One-sided puts into the peers' symmetric buffers over NVLink (torch.distributed._symmetric_memory).

    Dispatch: every source writes its rows straight to their expert-major offsets in each owner's
    buffer (one index copy per owner), then a device barrier. Combine: every owner writes each
    source's results to that source's fixed slots, then a barrier. Each rank then copies its own
    buffer out. Two buffers alternate, so a peer that has passed barrier n writes buffer (n+1) % 2
    while this rank may still be copying buffer n % 2 out; buffer n % 2 is only written again after
    barrier n + 1, which this rank joins after its copy (the stream orders them). Symmetric buffers
    must have the same size on every rank, so they grow to max over ranks of the rows any rank
    sends or receives, which every rank reads off the same counts. Multicast is never used, and the
    transport refuses to start unless TORCH_SYMM_MEM_DISABLE_MULTICAST=1 keeps PyTorch from setting
    it up."""

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | str | None = None) -> None:
        if not dist.is_initialized():
            raise TransportUnavailable("SymmetricMemoryTransport needs torch.distributed (nccl) to be initialised")
        if not torch.cuda.is_available():
            raise TransportUnavailable("SymmetricMemoryTransport needs CUDA GPUs; on CPU use ProcessGroupTransport")
        if os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST") != "1":
            raise TransportUnavailable(
                "set TORCH_SYMM_MEM_DISABLE_MULTICAST=1 (and NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1) before "
                "starting: NVLink multicast must stay off on shared machines"
            )
        import torch.distributed._symmetric_memory as symm_mem

        self._symm = symm_mem
        self.group: dist.ProcessGroup = _group_or_world(group)
        self.rank = dist.get_rank(self.group)
        self.world = dist.get_world_size(self.group)
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        # Older torch wants symmetric memory switched on per group before a rendezvous; newer torch
        # does it on rendezvous and only warns that the call is no longer needed.
        if not symm_mem.is_symm_mem_enabled_for_group(self.group.group_name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                symm_mem.enable_symm_mem_for_group(self.group.group_name)
        self._counts: tuple[torch.Tensor, _SymmetricMemory] | None = None
        self._data: list[tuple[torch.Tensor, _SymmetricMemory]] = []
        self._data_bytes = 0
        self._turn = 0

    def _alloc(self, nbytes: int) -> tuple[torch.Tensor, _SymmetricMemory]:
        buf = self._symm.empty(nbytes, dtype=torch.uint8, device=self.device)
        return buf, self._symm.rendezvous(buf, self.group.group_name)

    def exchange_counts(self, counts: torch.Tensor) -> torch.Tensor:
        counts = counts.to(self.device, torch.int64)
        E = counts.numel()
        if self._counts is None or self._counts[0].numel() != self.world * E * 8:
            self._counts = self._alloc(self.world * E * 8)
        handle = self._counts[1]
        for peer in range(self.world):
            handle.get_buffer(peer, (self.world, E), torch.int64)[self.rank].copy_(counts)
        handle.barrier(channel=0)
        return handle.get_buffer(self.rank, (self.world, E), torch.int64).cpu()

    def _buffers(self, plan: DispatchPlan, width: int, dtype: torch.dtype) -> tuple[_SymmetricMemory, int]:
        """The handle to use for this operation and its capacity in rows of `width` x `dtype`."""
        row_bytes = width * dtype.itemsize
        need = plan.max_rows * row_bytes
        if need > self._data_bytes:
            # Every rank takes this branch together: plan.max_rows is the same number everywhere.
            torch.cuda.synchronize(self.device)  # nothing may still read the old buffers when they go
            self._data = [self._alloc(need) for _ in range(2)]
            self._data_bytes = need
        handle = self._data[self._turn][1]
        self._turn ^= 1
        return handle, self._data_bytes // row_bytes

    def dispatch(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        rows = rows.contiguous()
        H = rows.shape[1]
        handle, cap = self._buffers(plan, H, rows.dtype)
        for owner in range(self.world):
            if plan.send_splits[owner]:
                segment = rows.narrow(0, plan.send_offsets[owner], plan.send_splits[owner])
                remote = handle.get_buffer(owner, (cap, H), rows.dtype)
                remote.index_copy_(0, plan.put_index[owner], segment)
        handle.barrier(channel=0)
        return handle.get_buffer(self.rank, (cap, H), rows.dtype)[: plan.rows_in].clone()

    def combine(self, rows: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        rows = rows.contiguous()
        H = rows.shape[1]
        handle, cap = self._buffers(plan, H, rows.dtype)
        for source in range(self.world):
            n = plan.recv_splits[source]
            if n:
                index = plan.recv_index.narrow(0, plan.recv_offsets[source], n)
                remote = handle.get_buffer(source, (cap, H), rows.dtype)
                torch.index_select(rows, 0, index, out=remote.narrow(0, plan.return_offsets[source], n))
        handle.barrier(channel=0)
        return handle.get_buffer(self.rank, (cap, H), rows.dtype)[: plan.rows_out].clone()

    @property
    def allocated_bytes(self) -> int:
        counts = 0 if self._counts is None else self._counts[0].numel()
        return 2 * self._data_bytes + counts


def make_transport(kind: str, group: dist.ProcessGroup | None = None) -> Transport:
    """`local` (one rank), `p2p` (torch.distributed point-to-point) or `symm_mem` (NVLink symmetric memory)."""
    if kind == "local":
        return LocalTransport()
    if kind == "p2p":
        return ProcessGroupTransport(group)
    if kind == "symm_mem":
        return SymmetricMemoryTransport(group)
    raise ValueError(f"unknown expert-parallel transport {kind!r}; use local, p2p or symm_mem")
