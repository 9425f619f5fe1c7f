"""The rank command protocol of the trainer: what rank 0 tells every rank to do next, and each rank's share.

Rank 0 (the RL driver, trainer/rl/driver.py) decides; it broadcasts one command record over the control
group and every rank (`TrainerRank`) executes it through one handler per command: a supervised step of the
warm start, the end of the warm start (the optimizer's moments reset), the start of RL (the frozen reference
policy and the critic made from the policy), an RL step (each rank trains its share of the global batch),
its part of a publish (its experts into the version's files), a sharded checkpoint, or the end. Commands are
plain records: they travel pickled, so they hold tensors and numbers, never behaviour.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.roles import RunContext
from common.weights.delta import DeltaEncoder
from common.weights.group import GroupSpec, ShardCaster
from common.weights.index import PartReport
from common.weights.writer import VersionPart, count_shards
from trainer.checkpoint import Companion, TrainState
from trainer.core import StepResult, TrainingCore, cross_entropy_loss
from trainer.model import compile_blocks
from trainer.ranks import Ranks
from trainer.rl.critic import build_critic, copy_trunk, ppo_step, value_model
from trainer.rl.reference import ReferencePolicy
from trainer.rl.update import proximal_fn, rl_updates
from trainer.setup import starting_model
from trainer.tinykit import resolve_model


class StopRequested(RuntimeError):
    """The role was told to stop (SIGTERM) while training."""


@dataclass
class SupervisedStep:
    """A supervised step (the warm start) on the core."""

    batch: dict[str, torch.Tensor]
    """The step's global batch (the same rows on every rank; each trains its share)."""
    target_tokens: int
    """Global normaliser of the loss: the batch's target tokens."""
    schedule_tokens: int
    """Trained tokens over all ranks that advance the learning-rate schedule (0: the warm start's own rate)."""
    lr: float | None


@dataclass
class ResetMoments:
    """The warm start ended: the optimizer forgets its moments."""


@dataclass
class StartRL:
    """RL starts (no resume), from the policy as it is now (after the warm start): the frozen reference policy
    becomes it (or the weights at trainer.rl.reference), PPO's critic takes its trunk."""


@dataclass
class RLStep:
    """RL step `step`: its optimizer updates (the PPO mini-batches) on the decoupled PPO loss."""

    batch: dict[str, torch.Tensor]
    """The step's global batch (the same rows on every rank; each trains its share)."""
    mini_batches: list[slice]
    """The rows of each optimizer update (whole groups). With trainer.rl.algorithm = "ppo" the batch holds
    "rewards" [B] instead of "advantages": the ranks compute per-token advantages with the critic."""
    step: int
    """The RL step (its samples made entirely by the weights of `step` are fresh)."""


@dataclass
class WritePart:
    """Write this rank's part (its experts) of weight version `version`; rank 0 writes the dense part and
    drives the workers (trainer/rl/driver.py `publish`)."""

    version: int


@dataclass
class Save:
    """A sharded checkpoint of `state`."""

    state: TrainState


@dataclass
class Stop:
    """The run is over: the ranks that follow rank 0 return."""


Command = SupervisedStep | ResetMoments | StartRL | RLStep | WritePart | Save | Stop


class RankPeers:
    """Rank 0's side of a publish the other ranks write parts of (common.weights.writer.PeerWriters)."""

    def __init__(self, ranks: Ranks, shard_counts: list[int]) -> None:
        self.ranks, self.shard_counts = ranks, shard_counts
        self.called = False

    def write(
        self, tmp: Path, first_shard: list[int], total_shards: int, base: int | None, group: GroupSpec | None = None
    ) -> list[PartReport]:
        self.called = True
        where = {"tmp": str(tmp), "first": first_shard, "total": total_shards, "base": base}
        self.ranks.broadcast({**where, "group": None if group is None else group.to_dict()})
        reports = self.ranks.all_gather(None)[1:]
        failed = [r for r in reports if isinstance(r, str)]
        if failed:
            raise RuntimeError("; ".join(failed))
        return reports

    def cancel(self) -> None:
        """The publish ended before the parts were asked for: release the ranks waiting for a place."""
        self.ranks.broadcast(None)


