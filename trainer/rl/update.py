"""The RL step on the training core: the decoupled PPO loss of an update's micro-batches (proximal
log-probs first), and the cut of a step's groups into PPO mini-batches, each one optimizer update
against the proximal policy of the weights that began the step (as verl's ppo_mini_batch_size and
AReaL's ppo_n_minibatches)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from common.config import RLConfig
from trainer.core import Batch, LossFn, Update, split_rows
from trainer.model.transformer import Transformer
from trainer.rl.loss import LossOutput, ppo_loss


def proximal_logprobs(model: Transformer, mb: Batch) -> Batch:
    """The RL step's first pass (the core's `prepare`): log-probs of the sampled tokens under the weights
    that began the step, for every micro-batch before any update."""
    return {"proximal": model.token_logprobs(mb["tokens"], mb["targets"])}


def rl_loss_fn(rl: RLConfig, total: float, step_total: float | None = None) -> LossFn:
    """The RL update's second pass: the decoupled PPO loss against the proximal log-probs, normalised by
    `total`, the token (token_mean) or sample (seq_mean) count of the update's rows over all ranks.
    `step_total`: the same count for the whole step when it is cut into several updates (mini-batches;
    default `total`). Statistics are weighted so that, summed over micro-batches, updates and ranks, they
    are the step's means: per-token ones by the micro-batch's share of the step's tokens (`step_tokens`),
    the loss terms by the update's share of `step_total`."""
    share = total / (step_total or total)

    def loss_fn(model: Transformer, mb: Batch) -> LossOutput:
        mask = mb["mask"]
        logp = model.token_logprobs(mb["tokens"], mb["targets"])
        out = ppo_loss(logp, mb["proximal"], mb["behaviour"], mb["advantages"], mask, rl, total=total)
        weight = float(mask.sum()) / float(mb["step_tokens"][0])
        stats = {k: v * share if k in ("loss", "pg_loss", "kl") else v if k == "tokens" or k.endswith(("_max", "_min"))
                 else v * weight for k, v in out.stats.items()}  # fmt: skip
        # On samples made entirely by the weights that began the step, behaviour and proximal log-probs come
        # from the same function: their gap is the trainer-vs-vLLM numerical mismatch.
        fresh = mask * mb["fresh"].unsqueeze(1)
        stats["fresh_abs_diff_sum"] = float(((mb["proximal"] - mb["behaviour"]).abs() * fresh).sum())
        stats["fresh_tokens"] = float(fresh.sum())
        return LossOutput(out.loss, stats)

    return loss_fn


def mini_batch_rows(group_sizes: Sequence[int], mini_batches: int) -> list[slice]:
    """The rows of each PPO mini-batch of a step whose rows are its groups' samples, group after group:
    whole groups, as even as possible in groups, in order; fewer mini-batches when there are fewer groups."""
    starts = [0, *itertools.accumulate(group_sizes)]
    cuts = split_rows(len(group_sizes), min(mini_batches, len(group_sizes)))
    return [slice(starts[c.start], starts[c.stop]) for c in cuts]


def rl_updates(batch: Batch, rows: Sequence[slice], rl: RLConfig) -> list[Update]:
    """The optimizer updates of one RL step: one per mini-batch of rows, each normalised on its own."""
    mask = batch["mask"]
    count = (lambda r: float(mask[r].sum())) if rl.aggregation == "token_mean" else (lambda r: float(r.stop - r.start))
    step_total = sum(count(r) for r in rows)
    updates = []
    for r in rows:
        loss_fn = rl_loss_fn(rl, count(r), step_total)
        updates.append(Update({k: v[r] for k, v in batch.items()}, loss_fn, int(mask[r].sum())))
    return updates
