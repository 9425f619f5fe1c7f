"""Per-token estimators of KL(policy || reference) from the log-probs of sampled tokens (Schulman's k1, k2,
k3). With log r = ref_logp - logp per token: k1 = -log r, k2 = 0.5 * (log r)^2, k3 = r - 1 - log r.

Used as a loss term, each estimator's gradient is its own: for tokens sampled from the policy, k1's is zero
in expectation, k2's is the gradient of KL(policy || reference), k3's that of KL(reference || policy).
As values (monitoring), k1 and k3 are unbiased for KL(policy || reference) and k3 is never negative."""

from __future__ import annotations

import torch


def kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """log(policy / reference) per token: [B, T] -> [B, T]."""
    return logp - ref_logp


def kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """0.5 * log(policy / reference)^2 per token."""
    return 0.5 * (logp - ref_logp) ** 2


def kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """reference / policy - 1 - log(reference / policy) per token; expm1 keeps it accurate (and >= 0) when
    the two are close, where r - 1 and log r nearly cancel."""
    log_r = ref_logp - logp
    return torch.expm1(log_r) - log_r


ESTIMATORS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}


def kl_estimate(name: str, logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    """The per-token values of estimator `name` (trainer.rl.kl_estimator)."""
    if name not in ESTIMATORS:
        raise ValueError(f"unknown KL estimator {name!r}; use one of {', '.join(ESTIMATORS)}")
    return ESTIMATORS[name](logp, ref_logp)
