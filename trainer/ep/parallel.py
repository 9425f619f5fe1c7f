"""Applying expert parallelism to a built model from the outside: `apply_expert_parallel` swaps every
MoE layer's `experts` module for a `ShardedExperts` that holds only this rank's block of experts and
moves rows through a `Transport`; the model code stays rank-agnostic, since the seam is the expert
module's own contract (expert-sorted rows and offsets in, results for the same rows out). Expert
weights become DTensors sharded on dim 0 over the group, so torch.distributed.checkpoint saves them as
global-shape tensors with per-rank chunks and loads them at any other EP size; the dense weights stay
plain replicated tensors. `ParallelPlan` keeps the replicas in step: it all-reduces the dense
gradients (over every rank), the expert gradients over the data-parallel copies of the EP group, and
the expert-load counts (sum), and computes the global gradient norm. With `trainer.parallel.dp_shard` the
dense weights are FSDP2-sharded instead (trainer/fsdp.py) and FSDP reduces their gradients."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainer.ep.plan import DispatchPlan, make_plan
from trainer.ep.transport import Transport
from trainer.fsdp import SHARD_DIM, apply_fsdp, fsdp_params
from trainer.model.moe import Experts, ExpertWeights, MoE


class _Dispatch(torch.autograd.Function):
    """Rows to their owners; the gradient comes back the way results do."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: DispatchPlan, transport: Transport) -> torch.Tensor:
        ctx.plan, ctx.transport = plan, transport
        return transport.dispatch(rows, plan)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.transport.combine(grad.contiguous(), ctx.plan), None, None


class _Combine(torch.autograd.Function):
    """Results to their source slots; the gradient goes out the way rows do."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, plan: DispatchPlan, transport: Transport) -> torch.Tensor:
        ctx.plan, ctx.transport = plan, transport
        return transport.combine(rows, plan)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.transport.dispatch(grad.contiguous(), ctx.plan), None, None


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


class ShardedExperts(ExpertWeights):
    """This rank's experts [E/W, ...] of one MoE layer, with the `Experts` contract over all E experts.

    Parameter names and global shapes are those of `Experts` (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]); with a process group they are DTensors sharded on dim 0, alone they are the full
    tensors. The GEMMs run on a per-step copy of this rank's block, as `Experts` does on its weights (the
    optimizer refreshes both). `last_plan` keeps the plan of the latest forward for inspection."""

    def __init__(
        self, experts: Experts, transport: Transport, mesh: DeviceMesh | None, device: torch.device | None = None
    ) -> None:
        """Experts on the meta device (a streamed import that fills them after sharding: trainer/hf_stream.py)
        become this rank's block uninitialised on `device`."""
        super().__init__(experts.backend)
        E = experts.gate_up_proj.shape[0]
        W, r = transport.world, transport.rank
        if E % W:
            raise ValueError(
                f"n_routed_experts = {E} does not split over an expert-parallel group of {W} ranks; "
                f"use a group size that divides {E}"
            )
        self.transport = transport
        self.num_experts = E
        El = E // W
        self.local_experts = range(r * El, (r + 1) * El)
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name).detach()
            if full.is_meta:
                local = torch.empty((El, *full.shape[1:]), dtype=full.dtype, device=device)
            else:
                local = full[r * El : (r + 1) * El].clone()
            if mesh is not None:
                local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(local, requires_grad=getattr(experts, name).requires_grad))
        self.last_plan: DispatchPlan | None = None

    def masters(self) -> tuple[torch.Tensor, torch.Tensor]:
        return _local(self.gate_up_proj), _local(self.down_proj)

    # Host-side sizes and communication: compiled blocks run this part eagerly.
    @torch.compiler.disable
    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
        plan = make_plan(self.transport.exchange_counts(counts), self.transport.rank, x_sorted.device)
        self.last_plan = plan
        rows = _Dispatch.apply(x_sorted, plan, self.transport)
        out = self.run_backend(rows, plan.expert_offsets)
        return _Combine.apply(out, plan, self.transport)


