"""FSDP2 for the dense half of the model (`trainer.parallel.dp_shard`).

The trainer's W ranks form a mesh W = dp_replicate x dp_shard x ep, laid out with ep innermost: rank r is
EP rank r % ep of data-parallel index d = r // ep, and d = replica * dp_shard + shard. The routed experts are
RDEP's (sharded over ep, their gradients summed over the ranks holding the same experts); everything else
(attention, dense MLPs, shared experts, router gates, norms, embeddings, the LM head) is sharded on dim 0 with
torch's `fully_shard` over the dp_shard ranks, and replicated (HSDP: reduce-scatter over dp_shard, all-reduce
over the rest) over the dp_replicate x ep ranks that hold the same shard. Each decoder block is one FSDP
unit (its parameters gathered for its forward and backward, and freed after the forward when
`trainer.parallel.reshard_after_forward`), the root another.

Numerics: the sharded parameters are the fp32 masters and are gathered in fp32; the bf16 compute is
autocast's on the gathered weights, as on one rank, so W ranks run W = 1's forward. Gradients are
reduced in fp32 as sums (divide factor 1): every rank's loss is already normalised by the global count, so
the sum is the one-rank gradient. Gathering bf16 copies instead (FSDP's MixedPrecisionPolicy) would halve
the gather traffic but change which ops see bf16 weights (norm gains, the router's gate), so W ranks would
no longer compute W = 1's step; it is not offered.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from trainer.model.moe import ExpertWeights
from trainer.model.transformer import Block

SHARD_DIM = "dp_shard"
REPLICATE_DIM = "dp_replicate_ep"


def mesh_ranks(world: int, ep: int, dp_shard: int) -> torch.Tensor:
    """The global ranks of the dense mesh [dp_replicate * ep, dp_shard]: row i holds the ranks that shard the
    dense weights among themselves, column j the ranks holding the same shard j."""
    if world % (ep * dp_shard):
        raise ValueError(
            f"trainer.parallel.ep = {ep} times trainer.parallel.dp_shard = {dp_shard} does not divide the trainer's "
            f"{world} ranks; start a multiple of {ep * dp_shard} ranks, or lower dp_shard"
        )
    replicas = world // (ep * dp_shard)
    return torch.arange(world).reshape(replicas, dp_shard, ep).permute(0, 2, 1).reshape(replicas * ep, dp_shard)


def dense_mesh(world: int, ep: int, dp_shard: int, device_type: str) -> DeviceMesh:
    """The mesh the dense weights are sharded over (every rank builds it, in the same order: its groups are
    collectives of the whole world). 1-D (dp_shard) when no rank holds a copy of another's shard."""
    ranks = mesh_ranks(world, ep, dp_shard)
    if ranks.shape[0] == 1:
        return DeviceMesh(device_type, ranks[0], mesh_dim_names=(SHARD_DIM,))
    return DeviceMesh(device_type, ranks, mesh_dim_names=(REPLICATE_DIM, SHARD_DIM))


def routed_expert_params(model: nn.Module) -> set[nn.Parameter]:
    """The routed experts' weights (RDEP's, left out of FSDP)."""
    return {p for m in model.modules() if isinstance(m, ExpertWeights) for p in m.parameters(recurse=False)}


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, reshard_after_forward: bool) -> list[FSDPModule]:
    """Shard every decoder block and then the root of `model` in place (see the module docstring); returns the
    FSDP units. Call once the weights are final on every rank (built, loaded, experts sharded)."""
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("FSDP is already applied to this model")
    ignored = routed_expert_params(model)
    for block in [m for m in model.modules() if isinstance(m, Block)]:
        mine = ignored & set(block.parameters())
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=mine)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, ignored_params=ignored)
    units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        # Plain sums (the loss is normalised by the global count), as SUM collectives: a divide factor of 1
        # alone asks for a pre-multiplied sum, which gloo does not have.
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return units


def fsdp_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters FSDP manages (sharded DTensors), in model order."""
    if not isinstance(model, FSDPModule):
        return []
    ignored = routed_expert_params(model)
    return [p for p in model.parameters() if p.requires_grad and p not in ignored]


class OwnerGather:
    """The FSDP-sharded dense tensors of a published version, each gathered whole on one rank only, its owner,
    which writes it: owners are dealt by size (largest first, to the rank with the fewest bytes so far), so
    each rank writes about 1/W of the dense bytes and no rank gathers the whole model. An owner gathers from
    the dp_shard ranks of its own mesh row (which hold every shard of the tensor); the other rows skip the
    tensor. Use as `hf_tensors(..., gather=OwnerGather(...))` on every rank, in the same order."""

    def __init__(self, model: nn.Module, mesh: DeviceMesh, rank: int, world: int) -> None:
        routed = {n for n, p in model.named_parameters() if p in routed_expert_params(model)}
        sizes = [
            (name, t.numel() * t.element_size())
            for name, t in model.state_dict().items()
            if isinstance(t, DTensor) and name not in routed
        ]
        load = [0] * world
        self.owners: dict[str, int] = {}
        for name, size in sorted(sizes, key=lambda s: -s[1]):
            owner = min(range(world), key=lambda r: (load[r], r))
            self.owners[name] = owner
            load[owner] += size
        self.rank = rank
        self.row = mesh.get_group(SHARD_DIM)
        self.row_ranks = dist.get_process_group_ranks(self.row)

    def __call__(self, name: str, shard: DTensor) -> torch.Tensor | None:
        owner = self.owners[name]
        if owner not in self.row_ranks:
            return None
        n = len(self.row_ranks)
        rows = shard.shape[0]
        block = -(-rows // n)  # FSDP2 cuts dim 0 as torch.chunk: blocks of ceil(rows / n), the last ones short
        local = shard.to_local()
        padded = local.new_zeros((block, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in range(n)] if self.rank == owner else None
        dist.gather(padded, parts, dst=owner, group=self.row)
        if parts is None:
            return None
        return torch.cat(parts)[:rows]