class TrainerRank:
    """One rank of the trainer: its share of every command. Rank 0 (`RLTrainer`) decides the commands."""

    def __init__(self, ctx: RunContext, ranks: Ranks) -> None:
        self.ctx, self.cfg, self.ranks = ctx, ctx.cfg, ranks
        self.device = ranks.device
        self.model_dir = resolve_model(self.cfg, ctx.run_dir)
        # Version 0 must be the function the workers serve: start from their checkpoint unless told otherwise.
        self.core = TrainingCore(self.cfg, ranks, *starting_model(self.cfg, self.device, self.model_dir))
        self.keep_companions()
        self.ckpt_root = ctx.run_dir / "checkpoints"
        self.shard_bytes = self.cfg.rollout.weight_shard_mb << 20
        # This rank's part of the last version it wrote, the base of its next delta (rank 0's is its transport's).
        self.delta = DeltaEncoder() if self.cfg.rollout.weight_delta and ranks.rank > 0 else None
        self.handlers: dict[type[Command], Callable[[Any], StepResult | None]] = {
            SupervisedStep: self.supervised_step,
            ResetMoments: self.reset_moments,
            StartRL: self.start_rl,
            RLStep: self.rl_step,
            WritePart: self.write_part,
            Save: self.save_shard,
            Stop: lambda _: None,
        }

    def execute(self, cmd: Command) -> StepResult | None:
        """This rank's share of `cmd`: a step's result, or None."""
        handler = self.handlers.get(type(cmd))
        if handler is None:
            raise ValueError(f"unknown trainer command {cmd!r}")
        return handler(cmd)

    def supervised_step(self, cmd: SupervisedStep) -> StepResult:
        loss = cross_entropy_loss(cmd.target_tokens)
        return self.core.step(
            cmd.batch, loss, self.cfg.trainer.warmup.batch_size, tokens=cmd.schedule_tokens, lr=cmd.lr
        )

    def reset_moments(self, cmd: ResetMoments) -> None:
        self.core.optimizer.reset_moments()

    def keep_companions(self) -> None:
        """The models RL keeps beside the policy, made before any resume so that a checkpoint's copies load into
        them: the frozen reference policy (`make_reference`; StartRL sets its weights on a fresh run)
        and PPO's value model, whose plan's process groups come after the policy's, in this order on every rank."""
        self.reference = self.make_reference()
        self.critic = None
        if self.cfg.trainer.rl.algorithm == "ppo":
            self.critic = build_critic(self.cfg, self.core.ranks, self.core.model)
            self.core.companions["critic"] = Companion(self.critic.model, self.critic.optimizer)

    def make_reference(self) -> ReferencePolicy | None:
        """The frozen reference policy when trainer.rl keeps one (kl_coef > 0 or log_kl), checkpointed with the
        policy as the "reference" companion; None otherwise (no memory spent)."""
        if not self.cfg.trainer.rl.keeps_reference:
            return None
        dtype = torch.bfloat16 if self.cfg.trainer.dtype == "bfloat16" else torch.float32
        reference = ReferencePolicy(self.core.model, self.core.plan, self.device, dtype)
        if self.cfg.trainer.compile:
            compile_blocks(reference.model)  # as the policy's: its first pass costs a forward of the policy
        self.core.companions["reference"] = Companion(reference.model)
        return reference

    def start_rl(self, cmd: StartRL) -> None:
        if self.critic is not None:
            copy_trunk(self.core.model, value_model(self.critic.model))
        if self.reference is None:
            return
        path = self.cfg.trainer.rl.reference
        if path:
            self.reference.load(Path(path))
        else:
            self.reference.copy_from(self.core.model)

    def rl_step(self, cmd: RLStep) -> StepResult:
        rl = self.cfg.trainer.rl
        every = rl.reference_refresh_steps
        if self.reference is not None and every > 0 and cmd.step > 0 and cmd.step % every == 0:
            self.reference.copy_from(self.core.model)  # before the first pass: this step's KL is to the policy of now
        if self.critic is not None:
            train_policy = cmd.step >= rl.critic.warmup_steps
            return ppo_step(
                self.core,
                self.critic,
                cmd.batch,
                cmd.mini_batches,
                rl,
                train_policy,
                reference=None if self.reference is None else self.reference.model,
                min_micro_batches=self.cfg.trainer.optim.grad_accum,
            )
        updates = rl_updates(cmd.batch, cmd.mini_batches, rl)
        return self.core.step_updates(
            updates,
            rl.micro_batch_samples,
            prepare=proximal_fn(rl, None if self.reference is None else self.reference.model),
            min_micro_batches=self.cfg.trainer.optim.grad_accum,
        )

    def write_part(self, cmd: WritePart) -> None:
        """A rank other than 0 in a publish: write this rank's experts where rank 0 says (rank 0's half of a
        publish is RLTrainer.publish: it drives the workers too)."""
        part = self.core.hf_part()
        self.ranks.all_gather(count_shards(part, self.shard_bytes))
        where = self.ranks.broadcast()
        if where is None:
            return
        caster = None
        if where["group"] is not None:  # the collective transport: each shard goes to the workers first
            caster = ShardCaster(GroupSpec.from_dict(where["group"]), self.ranks.rank)
        try:
            report: PartReport | str = VersionPart(
                Path(where["tmp"]),
                cmd.version,
                part,
                self.shard_bytes,
                where["first"][self.ranks.rank - 1],
                where["total"],
                self.delta,
                where["base"],
                None if caster is None else caster.send,
            ).write()
        except Exception as exc:  # reported to rank 0, which fails the publish and says why
            report = f"trainer rank {self.ranks.rank}: {type(exc).__name__}: {exc}"
        finally:
            if caster is not None:
                caster.close()
        self.ranks.all_gather(report)

    def save_shard(self, cmd: Save) -> None:
        self.core.save(self.ckpt_root, cmd.state)

    def follow(self, stop: threading.Event) -> int:
        """Ranks other than 0: resume like rank 0, then execute its commands until it says stop."""
        self.core.resume(self.ckpt_root)
        while not stop.is_set():
            cmd: Command = self.ranks.broadcast()
            self.execute(cmd)
            if isinstance(cmd, Stop):
                return 0
        raise StopRequested("stopped while following rank 0")
