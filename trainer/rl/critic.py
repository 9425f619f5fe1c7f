"""The critic of trainer.rl.algorithm = "ppo": a value model (the policy's trunk and a scalar head) trained beside
the policy, and the PPO step that uses it.

The value model is a `Transformer` of the policy's shape whose LM head is replaced by `value_head`
(Linear(hidden, 1), zero-initialised so the first values are 0); its trunk is copied from the policy when RL
starts (trainer.init's weights, again after the warm start). It trains on its own `TrainingCore`: the same
parallel plan as the policy's (its experts sharded over the same expert-parallel groups, built the same way
and in the same order on every rank), its own optimizer at trainer.rl.critic.lr, and the core's
micro-batching and reduction, so W ranks compute one rank's critic update as they do the policy's.

A PPO step (`ppo_step`, every rank): the old values of every row (no grad, this rank's rows, then gathered so
every rank holds the global [B, T]); token rewards, GAE and global whitening (trainer/rl/gae.py); the policy's
updates exactly as GRPO's but with per-token advantages (skipped during the critic's warm-up); then the
critic's updates on the same mini-batches with the clipped value loss.

Left out: routing replay for the critic (its routers are its own, not the policy's that vLLM replays), and a
critic sharing the policy's trunk (a second trunk doubles memory but keeps the policy's gradient its own).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from common.config import Config, ModelConfig, RLConfig
from trainer.core import Batch, LossFn, LossOutput, StepResult, TrainingCore, Update
from trainer.experts import expert_shape, select_backend
from trainer.model import Transformer
from trainer.model.moe import refresh_expert_weight_copies
from trainer.ranks import Ranks
from trainer.rl.gae import explained_variance, gae, masked_mean_std, token_rewards, value_loss, whiten
from trainer.rl.kl import kl_estimate
from trainer.rl.update import proximal_fn, rl_updates, row_sampling


class ValueModel(Transformer):
    """The policy's architecture with a scalar value head instead of the LM head."""

    def __init__(self, cfg: ModelConfig, experts_backend: str = "reference") -> None:
        super().__init__(cfg, experts_backend)
        del self.lm_head
        self.value_head = nn.Linear(cfg.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        routing: torch.Tensor | None = None,
        replay: bool = False,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """tokens [B, S] -> values [B, S] (float32): position t values the state before target t (the prefix
        tokens[:t+1]), aligned with `targets` like the log-probs (`documents`: packed rows, see Transformer)."""
        return self.value_head(self.hidden_states(tokens, positions, routing, replay, documents)).squeeze(-1).float()


def value_model(model: Transformer) -> ValueModel:
    if not isinstance(model, ValueModel):
        raise TypeError(f"the critic's core must hold a ValueModel, not {type(model).__name__}")
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def copy_trunk(policy: Transformer, critic: ValueModel) -> None:
    """Write the policy's trunk (every parameter and persistent buffer but the LM head) into the critic. Both
    carry the same parallel plan, so each rank copies its own shards."""
    source = policy.state_dict(keep_vars=True)
    target = critic.state_dict(keep_vars=True)
    missing = [k for k in target if not k.startswith("value_head.") and k not in source]
    if missing:
        raise ValueError(f"the critic has tensors the policy lacks: {missing[:5]}; build it from the policy's config")
    for name, t in target.items():
        if not name.startswith("value_head."):
            _local(t).copy_(_local(source[name]))
    refresh_expert_weight_copies(critic)


def critic_config(cfg: Config) -> Config:
    """The config the critic's core trains under: trainer.optim with every learning rate at
    trainer.rl.critic.lr (the other knobs and the schedule as the policy's)."""
    lr = cfg.trainer.rl.critic.lr
    optim = dataclasses.replace(cfg.trainer.optim, lr=lr, router_lr=lr, expert_lr=lr)
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, optim=optim))


