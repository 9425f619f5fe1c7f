"""The decoupled PPO objective (as in AReaL) with truncated importance sampling.

Three policies meet here: the behaviour policy that sampled the tokens (vLLM, possibly several
weight versions old), the proximal policy (the trainer's weights before this update; its log-probs
are recomputed by the trainer), and the policy being optimised. The PPO ratio and its clip are taken
against the proximal policy, so staleness does not widen the trust region; the behaviour-to-proximal
importance weight corrects the off-policy sampling and is truncated at `tis_cap` to bound variance.
Advantages are one per sample (GRPO) or one per token (PPO with a critic); with `dual_clip` the surrogate of
a negative advantage is bounded below by dual_clip * A (dual-clip PPO). Optionally an estimate of KL to a
frozen reference policy (trainer/rl/kl.py) is added, aggregated like the policy-gradient term.

Beside the truncation, two corrections leave tokens out of the loss when behaviour and proximal policy
disagree too much (train/inference mismatch, or a sample too stale): token masking by a band on the
importance weight (`token_mask_band`, as IcePop), and sequence masking by a band on the sample's
geometric-mean weight (`seq_mask_band`). Masked tokens still count in the normaliser, so a micro-batch's
loss needs no knowledge of the others. The statistics say how many tokens each correction touched and
how far apart the two policies are (mean and largest |log-prob gap|, a k3 estimate of KL(behaviour ||
proximal)).

A row is one sample, or, packed (trainer/pack.py), several: then `documents` [B, T] names each token's sample
within its row, and every per-sample quantity (seq-mean-* aggregation, the sequence mask) is taken per
document, so packed and padded rows give the same loss.
"""

from __future__ import annotations

import math

import torch

from common.config import RLConfig
from trainer.core import LossOutput
from trainer.rl.kl import kl_estimate, kl_k1, kl_k3


def per_sample(values: torch.Tensor, documents: torch.Tensor | None) -> torch.Tensor:
    """Per-token values [B, T] summed per sample: [B] (a row is a sample), or, packed, one slot per
    (row, document) [B * T], slot row * T + document (slots of no document hold 0)."""
    if documents is None:
        return values.sum(dim=1)
    return values.new_zeros(values.numel()).index_add_(0, _slots(documents), values.reshape(-1))


def _slots(documents: torch.Tensor) -> torch.Tensor:
    """Each token's `per_sample` slot [B * T] (padding, document -1, shares slot 0 of its row: its values are masked)."""
    B, T = documents.shape
    rows = torch.arange(B, device=documents.device).unsqueeze(1) * T
    return (rows + documents.clamp(min=0)).reshape(-1)


