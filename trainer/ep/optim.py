"""The optimizer step under expert parallelism: the trainer's AdamW step (same groups, schedule and
bias balancing) preceded by the all-reduce of the dense gradients and of the expert-load counts, with
the clipping norm taken over all ranks. Expert parameters are DTensor shards, so AdamW's moments for
them are shards too and checkpoint through DCP like the weights."""

from __future__ import annotations

from common.config import OptimConfig
from trainer.ep.parallel import ExpertParallel
from trainer.optim import Optimizer, StepStats


class ExpertParallelOptimizer(Optimizer):
    """`Optimizer` for a model with expert parallelism applied; `step(tokens)` takes the global token count."""

    def __init__(self, ep: ExpertParallel, cfg: OptimConfig) -> None:
        super().__init__(ep.model, cfg)
        self.ep = ep

    def clip_gradients(self, max_norm: float) -> float:
        return self.ep.clip_gradients(max_norm)

    def step(self, tokens: int) -> StepStats:
        self.ep.all_reduce_gradients()
        self.ep.all_reduce_expert_load()
        return super().step(tokens)