def build_critic(cfg: Config, ranks: Ranks, policy: Transformer) -> TrainingCore:
    """The critic's core: a ValueModel sharded like the policy (its plan is built after the policy's, in the
    same order on every rank), its trunk copied from `policy` (already sharded by its core)."""
    tc = cfg.trainer
    dtype = torch.bfloat16 if tc.dtype == "bfloat16" else torch.float32
    backend = select_backend(tc.experts.backend, ranks.device, dtype, tc.experts.precision, expert_shape(tc.model))
    # Built on the device; its weights, but the zeroed head's, are overwritten by the policy's below.
    core = TrainingCore(critic_config(cfg), ranks, ValueModel(tc.model, backend).to(ranks.device))
    copy_trunk(policy, value_model(core.model))
    return core


def old_values(critic: TrainingCore, batch: Batch, rows_per_forward: int) -> torch.Tensor:
    """The critic's values [B, T] of every row of the global batch (no grad, with the weights that begin the
    step), identical on every rank; 0 outside the mask."""
    tokens = {"tokens": batch["tokens"]}  # all the critic reads: the rest of the batch stays where it is
    values = critic.evaluate(tokens, lambda model, mb: value_model(model)(mb["tokens"]), rows_per_forward)
    return values * batch["mask"].to(values.dtype)


def value_loss_fn(clip: float, total: float, step_total: float) -> LossFn:
    """The critic's loss on a micro-batch {"tokens", "mask", "returns", "old_values"}: the clipped value loss
    summed over its tokens and divided by `total`, the update's tokens over all ranks (so W ranks = one rank).
    Statistics are weighted so that, summed over micro-batches, updates and ranks, they are the step's means."""
    share = total / step_total

    def loss_fn(model: Transformer, mb: Batch) -> LossOutput:
        mask = mb["mask"]
        values = value_model(model)(mb["tokens"])
        per_token, clipped = value_loss(values, mb["old_values"], mb["returns"], clip)
        loss = (per_token * mask).sum() / total
        stats = {
            "critic/value_loss": float(loss.detach()) * share,
            "critic/value_clip_fraction": float((clipped.to(mask.dtype) * mask).sum()) / step_total,
        }
        return LossOutput(loss, stats)

    return loss_fn


def critic_updates(batch: Batch, rows: Sequence[slice], clip: float) -> list[Update]:
    """The critic's optimizer updates of one step: one per mini-batch of rows, each normalised by its tokens."""
    mask = batch["mask"]
    step_total = float(mask.sum())
    keep = ("tokens", "mask", "returns", "old_values")
    updates = []
    for r in rows:
        total = float(mask[r].sum())
        updates.append(Update({k: batch[k][r] for k in keep}, value_loss_fn(clip, total, step_total), int(total)))
    return updates


@dataclasses.dataclass
class Advantages:
    """The PPO advantages of a step's global batch, and their figures (the same on every rank)."""

    advantages: torch.Tensor
    """[B, T], whitened when trainer.rl.whiten_advantages."""
    returns: torch.Tensor
    """[B, T]: the critic's targets (unwhitened advantages + old values)."""
    figures: dict[str, float]


def ppo_advantages(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    rl: RLConfig,
    kl_penalty: torch.Tensor | None = None,
) -> Advantages:
    """rewards [B], old values [B, T], mask [B, T] -> token advantages and returns: GAE over each row's
    completion, then whitening over every token of the step (global: every rank holds the whole step).
    `kl_penalty` [B, T] (kl_mode = "reward"): kl_coef times the per-token KL estimate, subtracted from the token
    rewards before GAE."""
    per_token = token_rewards(rewards, mask)
    if kl_penalty is not None:
        per_token = per_token - kl_penalty.to(per_token.dtype) * mask.to(per_token.dtype)
    advantages, returns = gae(per_token, values, mask, rl.gamma, rl.gae_lambda)
    adv_mean, adv_std = masked_mean_std(advantages, mask)
    figures = {
        "rl/advantage_mean": adv_mean,
        "rl/advantage_std": adv_std,
        "critic/value_mean": masked_mean_std(values, mask)[0],
        "critic/return_mean": masked_mean_std(returns, mask)[0],
        "critic/explained_variance": explained_variance(values, returns, mask),
    }
    if rl.whiten_advantages:
        advantages = whiten(advantages, mask)
    return Advantages(advantages, returns, figures)


