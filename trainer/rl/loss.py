"""The decoupled PPO objective (as in AReaL) with truncated importance sampling.

Three policies meet here: the behaviour policy that sampled the tokens (vLLM, possibly several
weight versions old), the proximal policy (the trainer's weights before this update; its log-probs
are recomputed by the trainer), and the policy being optimised. The PPO ratio and its clip are taken
against the proximal policy, so staleness does not widen the trust region; the behaviour-to-proximal
importance weight corrects the off-policy sampling and is truncated at `tis_cap` to bound variance.
Optionally a k3 estimate of KL to a frozen reference is added.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.config import RLConfig


@dataclass
class LossOutput:
    loss: torch.Tensor
    stats: dict[str, float]


def _aggregate(values: torch.Tensor, mask: torch.Tensor, how: str, total: float | None) -> torch.Tensor:
    # `total` is the token (token_mean) or sequence (seq_mean) count of the whole batch, so that
    # micro-batches summed together give exactly the full batch's mean.
    if how == "token_mean":
        return (values * mask).sum() / (mask.sum().clamp(min=1) if total is None else total)
    if how == "seq_mean":
        per_seq = (values * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
        return per_seq.sum() / (per_seq.numel() if total is None else total)
    raise ValueError(f"unknown aggregation {how!r}; use token_mean or seq_mean")


def ppo_loss(
    logp: torch.Tensor,
    proximal_logp: torch.Tensor,
    behaviour_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    cfg: RLConfig,
    ref_logp: torch.Tensor | None = None,
    total: float | None = None,
) -> LossOutput:
    """All log-prob tensors are [batch, tokens] of the sampled tokens; advantages [batch]; mask [batch, tokens].

    `total`: for a micro-batch, the token count (token_mean) or sequence count (seq_mean) of the whole
    batch. Returns the scalar loss (to minimise) and float statistics of every term.
    """
    mask = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype).unsqueeze(1)
    ratio = torch.exp(logp - proximal_logp)
    clipped = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = torch.minimum(ratio * adv, clipped * adv)
    # The importance weight is a constant of the update: gradients flow only through `ratio`.
    iw = torch.exp(proximal_logp - behaviour_logp).detach()
    iw_truncated = iw.clamp(max=cfg.tis_cap)
    pg_per_token = -iw_truncated * surrogate
    pg_loss = _aggregate(pg_per_token, mask, cfg.aggregation, total)
    loss = pg_loss
    kl_value = torch.zeros((), dtype=logp.dtype, device=logp.device)
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("trainer.rl.kl_coef > 0 needs reference log-probs (ref_logp)")
        delta = ref_logp - logp
        kl_value = _aggregate(torch.exp(delta) - delta - 1.0, mask, cfg.aggregation, total)
        loss = loss + cfg.kl_coef * kl_value
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
            "kl": float(kl_value),
            "clip_fraction": float(clip_active.sum() / n),
            "ratio_mean": float((ratio * mask).sum() / n),
            "ratio_max": masked_max(ratio),
            "ratio_min": masked_min(ratio),
            "iw_mean": float((iw * mask).sum() / n),
            "iw_max": masked_max(iw),
            "iw_min": masked_min(iw),
            "iw_truncated_fraction": float(((iw > cfg.tis_cap).to(mask.dtype) * mask).sum() / n),
            "behaviour_proximal_abs_logp_diff": float(((proximal_logp - behaviour_logp).abs() * mask).sum() / n),
            "tokens": float(mask.sum()),
        }
    return LossOutput(loss, stats)
