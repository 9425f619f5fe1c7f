"""The training core: the one training step of every path (next-token pretraining, the supervised warm
start, the RL update). It owns the model, its parallel plan (routed experts sharded over an
expert-parallel group with RDEP, everything else data parallel over the ranks), the optimizer
(dense / router / expert learning rates, WSD, clipping, the router-bias update), bf16 autocast over
fp32 masters, the sequence aux loss, micro-batching with gradient accumulation, per-layer router
telemetry and checkpoints.

Drivers hand `step` the step's global batch (the same rows on every rank: rank 0 broadcasts it, or
every rank reads the same data) and a loss. The core takes this rank's contiguous share of the rows,
cuts it into the same number of micro-batches on every rank (every MoE forward is a collective of
the expert-parallel group), and sums the micro-batch losses, which the loss normalises by the global
count (tokens or samples). Summed over ranks the gradient is then the one-rank gradient, so W ranks
compute W = 1's update up to floating-point summation order.

A step may be several optimizer updates (`step_updates`: the PPO mini-batches of an RL step); each
update's rows are split over the ranks on their own, and `prepare` (the proximal log-probs) sees all
of them with the weights that began the step. `evaluate` is a no-grad pass over the global batch whose
per-row results every rank receives (PPO's old values). Models checkpointed beside this one (PPO's
critic, the frozen reference policy of the KL term) are its `companions`.

The dense weights are replicated, their gradients all-reduced in flat buckets, or with
`trainer.parallel.dp_shard` FSDP2-sharded (trainer/fsdp.py).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from common.config import Config
from trainer.checkpoint import Companion, TrainState, list_checkpoints, load_checkpoint, save_checkpoint
from trainer.ep import ParallelPlan, apply_expert_parallel, make_transport
from trainer.fsdp import OwnerGather, dense_mesh
from trainer.hf import hf_tensors
from trainer.model import Transformer, compile_blocks
from trainer.optim import Optimizer, StepStats, autocast
from trainer.plan import state_bytes
from trainer.ranks import Ranks

log = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]


@dataclass
class LossOutput:
    """What a loss gives the core for one micro-batch: the scalar to minimise and its float statistics."""

    loss: torch.Tensor
    stats: dict[str, float]


LossFn = Callable[[Transformer, Batch], LossOutput]
"""(model, micro-batch) -> the micro-batch's loss, normalised by the step's global count, and its stats.
Stats are summed over micro-batches and ranks, except names ending in _max / _min (max / min)."""
PrepareFn = Callable[[Transformer, Batch], Batch]
"""(model, micro-batch) -> extra tensors for that micro-batch, computed before any update (no grad,
eval mode); e.g. the proximal log-probs of the RL update."""


@dataclass
class Update:
    """One optimizer update of a step: its global rows, its loss, and its trained tokens over all ranks."""

    batch: Batch
    loss_fn: LossFn
    tokens: int


@dataclass
class StepResult:
    """What one step (one or more optimizer updates) did."""

    updates: list[StepStats]
    figures: dict[str, float]
    """The loss functions' statistics reduced over micro-batches, updates and ranks."""
    seconds: float

    @property
    def optim(self) -> StepStats:
        """The last update's statistics."""
        return self.updates[-1]


def rank_rows(n: int, world: int, rank: int) -> slice:
    """Rank `rank`'s contiguous share of n rows: the first n % world ranks take one row more."""
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def split_rows(n: int, parts: int) -> list[slice]:
    """n rows cut into `parts` consecutive pieces as equal as possible (some empty when n < parts)."""
    return [rank_rows(n, parts, i) for i in range(parts)]