def kl_penalty(policy: TrainingCore, reference: Transformer, batch: Batch, rl: RLConfig) -> torch.Tensor:
    """kl_coef times the per-token KL estimate (trainer.rl.kl_estimator) of the policy that begins the step to
    the reference, on every sampled token of the global batch [B, T] (no grad; gathered on every rank): the
    reward penalty of kl_mode = "reward". A forward of the policy and one of the reference beyond the step's."""
    keys = ("tokens", "targets", "temperature", "top_k", "top_p", "routing")
    rows = {k: batch[k] for k in keys if k in batch}
    replay = rl.routing_replay == "rollout"

    def per_token(model: Transformer, mb: Batch) -> torch.Tensor:
        routing, sampling = mb.get("routing"), row_sampling(mb)
        logp = model.token_logprobs(mb["tokens"], mb["targets"], routing=routing, replay=replay, sampling=sampling)
        ref = reference.token_logprobs(mb["tokens"], mb["targets"], routing=routing, replay=replay, sampling=sampling)
        return kl_estimate(rl.kl_estimator, logp, ref)

    return rl.kl_coef * policy.evaluate(rows, per_token, rl.micro_batch_samples) * batch["mask"]


def ppo_step(
    policy: TrainingCore,
    critic: TrainingCore,
    batch: Batch,
    rows: Sequence[slice],
    rl: RLConfig,
    train_policy: bool,
    reference: Transformer | None = None,
    min_micro_batches: int = 1,
) -> StepResult:
    """One PPO step with a critic on every rank. `batch` holds the GRPO step's tensors with "rewards" [B] in
    place of "advantages"; `rows` its mini-batches. `train_policy` False (the critic's warm-up) leaves the
    policy untouched. `reference`: the frozen reference policy (its KL is a loss term, a reward penalty, or
    only logged, as trainer.rl says). `min_micro_batches`: trainer.optim.grad_accum, for both models' updates.
    The result's updates are the policy's (none in the warm-up); its figures the policy's (when trained), the
    critic's, and the step's advantage figures, with rl/policy_trained 1 or 0."""
    t0 = time.perf_counter()
    values = old_values(critic, batch, rl.micro_batch_samples)
    penalty = None
    if rl.kl_mode == "reward" and rl.kl_coef > 0:
        if reference is None:
            raise ValueError('trainer.rl.kl_mode = "reward" needs the frozen reference policy (kl_coef > 0 keeps one)')
        penalty = kl_penalty(policy, reference, batch, rl)
    adv = ppo_advantages(batch["rewards"], values, batch["mask"], rl, penalty)
    policy_batch = {k: v for k, v in batch.items() if k != "rewards"} | {"advantages": adv.advantages}
    figures: dict[str, float] = {}
    updates = []
    if train_policy:
        result = policy.step_updates(
            rl_updates(policy_batch, rows, rl),
            rl.micro_batch_samples,
            prepare=proximal_fn(rl, reference),
            min_micro_batches=min_micro_batches,
        )
        figures, updates = dict(result.figures), result.updates
    critic_batch = {"tokens": batch["tokens"], "mask": batch["mask"], "returns": adv.returns, "old_values": values}
    trained = critic.step_updates(
        critic_updates(critic_batch, rows, rl.critic.value_clip),
        rl.micro_batch_samples,
        min_micro_batches=min_micro_batches,
    )
    # The critic's core names its own terms (its aux_loss among them) beside the policy's: under critic/.
    figures |= {k if k.startswith("critic/") else f"critic/{k}": v for k, v in trained.figures.items()}
    figures |= adv.figures
    figures["critic/grad_norm"] = sum(u.grad_norm for u in trained.updates) / len(trained.updates)
    figures["rl/policy_trained"] = float(train_policy)
    return StepResult(updates, figures, time.perf_counter() - t0)
