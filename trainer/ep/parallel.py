"""Applying expert parallelism to a built model from the outside: `apply_expert_parallel` swaps every
MoE layer's `experts` module for a `ShardedExperts` that holds only this rank's block of experts and
moves rows through a `Transport`; the model code stays rank-agnostic, since the seam is the expert
module's own contract (expert-sorted rows and offsets in, results for the same rows out). Expert
weights become DTensors sharded on dim 0 over the group, so torch.distributed.checkpoint saves them as
global-shape tensors with per-rank chunks and loads them at any other EP size; the dense weights stay
plain replicated tensors. `ExpertParallel` keeps the replicas in step: it all-reduces the dense
gradients and the expert-load counts (sum), and computes the global gradient norm; the expert
gradients already hold every source's contribution and are never reduced."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from trainer.ep.plan import DispatchPlan, make_plan
from trainer.ep.transport import Transport
from trainer.experts import BACKENDS
from trainer.model.moe import Experts, MoE


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


class ShardedExperts(nn.Module):
    """This rank's experts [E/W, ...] of one MoE layer, with the `Experts` contract over all E experts.

    Parameter names and global shapes are those of `Experts` (gate_up_proj [E, 2I, H], down_proj
    [E, H, I]); with a process group they are DTensors sharded on dim 0, alone they are the full
    tensors. `last_plan` keeps the plan of the latest forward for inspection."""

    def __init__(self, experts: Experts, transport: Transport, mesh: DeviceMesh | None) -> None:
        super().__init__()
        E = experts.gate_up_proj.shape[0]
        W, r = transport.world, transport.rank
        if E % W:
            raise ValueError(
                f"n_routed_experts = {E} does not split over an expert-parallel group of {W} ranks; "
                f"use a group size that divides {E}"
            )
        self.backend = experts.backend
        self.transport = transport
        self.num_experts = E
        El = E // W
        self.local_experts = range(r * El, (r + 1) * El)
        for name in ("gate_up_proj", "down_proj"):
            local = getattr(experts, name).detach()[r * El : (r + 1) * El].clone()
            if mesh is not None:
                local = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
            setattr(self, name, nn.Parameter(local, requires_grad=getattr(experts, name).requires_grad))
        self.last_plan: DispatchPlan | None = None

    # Host-side sizes and communication: compiled blocks run this part eagerly.
    @torch.compiler.disable
    def forward(self, x_sorted: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        counts = torch.diff(offsets.long(), prepend=offsets.new_zeros(1).long())
        plan = make_plan(self.transport.exchange_counts(counts), self.transport.rank, x_sorted.device)
        self.last_plan = plan
        rows = _Dispatch.apply(x_sorted, plan, self.transport)
        out = BACKENDS[self.backend](rows, plan.expert_offsets, _local(self.gate_up_proj), _local(self.down_proj))
        return _Combine.apply(out, plan, self.transport)


@dataclass
class ExpertParallel:
    """The applied expert parallelism of one model: its group, transport and gradient bookkeeping.

    Training objective under EP: the sum of the ranks' losses, each normalised by the global token
    count. Then summing the dense gradients over ranks gives the single-rank gradient, and the expert
    gradients (accumulated on the owners from every source) already are."""

    model: nn.Module
    transport: Transport

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self.transport.group

    def expert_params(self) -> list[nn.Parameter]:
        return [p for m in self.model.modules() if isinstance(m, ShardedExperts) for p in m.parameters()]

    def replicated_params(self) -> list[nn.Parameter]:
        sharded = {id(p) for p in self.expert_params()}
        return [p for p in self.model.parameters() if p.requires_grad and id(p) not in sharded]

    def all_reduce_gradients(self) -> None:
        """Sum the dense gradients over the group, one flat all-reduce per (device, dtype).

        A dense parameter without a gradient on this rank contributes zeros (another rank may have one)."""
        if self.group is None:
            return
        buckets: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
        for p in self.replicated_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets.setdefault((p.grad.device, p.grad.dtype), []).append(p)
        for params in buckets.values():
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            dist.all_reduce(flat, group=self.group)
            for p, g in zip(params, flat.split([p.numel() for p in params]), strict=True):
                p.grad.copy_(g.view_as(p.grad))

    def all_reduce_expert_load(self) -> None:
        """Sum every MoE layer's tokens_per_expert over the group, so the bias update and router
        telemetry see the global load and every rank applies the same bias step."""
        if self.group is None:
            return
        layers = [m for m in self.model.modules() if isinstance(m, MoE)]
        if not layers:
            return
        load = torch.stack([m.tokens_per_expert for m in layers])
        dist.all_reduce(load, group=self.group)
        for m, row in zip(layers, load, strict=True):
            m.tokens_per_expert.copy_(row)

    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of all gradients: the dense part once (replicas are equal after the all-reduce),
        the expert part summed over the shards."""
        device = next(iter(self.model.parameters())).device

        def squares(params: list[nn.Parameter]) -> torch.Tensor:
            norms = [torch.linalg.vector_norm(_local(p.grad).float()) for p in params if p.grad is not None]
            return torch.stack(norms).square().sum() if norms else torch.zeros((), device=device)

        experts = squares(self.expert_params())
        if self.group is not None:
            dist.all_reduce(experts, group=self.group)
        return (squares(self.replicated_params()) + experts).sqrt()

    def clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient by min(1, max_norm / (norm + 1e-6)), as torch's clip_grad_norm_; returns the norm."""
        norm = self.grad_norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
        for p in self.replicated_params() + self.expert_params():
            if p.grad is not None:
                _local(p.grad).mul_(coef.to(p.grad.device))
        return float(norm)


def apply_expert_parallel(model: nn.Module, transport: Transport) -> ExpertParallel:
    """Shard the routed experts of every MoE layer of `model` over the transport's group, in place.

    Call after the model is built, initialised (or loaded) and moved to its device: rank r keeps
    experts [r * E/W, (r + 1) * E/W) of the full weights it holds. All ranks must apply it to
    identical models and then run the same sequence of forwards and backwards."""
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if not layers:
        raise ValueError("the model has no MoE layer to apply expert parallelism to")
    mesh = None
    if transport.group is not None:
        device_type = layers[0].experts.gate_up_proj.device.type
        mesh = DeviceMesh.from_group(transport.group, device_type)
    for moe in layers:
        if isinstance(moe.experts, ShardedExperts):
            raise ValueError("expert parallelism is already applied to this model")
        moe.experts = ShardedExperts(moe.experts, transport, mesh)
    return ExpertParallel(model, transport)