def aggregate(
    values: torch.Tensor, mask: torch.Tensor, how: str, total: float | None, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """Per-token terms [B, T] -> one number by trainer.rl.aggregation: token-mean (sum over completion tokens /
    tokens), seq-mean-token-sum (per sample the sum of its tokens, / samples) or seq-mean-token-mean (per
    sample the mean of its tokens, / samples). `total`: the token (token-mean) or sample count of the whole
    update, so that micro-batches summed together give exactly the update's value (default: this batch's).
    `documents`: the samples of packed rows (a sample is then a document, not a row)."""
    samples = mask.shape[0] if documents is None else int((documents.amax(dim=1) + 1).sum())
    if how == "token-mean":
        return (values * mask).sum() / (mask.sum().clamp(min=1) if total is None else total)
    if how == "seq-mean-token-sum":
        return (values * mask).sum() / (samples if total is None else total)
    if how == "seq-mean-token-mean":
        per_seq = per_sample(values * mask, documents) / per_sample(mask, documents).clamp(min=1)
        return per_seq.sum() / (samples if total is None else total)
    raise ValueError(f"unknown aggregation {how!r}; use token-mean, seq-mean-token-sum or seq-mean-token-mean")


def ppo_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: RLConfig,
    ref_logp: torch.Tensor | None = None,
    total: float | None = None,
    documents: torch.Tensor | None = None,
) -> LossOutput:
    """All log-prob tensors are [batch, tokens] of the sampled tokens; advantages [batch] (one per sample, GRPO)
    or [batch, tokens] (per token, PPO with a critic); mask [batch, tokens].

    `ref_logp`: the frozen reference policy's log-probs; with them the statistics hold the KL to it (kl: the
    configured estimator, kl_k1, kl_k3) and, with cfg.kl_coef > 0 and kl_mode "loss", the loss adds kl_coef times the estimator
    aggregated like the policy-gradient term, over every completion token (the off-policy corrections mask
    only the policy-gradient term). `total`: for a micro-batch, the token count (token-mean) or sample count
    (seq-mean-*) of the whole update. `documents` [batch, tokens]: the samples of packed rows (advantages are
    then per token). Returns the scalar loss (to minimise) and float statistics of every term.
    """
    mask = mask.to(logp.dtype)
    adv = token_advantages(advantages, mask).to(logp.dtype)
    ratio = torch.exp(logp - proximal_logp)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    # Dual clip: for A < 0 the surrogate falls without bound as the ratio grows; c * A (c > 1) bounds it.
    dual_clipped = (adv < 0) & (surrogate < cfg.dual_clip * adv) if cfg.dual_clip > 0 else torch.zeros_like(mask) > 0
    surrogate = torch.where(dual_clipped, cfg.dual_clip * adv, surrogate)
    # The importance weight is a constant of the update: gradients flow only through `ratio`.
    log_iw = (proximal_logp - behaviour_logp).detach()
    iw = torch.exp(log_iw)
    iw_truncated = iw.clamp(max=cfg.tis_cap)
    token_kept, seq_kept = correction_masks(log_iw, mask, cfg, documents)
    pg_per_token = -iw_truncated * surrogate * token_kept * seq_kept
    pg_loss = aggregate(pg_per_token, mask, cfg.aggregation, total, documents)
    loss = pg_loss
    kl_stats: dict[str, float] = {}
    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError("trainer.rl.kl_coef > 0 needs the reference policy's log-probs (ref_logp)")
    if ref_logp is not None:
        ref_logp = ref_logp.to(logp.dtype)
        kl_value = aggregate(kl_estimate(cfg.kl_estimator, logp, ref_logp), mask, cfg.aggregation, total, documents)
        if cfg.kl_coef > 0 and cfg.kl_mode == "loss":  # "reward": the penalty is in the advantages already
            loss = loss + cfg.kl_coef * kl_value
        with torch.no_grad():
            kl_stats = {
                "kl": float(kl_value),
                "kl_k1": float(aggregate(kl_k1(logp, ref_logp), mask, cfg.aggregation, total, documents)),
                "kl_k3": float(aggregate(kl_k3(logp, ref_logp), mask, cfg.aggregation, total, documents)),
            }
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        clip_active = ((ratio * adv) > (clipped * adv)).to(mask.dtype) * mask

        def masked_max(x: torch.Tensor) -> float:
            return float(torch.where(mask > 0, x, torch.full_like(x, -torch.inf)).max()) if mask.any() else 0.0

        def masked_min(x: torch.Tensor) -> float:
            return float(torch.where(mask > 0, x, torch.full_like(x, torch.inf)).min()) if mask.any() else 0.0

        stats = {
            "loss": float(loss),
            "pg_loss": float(pg_loss),
            **kl_stats,
            "clip_fraction": float(clip_active.sum() / n),
            "dual_clip_fraction": float((dual_clipped.to(mask.dtype) * mask).sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "ratio_max": masked_max(ratio),
            "ratio_min": masked_min(ratio),
            "iw_mean": float((iw * mask).sum() / n),
            "iw_max": masked_max(iw),
            "iw_min": masked_min(iw),
            "iw_truncated_fraction": float(((iw > cfg.tis_cap).to(mask.dtype) * mask).sum() / n),
            "behaviour_proximal_abs_logp_diff": float((log_iw.abs() * mask).sum() / n),
            "behaviour_proximal_abs_logp_diff_max": masked_max(log_iw.abs()),
            # k3 = r - 1 - log r with r = iw; expm1 keeps it accurate (and >= 0) for tiny log ratios.
            "behaviour_proximal_k3": float(((torch.expm1(log_iw) - log_iw).clamp(min=0) * mask).sum() / n),
            "token_masked_fraction": float(((1 - token_kept) * mask).sum() / n),
            "seq_masked_fraction": float(((1 - seq_kept) * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
    return LossOutput(loss, stats)


def token_advantages(advantages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B] (a sample's advantage on each of its tokens) or [B, T] (per token) -> [B, T] broadcastable to mask."""
    if advantages.dim() == 1 and advantages.shape[0] == mask.shape[0]:
        return advantages.unsqueeze(1)
    if advantages.shape == mask.shape:
        return advantages
    raise ValueError(
        f"advantages must be [B] or [B, T] like the mask {tuple(mask.shape)}; got {tuple(advantages.shape)}"
    )


def correction_masks(
    log_iw: torch.Tensor, mask: torch.Tensor, cfg: RLConfig, documents: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(token keep [B, T], sequence keep [B, 1], or [B, T] for packed rows) in the mask's dtype: 0 for tokens
    whose importance weight is outside `cfg.token_mask_band` and for samples whose geometric-mean weight is
    outside `cfg.seq_mask_band`, 1 for the rest (an empty band keeps everything). `documents`: packed rows."""
    token_kept = torch.ones_like(mask)
    seq_kept = torch.ones_like(mask[:, :1])
    if cfg.token_mask_band:
        lo, hi = (math.log(b) if b > 0 else -math.inf for b in cfg.token_mask_band)
        token_kept = ((log_iw >= lo) & (log_iw <= hi)).to(mask.dtype)
    if cfg.seq_mask_band:
        lo, hi = (math.log(b) if b > 0 else -math.inf for b in cfg.seq_mask_band)
        if documents is None:
            mean_log = (log_iw * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)
        else:  # each token gets its own sample's mean
            per_seq = per_sample(log_iw * mask, documents) / per_sample(mask, documents).clamp(min=1)
            mean_log = per_seq[_slots(documents)].view_as(mask)
        seq_kept = ((mean_log >= lo) & (mean_log <= hi)).to(mask.dtype)
    return token_kept, seq_kept