def _all_reduce_flat(grads: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Sum gradients over a group in place, one flat all-reduce per (device, dtype) bucket."""
    buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.device, g.dtype), []).append(g)
    for bucket in buckets.values():
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        for g, part in zip(bucket, flat.split([g.numel() for g in bucket]), strict=True):
            g.copy_(part.view_as(g))


@dataclass
class ParallelPlan:
    """The parallelism applied to one model: expert shards, data-parallel replicas, gradient bookkeeping.

    Ranks are laid out as D data-parallel replicas of an expert-parallel group of E ranks (W = D * E):
    rank r is EP rank r % E of replica r // E. `transport` moves rows inside the EP group (None: the
    experts are not sharded). `dense_group` holds every rank with a copy of the replicated weights
    (all W); `expert_replica_group` the D ranks holding the same expert shards (None when D = 1).

    Training objective: the sum of the ranks' losses, each normalised by the global count (tokens,
    samples). Summing replicated gradients over `dense_group` then gives the one-rank gradient; the
    expert gradients already hold every row of their EP group and are summed over the replicas."""

    model: nn.Module
    transport: Transport | None = None
    dense_group: dist.ProcessGroup | None = None
    expert_replica_group: dist.ProcessGroup | None = None
    fsdp_mesh: DeviceMesh | None = None
    """The mesh the dense weights are FSDP2-sharded over (trainer/fsdp.py); None: they are replicated."""
    reshard_after_forward: bool = True

    def shard_dense(self, model: nn.Module) -> None:
        """FSDP2 on `model`'s dense weights with this plan's mesh (nothing without one): the policy once its
        weights are final, and every model that mirrors it shard for shard (the frozen reference, the critic)."""
        if self.fsdp_mesh is not None:
            apply_fsdp(model, self.fsdp_mesh, self.reshard_after_forward)

    def fsdp_params(self) -> list[nn.Parameter]:
        return fsdp_params(self.model)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The expert-parallel group (None without sharded experts)."""
        return None if self.transport is None else self.transport.group

    def expert_params(self) -> list[nn.Parameter]:
        return [p for m in self.model.modules() if isinstance(m, ShardedExperts) for p in m.parameters()]

    def replicated_params(self) -> list[nn.Parameter]:
        """Trained parameters every rank holds whole (neither EP- nor FSDP-sharded): their gradients are
        all-reduced here."""
        sharded = {id(p) for p in self.expert_params() + self.fsdp_params()}
        return [p for p in self.model.parameters() if p.requires_grad and id(p) not in sharded]

    def reduce_gradients(self) -> None:
        """Sum replicated gradients over `dense_group` and expert shards' over `expert_replica_group`.

        A parameter without a gradient on this rank contributes zeros (another rank may have one)."""
        for params, group in (
            (self.replicated_params(), self.dense_group),
            (self.expert_params(), self.expert_replica_group),
        ):
            if group is None:
                continue
            grads = []
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.append(_local(p.grad))
            _all_reduce_flat(grads, group)

    def reduce_expert_load(self) -> None:
        """Sum every MoE layer's tokens_per_expert over all ranks, so the bias update and router
        telemetry see the global load and every rank applies the same bias step."""
        if self.dense_group is None:
            return
        layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        if not layers:
            return
        load = torch.stack([m.tokens_per_expert for m in layers])
        dist.all_reduce(load, group=self.dense_group)
        for m, row in zip(layers, load, strict=True):
            m.tokens_per_expert.copy_(row)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients: the replicated part once (equal on every rank after the
        reduction), the expert part summed over the shards of the EP group, the FSDP part over the dp_shard
        ranks (FSDP reduced it already; its replicas hold equal shards)."""
        device = next(iter(self.model.parameters())).device

        def squares(params: list[nn.Parameter]) -> torch.Tensor:
            norms = [torch.linalg.vector_norm(_local(p.grad).float()) for p in params if p.grad is not None]
            return torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)

        experts = squares(self.expert_params())
        if self.group is not None:
            dist.all_reduce(experts, group=self.group)
        total = squares(self.replicated_params()) + experts
        if self.fsdp_mesh is not None:
            dense = squares(self.fsdp_params())
            dist.all_reduce(dense, group=self.fsdp_mesh.get_group(SHARD_DIM))
            total = total + dense
        return total.sqrt()

    def clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_; returns the norm."""
        norm = self.grad_norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.replicated_params() + self.expert_params() + self.fsdp_params():
            if p.grad is not None:
                _local(p.grad).mul_(coef.to(p.grad.device))
        return float(norm)


def apply_expert_parallel(
    model: nn.Module,
    transport: Transport,
    dense_group: dist.ProcessGroup | None = None,
    expert_replica_group: dist.ProcessGroup | None = None,
) -> ParallelPlan:
    """Shard the routed experts of every MoE layer of `model` over the transport's group, in place.

    Call after the model is built, initialised (or loaded) and moved to its device: rank r keeps
    experts [r * E/W, (r + 1) * E/W) of the full weights it holds (or, for experts on the meta device, gets that
    block uninitialised on the device of the model's other weights, for a streamed import to fill). All ranks must apply it to
    identical models and then run the same sequence of forwards and backwards. `dense_group` (default:
    the transport's group) and `expert_replica_group` are those of `ParallelPlan`."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("the model has no MoE layer to apply expert parallelism to")
    mesh = None
    device = next(p.device for p in model.parameters() if not p.is_meta)
    if transport.group is not None:
        mesh = DeviceMesh.from_group(transport.group, device.type)
    for moe in layers:
        if not isinstance(moe.experts, Experts):
            raise ValueError(f"expert parallelism is already applied to this model ({type(moe.experts).__name__})")
        moe.experts = ShardedExperts(moe.experts, transport, mesh, device)
    return ParallelPlan(
        model, transport, dense_group if dense_group is not None else transport.group, expert_replica_group
    )
