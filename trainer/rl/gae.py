"""The critic-based PPO advantages (trainer.rl.algorithm = "ppo"): per-token rewards, generalised advantage
estimation over each row's completion tokens, token-level whitening over the step, and the clipped value
loss. Pure functions of [B, T] tensors aligned with `targets` / `mask` (position t holds what concerns the
target token t: its reward, the value of the state before it, its advantage).

Every rank holds the step's global tensors (the old values are gathered over the ranks first), so whitening
over all of a step's tokens here is the global, cross-rank whitening: every rank computes the same numbers.
"""

from __future__ import annotations

import torch

WHITEN_EPS = 1e-8


def token_rewards(rewards: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """rewards [B] (one per sample), mask [B, T] -> [B, T]: the sample's reward on its last completion token,
    0 elsewhere. A tensor per token so that a per-token penalty (a KL to a reference) is one subtraction."""
    if rewards.dim() != 1 or mask.dim() != 2 or rewards.shape[0] != mask.shape[0]:
        raise ValueError(f"rewards must be [B] and mask [B, T]; got {tuple(rewards.shape)} and {tuple(mask.shape)}")
    present = mask > 0
    empty = (~present.any(dim=1)).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} have no completion token: a reward needs a token to sit on")
    T = mask.shape[1]
    positions = torch.arange(T, device=mask.device).expand_as(mask)
    last = torch.where(present, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=rewards.dtype, device=mask.device)
    out[torch.arange(mask.shape[0], device=mask.device), last] = rewards
    return out


def gae(
    rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation per row over its completion tokens.

    rewards, values, mask: [B, T]. Returns (advantages [B, T], returns [B, T] = advantages + values), 0 outside
    the mask. The recursion runs backwards over the masked tokens only (a token outside the mask is skipped,
    not a step of the episode); the value after a row's last token is 0 (the episode ends there):
        delta_t = r_t + gamma * V_next - V_t,   A_t = delta_t + gamma * lam * A_next."""
    if not (rewards.shape == values.shape == mask.shape) or mask.dim() != 2:
        raise ValueError(
            f"rewards, values and mask must all be [B, T]; got {tuple(rewards.shape)}, {tuple(values.shape)}, "
            f"{tuple(mask.shape)}"
        )
    rewards, values = rewards.to(values.dtype), values * mask.to(values.dtype)
    present = mask > 0
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    columns = present.any(dim=0).nonzero().flatten()  # only completion columns: the prompts are long
    for t in range(int(columns.max()), int(columns.min()) - 1, -1) if len(columns) else ():
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        a = delta + gamma * lam * next_advantage
        here = present[:, t]
        advantages[:, t] = torch.where(here, a, torch.zeros_like(a))
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, a, next_advantage)
    return advantages, advantages + values


def whiten(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, T] -> [B, T]: (x - mean) / sqrt(var + 1e-8) over the masked tokens (population variance), 0 outside
    the mask. Over a step's global tensors this is the token-level whitening across every rank."""
    m = mask.to(values.dtype)
    n = m.sum()
    if n == 0:
        raise ValueError("whitening needs at least one masked token")
    mean = (values * m).sum() / n
    var = (((values - mean) * m) ** 2).sum() / n
    return (values - mean) * torch.rsqrt(var + WHITEN_EPS) * m


def masked_mean_std(values: torch.Tensor, mask: torch.Tensor) -> tuple[float, float]:
    """(mean, population std) of `values` over the masked tokens."""
    m = mask.to(torch.float64)
    x = values.to(torch.float64)
    n = m.sum().clamp(min=1)
    mean = (x * m).sum() / n
    return float(mean), float(((((x - mean) * m) ** 2).sum() / n).sqrt())


def explained_variance(values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor) -> float:
    """1 - Var(returns - values) / Var(returns) over the masked tokens: 1 for a perfect critic, 0 for one no
    better than the mean return, negative for a worse one (0 when the returns do not vary)."""
    _, residual = masked_mean_std(returns - values, mask)
    _, spread = masked_mean_std(returns, mask)
    return 1.0 - residual**2 / spread**2 if spread > 0 else 0.0


def value_loss(
    new_values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2), and
    where the clipped term was the larger (bool), all [B, T]. clip = 0: the plain 0.5 * (V - R)^2."""
    unclipped = (new_values - returns) ** 2
    if clip == 0:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    clipped_values = old_values + (new_values - old_values).clamp(-clip, clip)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
