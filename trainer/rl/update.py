"""The RL step on the training core: the decoupled PPO loss of an update's micro-batches (proximal
log-probs first), and the cut of a step's groups into PPO mini-batches, each one optimizer update
against the proximal policy of the weights that began the step (as verl's ppo_mini_batch_size and
AReaL's ppo_n_minibatches).

A batch may carry `routing` [B, S, MoE layers, k], the experts vLLM chose per token (trainer/rl/replay.py):
the first pass then measures, per row, how often the trainer's router disagrees with it, and with
trainer.rl.routing_replay = "rollout" both passes use it (rollout routing replay).

Both passes take log-probs under each sample's sampling distribution (the batch's "temperature", "top_k" and
"top_p" rows, trainer.model.sampling), the one vLLM's behaviour log-probs are of.

A batch may be packed (trainer/pack.py: "documents" and "positions" [B, S], every per-sample tensor given per
token): the passes then keep attention inside each sample and the loss takes per-sample terms per document."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import cast

import torch

from common.config import RLConfig
from trainer.core import Batch, LossFn, LossOutput, PrepareFn, StepResult, Update, split_rows
from trainer.model.sampling import RowSampling
from trainer.model.transformer import Transformer
from trainer.pack import documents_of, sample_count
from trainer.rl.loss import ppo_loss

# |log-prob gap| histogram edges for the step's p99 (summable over micro-batches and ranks): 20 bins a
# decade from 1e-9 to 1e2 nats, so the p99 is known to within a factor of 1.12.
GAP_EDGES = torch.logspace(-9, 2, 221, dtype=torch.float64)


def row_sampling(mb: Batch) -> RowSampling:
    """The sampling parameters of a batch's rows (its "temperature", "top_k" and "top_p" [B], or [B, S] packed)."""
    missing = [k for k in ("temperature", "top_k", "top_p") if k not in mb]
    if missing:
        raise KeyError(
            f"an RL batch needs each row's sampling parameters; missing {missing} (trainer.rl.batch.sampling_rows)"
        )
    return RowSampling(mb["temperature"], mb["top_k"], mb["top_p"])


def proximal_fn(rl: RLConfig, reference: Transformer | None = None) -> PrepareFn:
    """The RL step's first pass (the core's `prepare`): log-probs of the sampled tokens under the weights
    that began the step, for every micro-batch before any update; with a routing, each row's router
    disagreement counts (token-layer pairs) beside them; with a `reference` (the frozen reference policy,
    trainer/rl/reference.py), its log-probs of the same tokens under "reference", routed as the policy is."""

    def prepare(model: Transformer, mb: Batch) -> Batch:
        routing = mb.get("routing")
        replay = rl.routing_replay == "rollout"
        sampling = row_sampling(mb)
        positions, documents = mb.get("positions"), documents_of(mb)
        out = {
            "proximal": model.token_logprobs(
                mb["tokens"], mb["targets"], positions, routing, replay, sampling, documents
            )
        }
        if routing is not None:
            differ, compared = model.routing_disagreement()
            out["routing_differ"], out["routing_compared"] = differ.float(), compared.float()
        if reference is not None:
            out["reference"] = reference.token_logprobs(
                mb["tokens"], mb["targets"], positions, routing, replay, sampling, documents
            )
        return out

    return prepare


def gap_quantile(hist: torch.Tensor, q: float) -> float:
    """The upper edge of the GAP_EDGES bin holding quantile q of a histogram of |log-prob gaps|."""
    total = float(hist.sum())
    if total == 0:
        return 0.0
    index = int(torch.searchsorted(hist.cumsum(0), torch.tensor(q * total, dtype=hist.dtype)))
    return float(GAP_EDGES[min(index + 1, len(GAP_EDGES) - 1)])


