"""The frozen reference policy of the KL term: a model of the policy's shape on every trainer rank, sharded
by the same parallel plan (each rank holds the experts it holds of the policy), never trained (no optimizer,
no gradients, eval mode). Because the shards line up, making it the policy is a local copy on every rank,
with no communication; loading it from a checkpoint (trainer.rl.reference) loads the full model as
trainer.init is loaded and keeps this rank's shard. The training core checkpoints it as the "reference"
companion, so a resumed run has exactly the reference it had. Its shell is built as a full model on the
device and then sharded (as the policy is at start): a transient peak of one unsharded model per rank."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from trainer.ep import ParallelPlan, apply_expert_parallel
from trainer.model import Transformer, build_model
from trainer.model.moe import ExpertWeights, refresh_expert_weight_copies
from trainer.setup import load_weights


class ReferencePolicy:
    """The frozen reference model of one rank: `model` is what the RL step's first pass runs
    (trainer/rl/update.py proximal_fn) and what checkpoints hold."""

    def __init__(
        self, policy: Transformer, plan: ParallelPlan | None, device: torch.device, dtype: torch.dtype
    ) -> None:
        """A frozen copy of `policy` (this rank's part of it) under the same `plan`; `dtype`: the compute dtype
        of the trainer's forwards (trainer.dtype)."""
        self.plan, self.device = plan, device
        self.backend = next((m.backend for m in policy.modules() if isinstance(m, ExpertWeights)), "reference")
        self.model = self._frozen_shell(policy)
        if dtype != torch.float32 and self.backend != "reference":
            # The grouped GEMMs read a copy of the expert weights in the tokens' dtype; the policy's optimizer
            # keeps the policy's fresh, `copy_from` keeps this one fresh (made here, not per forward).
            for m in self.model.modules():
                if isinstance(m, ExpertWeights):
                    m.weight_copy(dtype)
        self.copy_from(policy)

    def _frozen_shell(self, policy: Transformer) -> Transformer:
        """A model of the policy's shape (weights not yet set), sharded like the policy, frozen."""
        model = self.shard(build_model(policy.cfg, self.backend, seed=None, device=self.device))
        model.requires_grad_(False)
        model.set_aux_loss(False)
        return model.eval()

    def shard(self, full: Transformer) -> Transformer:
        """`full` with the policy's plan applied: this rank keeps the experts it keeps of the policy, and the
        shards of the dense weights it keeps of the policy's (FSDP)."""
        if self.plan is not None and self.plan.transport is not None:
            apply_expert_parallel(full, self.plan.transport, self.plan.dense_group, self.plan.expert_replica_group)
        if self.plan is not None:
            self.plan.shard_dense(full)
        return full

    @torch.no_grad()
    def copy_from(self, source: Transformer) -> None:
        """Make the reference `source`'s weights: this rank's local tensors (its shards) copied one by one."""
        mine, theirs = self.model.state_dict(keep_vars=True), source.state_dict(keep_vars=True)
        if mine.keys() != theirs.keys():
            raise ValueError(
                f"the reference and the policy differ in tensors: {sorted(mine.keys() ^ theirs.keys())[:5]}"
            )
        for name, dst in mine.items():
            src = _local(theirs[name])
            if _local(dst).shape != src.shape:
                raise ValueError(
                    f"{name}: the reference's shard {tuple(_local(dst).shape)} is not the policy's {tuple(src.shape)}"
                )
            _local(dst).copy_(src)
        refresh_expert_weight_copies(self.model)  # the masters were written in place

    def load(self, path: Path) -> None:
        """Make the reference the weights at `path` (trainer.rl.reference): an HF directory or one of our
        checkpoints, loaded into a full model as trainer.init is, of which this rank keeps its shard."""
        full = build_model(self.model.cfg, self.backend, seed=None)
        load_weights(full, path, "trainer.rl.reference")
        self.copy_from(self.shard(full.to(self.device)))


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a (possibly sharded) tensor."""
    return t.to_local() if isinstance(t, DTensor) else t