def reduce_figures(per_part: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Sum statistics over parts (micro-batches, ranks); _max / _min names take the max / min."""
    out: dict[str, float] = {}
    for figures in per_part:
        for k, v in figures.items():
            if k not in out:
                out[k] = v
            elif k.endswith("_max"):
                out[k] = max(out[k], v)
            elif k.endswith("_min"):
                out[k] = min(out[k], v)
            else:
                out[k] = out[k] + v  # tensors (histograms) too
    return out


def build_plan(
    model: Transformer, ranks: Ranks, ep: int, transport: str, dp_shard: int = 1, reshard_after_forward: bool = True
) -> ParallelPlan | None:
    """The parallel plan of W ranks = dp_replicate x dp_shard x ep (ep innermost: rank r is EP rank r % ep),
    with the routed experts of `model` sharded over their EP group in place; None for one rank. The dense
    weights are FSDP2-sharded later, by `ParallelPlan.shard_dense`, once they are final (after a load).

    Every rank creates every group in the same order (torch.distributed requires it)."""
    W = ranks.world
    if W % ep:
        raise ValueError(
            f"trainer.parallel.ep = {ep} does not divide the trainer's {W} ranks; set ep to a divisor of {W} "
            "(or start a multiple of ep ranks)"
        )
    if W == 1:
        return None
    backend = "nccl" if ranks.device.type == "cuda" else "gloo"
    world_group = dist.group.WORLD
    mesh = dense_mesh(W, ep, dp_shard, ranks.device.type) if dp_shard > 1 else None
    log.info(
        "parallel plan: %d ranks = %d data-parallel replica(s) x expert-parallel %d%s",
        W,
        W // ep,
        ep,
        f", dense weights FSDP2-sharded over {dp_shard} of them" if mesh is not None else "",
    )
    if ep == 1:
        return ParallelPlan(model, None, world_group, None, mesh, reshard_after_forward)
    ep_groups = [dist.new_group(list(range(d * ep, (d + 1) * ep)), backend=backend) for d in range(W // ep)]
    replica_groups = [dist.new_group(list(range(e, W, ep)), backend=backend) for e in range(ep)] if W > ep else []
    kind = "p2p" if transport == "auto" else transport
    log.info("expert rows travel by the %s transport", kind)
    ep_group = ep_groups[ranks.rank // ep]
    replica_group = replica_groups[ranks.rank % ep] if replica_groups else None
    plan = apply_expert_parallel(model, make_transport(kind, ep_group), world_group, replica_group)
    plan.fsdp_mesh, plan.reshard_after_forward = mesh, reshard_after_forward
    return plan


class TrainingCore:
    """The model of one trainer rank with its plan and optimizer; every path trains through `step`."""

    def __init__(
        self, cfg: Config, ranks: Ranks, model: Transformer, load: Callable[[Transformer], object] | None = None
    ) -> None:
        """`model`: the full initial model on `ranks.device` (every rank holds the same weights); the
        core shards its experts by trainer.parallel. `load`: when given, fills the weights once the experts
        are sharded (a streamed HF import, which then reads only this rank's experts: trainer/setup.py)."""
        tc = cfg.trainer
        self.cfg, self.ranks, self.model = cfg, ranks, model
        self.device = ranks.device
        par = tc.parallel
        self.plan = build_plan(model, ranks, par.ep, par.transport, par.dp_shard, par.reshard_after_forward)
        if load is not None:
            load(model)
        model.activation_checkpoint = tc.activation_checkpoint
        if tc.compile:
            compile_blocks(model)  # after the plan: the expert exchange runs eagerly inside compiled blocks
        if self.plan is not None:
            self.plan.shard_dense(model)  # FSDP2 last, over the final weights (trainer/fsdp.py)
        self.optimizer = Optimizer(model, tc.optim, self.plan)  # the one optimizer of the trainer
        self.aux_coef = tc.optim.seq_aux_loss_coef
        model.set_aux_loss(self.aux_coef > 0)
        self.companions: dict[str, Companion] = {}
        """Models checkpointed with this one (the critic of PPO, the frozen reference), by name."""
        sharded = self.plan is not None
        dense, experts, grads, moments = state_bytes(cfg, par.ep if sharded else 1, par.dp_shard if sharded else 1)
        self.planned_state = dense + experts + grads + moments
        """trainer/plan.py's weight + gradient + optimizer bytes of this rank (activations: `slipstream plan`)."""
        self._peak_logged = False
        self._owners: OwnerGather | None = None
        log.info(
            "planned bytes per rank (trainer/plan.py): params %.2f GiB (dense %.2f, routed experts %.2f), grads "
            "%.2f GiB, optimizer %.2f GiB",
            (dense + experts) / 2**30,
            dense / 2**30,
            experts / 2**30,
            grads / 2**30,
            moments / 2**30,
        )
        if tc.pack and not tc.packs() and ranks.is_main:
            # Said once, at the start: a run asked to pack that trains padded rows should not be a surprise.
            log.info("trainer.pack = true, but rows stay padded: %s", "; ".join(tc.padding_reasons()))

    # -- the step ------------------------------------------------------------------------------

    def my_micro_batches(self, batch: Batch, rows_per_forward: int, at_least: int = 1) -> list[Batch]:
        """This rank's rows of the global batch, in the same number of micro-batches on every rank: enough for
        `rows_per_forward` rows each, and at least `at_least` (gradient accumulation), never an empty one."""
        n = _rows(batch)
        if rows_per_forward < 1:
            raise ValueError(f"rows_per_forward must be >= 1, got {rows_per_forward}")
        W = self.ranks.world
        if n < W:
            raise ValueError(f"a step of {n} rows cannot feed {W} trainer ranks; give every step at least {W} rows")
        # Same count everywhere, and no rank gets an empty micro-batch (a forward of nothing is still a
        # collective under expert parallelism, and the model does not take empty batches).
        largest, smallest = -(-n // W), n // W
        count = min(max(at_least, math.ceil(largest / rows_per_forward)), smallest)
        mine = rank_rows(n, W, self.ranks.rank)
        return [
            {k: v[mine][part].to(self.device, non_blocking=True) for k, v in batch.items()}
            for part in split_rows(mine.stop - mine.start, count)
        ]

    def step(
        self,
        batch: Batch,
        loss_fn: LossFn,
        rows_per_forward: int,
        tokens: int,
        prepare: PrepareFn | None = None,
        lr: float | None = None,
    ) -> StepResult:
        """One optimizer update on the global `batch` (row-aligned tensors, the same on every rank).

        `tokens`: the step's trained tokens over all ranks (advances the WSD schedule). `lr`: a constant
        learning rate for every group instead of the schedule (the supervised warm start)."""
        return self.step_updates([Update(batch, loss_fn, tokens)], rows_per_forward, prepare, lr)

    def step_updates(
        self,
        updates: Sequence[Update],
        rows_per_forward: int,
        prepare: PrepareFn | None = None,
        lr: float | None = None,
        min_micro_batches: int = 1,
    ) -> StepResult:
        """Consecutive optimizer updates, one per `Update` (the PPO mini-batches of an RL step). `prepare`
        sees every update's micro-batches with the weights that began the step, before the first update.
        Each update's rows are split over the ranks on their own, so W ranks make W = 1's updates.
        `min_micro_batches`: each update takes at least this many micro-batches per rank (RL's grad_accum)."""
        t0 = time.perf_counter()
        dtype = self.cfg.trainer.dtype
        micro = [self.my_micro_batches(u.batch, rows_per_forward, min_micro_batches) for u in updates]
        if prepare is not None:
            self.model.eval()
            with torch.no_grad(), autocast(self.device, dtype):
                micro = [[{**mb, **prepare(self.model, mb)} for mb in mbs] for mbs in micro]
        self.model.train()
        parts: list[dict[str, float]] = []
        done: list[StepStats] = []
        for update, mbs in zip(updates, micro, strict=True):
            n = _rows(update.batch)
            for mb in mbs:
                with autocast(self.device, dtype):
                    out = update.loss_fn(self.model, mb)
                loss = out.loss
                aux = self.model.aux_loss()
                if aux is not None:
                    # The balance loss is a mean over sequences: weight each micro-batch by its share of the batch.
                    loss = loss + self.aux_coef * aux * (_rows(mb) / n)
                    out.stats["aux_loss"] = float(aux.detach()) * _rows(mb) / n / len(updates)
                loss.backward()
                parts.append(out.stats)
            done.append(self.optimizer.step(update.tokens, lr=lr))
        figures = reduce_figures(self.ranks.all_gather(reduce_figures(parts)))
        if not self._peak_logged and self.device.type == "cuda":
            self._peak_logged = True
            log.info(
                "planned vs allocated after the first step: weights+grads+optimizer %.2f GiB planned, "
                "torch.cuda.max_memory_allocated %.2f GiB (the rest: activations, see `slipstream plan`)",
                self.planned_state / 2**30,
                torch.cuda.max_memory_allocated(self.device) / 2**30,
            )
        return StepResult(done, figures, time.perf_counter() - t0)

    def evaluate(
        self, batch: Batch, fn: Callable[[Transformer, Batch], torch.Tensor], rows_per_forward: int
    ) -> torch.Tensor:
        """fn(model, micro-batch) -> a tensor per row, over every row of the global `batch`: each rank runs its
        rows (no grad, eval mode), then the rows are gathered in rank order, so every rank holds them all."""
        dtype = self.cfg.trainer.dtype
        self.model.eval()
        with torch.no_grad(), autocast(self.device, dtype):
            mine = [fn(self.model, mb).cpu() for mb in self.my_micro_batches(batch, rows_per_forward)]
        self.model.train()
        return torch.cat(self.ranks.all_gather(torch.cat(mine)))

    # -- checkpoints ---------------------------------------------------------------------------

    def save(self, root: Path, state: TrainState) -> Path:
        """Checkpoint (every rank writes its shards; DCP, resharded on load)."""
        state.tokens = self.optimizer.tokens
        keep = self.cfg.trainer.checkpoint.keep
        return save_checkpoint(root, self.model, self.optimizer, state, self.cfg, keep=keep, companions=self.companions)

    def resume(self, root: Path) -> TrainState | None:
        """Load the newest checkpoint under root (any world size and EP size wrote it), if resuming is on."""
        found = list_checkpoints(root) if self.cfg.trainer.checkpoint.resume else []
        # Every rank must agree on the checkpoint (one may see a directory another does not yet).
        chosen = self.ranks.broadcast(str(found[-1]) if found else None)
        if chosen is None:
            return None
        state = load_checkpoint(chosen, self.model, self.optimizer, self.cfg, companions=self.companions)
        log.info("resumed from %s at step %d", chosen, state.step)
        return state

    # -- publishing ----------------------------------------------------------------------------

    def hf_part(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The HF-named tensors this rank writes into a published version, on the CPU: rank 0 the dense
        part and its experts; the other ranks of the first expert-parallel group their experts; the
        data-parallel copies nothing (they hold the same experts). With FSDP-sharded dense weights each of
        those is written by one rank, its owner, which gathers it from its shards (trainer/fsdp.py's
        OwnerGather): every rank takes part, and none holds the whole model. The tensors may be the masters
        themselves (on a CPU `.to("cpu")` copies nothing): write them before the next step."""
        ep = self.cfg.trainer.parallel.ep if self.plan is not None and self.plan.transport is not None else 1
        rank = self.ranks.rank
        writes = self.ranks.world == 1 or rank < ep
        gather = None
        if self.plan is not None and self.plan.fsdp_mesh is not None:
            if self._owners is None:
                self._owners = OwnerGather(self.model, self.plan.fsdp_mesh, rank, self.ranks.world)
            gather = self._owners
        elif not writes:
            return {}
        part = hf_tensors(self.model, dtype, dense=rank == 0, experts=writes, gather=gather)
        return {name: t.detach().to("cpu") for name, t in part}


def _rows(batch: Mapping[str, torch.Tensor]) -> int:
    sizes = {k: v.shape[0] for k, v in batch.items()}
    if len(set(sizes.values())) != 1:
        raise ValueError(f"batch tensors disagree on the number of rows: {sizes}")
    return next(iter(sizes.values()))


def cross_entropy_loss(n_targets: int) -> LossFn:
    """Next-token cross-entropy over micro-batches {"tokens": [B, L], "targets": [B, L]} (targets < 0 are
    not trained), normalised by the step's global target count `n_targets`; packed rows (trainer/pack.py) carry
    their "positions" and "documents" too."""

    def loss_fn(model: Transformer, mb: Batch) -> LossOutput:
        logits = model(mb["tokens"], mb.get("positions"), documents=mb.get("documents"))
        targets = mb["targets"].reshape(-1)
        ce = torch.nn.functional.cross_entropy(
            logits.float().reshape(-1, logits.shape[-1]), targets.masked_fill(targets < 0, -100), reduction="sum"
        )
        return LossOutput(ce / n_targets, {"loss": float(ce.detach()) / n_targets})

    return loss_fn