def rl_loss_fn(rl: RLConfig, total: float, step_total: float | None = None) -> LossFn:
    """The RL update's second pass: the decoupled PPO loss against the proximal log-probs (and the KL to the
    reference's, when the first pass gave them), normalised by `total`, the token (token-mean) or sample
    (seq-mean-*) count of the update's rows over all ranks (`update_count`).
    `step_total`: the same count for the whole step when it is cut into several updates (mini-batches;
    default `total`). Statistics are weighted so that, summed over micro-batches, updates and ranks, they
    are the step's means: per-token ones by the micro-batch's share of the step's tokens (`step_tokens`),
    the loss terms by the update's share of `step_total`."""
    share = total / (step_total or total)

    def loss_fn(model: Transformer, mb: Batch) -> LossOutput:
        mask = mb["mask"]
        routing = mb.get("routing") if rl.routing_replay == "rollout" else None
        documents = documents_of(mb)
        logp = model.token_logprobs(
            mb["tokens"], mb["targets"], mb.get("positions"), routing, routing is not None, row_sampling(mb), documents
        )
        # Sampled tokens the trainer's truncation set leaves out (kept in their own set instead): a count, summed.
        outside = float(model.sampling_outside().sum())
        out = ppo_loss(
            logp,
            mb["proximal"],
            mb["behaviour"],
            mb["advantages"],
            mask,
            rl,
            ref_logp=mb.get("reference"),
            total=total,
            documents=documents,
        )
        # The same number on every row (packed: on every token; a row's first token is always a sample's).
        weight = float(mask.sum()) / float(mb["step_tokens"].flatten()[0])
        stats = {
            k: v * share
            if k in ("loss", "pg_loss", "kl", "kl_k1", "kl_k3")
            else v
            if k == "tokens" or k.endswith(("_max", "_min"))
            else v * weight
            for k, v in out.stats.items()
        }
        # On samples made entirely by the weights that began the step, behaviour and proximal log-probs come
        # from the same function: their gap is the trainer-vs-vLLM numerical mismatch.
        fresh = mask * (mb["fresh"] if documents is not None else mb["fresh"].unsqueeze(1))
        stats["fresh_abs_diff_sum"] = float(((mb["proximal"] - mb["behaviour"]).abs() * fresh).sum())
        stats["fresh_tokens"] = float(fresh.sum())
        stats["sampling_outside_tokens"] = outside
        gaps = (mb["proximal"] - mb["behaviour"]).abs()[mask > 0].double().cpu()
        stats["gap_hist"] = torch.histogram(gaps.clamp(GAP_EDGES[0], GAP_EDGES[-1]), GAP_EDGES).hist  # type: ignore[assignment]
        if "routing_differ" in mb:
            stats["routing_differ"] = float(mb["routing_differ"].sum())
            stats["routing_compared"] = float(mb["routing_compared"].sum())
        return LossOutput(out.loss, stats)

    return loss_fn


def mini_batch_rows(group_sizes: Sequence[int], mini_batches: int) -> list[slice]:
    """The rows of each PPO mini-batch of a step whose rows are its groups' samples, group after group:
    whole groups, as even as possible in groups, in order; fewer mini-batches when there are fewer groups."""
    starts = [0, *itertools.accumulate(group_sizes)]
    cuts = split_rows(len(group_sizes), min(mini_batches, len(group_sizes)))
    return [slice(starts[c.start], starts[c.stop]) for c in cuts]


def update_count(batch: Batch, aggregation: str) -> float:
    """The normaliser of an update's rows (padded or packed): its completion tokens (token-mean) or its samples
    (seq-mean-token-sum, seq-mean-token-mean)."""
    if aggregation == "token-mean":
        return float(batch["mask"].sum())
    if aggregation in ("seq-mean-token-sum", "seq-mean-token-mean"):
        return float(sample_count(batch))
    raise ValueError(f"unknown aggregation {aggregation!r}; use token-mean, seq-mean-token-sum or seq-mean-token-mean")


def rl_updates(batch: Batch, rows: Sequence[slice], rl: RLConfig) -> list[Update]:
    """The optimizer updates of one RL step: one per mini-batch of rows, each normalised on its own."""
    parts = [{k: v[r] for k, v in batch.items()} for r in rows]
    step_total = sum(update_count(part, rl.aggregation) for part in parts)
    return [
        Update(part, rl_loss_fn(rl, update_count(part, rl.aggregation), step_total), int(part["mask"].sum()))
        for part in parts
    ]


def rl_step_figures(result: StepResult) -> dict[str, float]:
    """The loss/* figures of an RL step from its reduced statistics: the sums `rl_loss_fn` adds become the
    trainer-vs-vLLM mismatch on fresh samples, the p99 log-prob gap and the routing disagreement."""
    figures = dict(result.figures)
    figures["updates"] = len(result.updates)
    if not result.updates:  # PPO's critic warm-up: the policy did not train, the critic's figures are all
        return figures
    abs_sum, fresh_tokens = figures.pop("fresh_abs_diff_sum", 0.0), figures.pop("fresh_tokens", 0.0)
    if fresh_tokens > 0:
        figures["fresh_logprob_mismatch"] = abs_sum / fresh_tokens
    # The histogram rides among the float statistics (summed over micro-batches and ranks like them).
    gap_hist = cast(torch.Tensor, figures.pop("gap_hist"))
    figures["behaviour_proximal_abs_logp_diff_p99"] = gap_quantile(gap_hist, 0.99)
    differ, compared = figures.pop("routing_differ", 0.0), figures.pop("routing_compared", 0.0)
    if compared > 0:
        figures["routing_disagreement"] = differ / compared
    figures["grad_norm"] = sum(u.grad_norm for u in result.updates) / len(result.updates)
    return figures
