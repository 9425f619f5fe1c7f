"""Expert parallelism (RDEP): dense weights replicated, routed experts sharded over ranks, rows sent to
their experts and back by point-to-point transports at offsets every rank derives from the exchanged
counts, so results are bitwise those of one rank. `apply_expert_parallel(model, transport)` applies it
from outside the model (a `ParallelPlan`, which trainer.optim.Optimizer takes); trainer.checkpoint
saves and reshards it."""

from trainer.ep.parallel import ParallelPlan, ShardedExperts, apply_expert_parallel
from trainer.ep.plan import DispatchPlan, make_plan
from trainer.ep.transport import (
    LocalTransport,
    ProcessGroupTransport,
    SymmetricMemoryTransport,
    Transport,
    TransportUnavailable,
    make_transport,
)

__all__ = [
    "DispatchPlan",
    "LocalTransport",
    "ParallelPlan",
    "ProcessGroupTransport",
    "ShardedExperts",
    "SymmetricMemoryTransport",
    "Transport",
    "TransportUnavailable",
    "apply_expert_parallel",
    "make_plan",
    "make_transport",
]
