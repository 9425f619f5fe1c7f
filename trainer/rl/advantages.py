"""GRPO group advantages: each sample's reward minus its group's mean, optionally divided by the
group's standard deviation; groups whose rewards are all equal carry no signal and can be dropped.
Rewards may be clipped before (trainer.rl.reward_clip) and advantages after (trainer.rl.advantage_clip)."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
    """rewards [groups, samples] -> advantages [groups, samples].

    The std is the unbiased sample std (as in GRPO's reference implementation); a zero-variance
    group gets zero advantages either way.
    """
    if rewards.dim() != 2 or rewards.shape[1] < 2:
        raise ValueError(
            f"rewards must be [groups, samples] with at least 2 samples per group, got {tuple(rewards.shape)}"
        )
    centred = rewards - rewards.mean(dim=1, keepdim=True)
    if not normalize_std:
        return centred
    return centred / (rewards.std(dim=1, keepdim=True) + eps)


def zero_variance_groups(rewards: torch.Tensor) -> torch.Tensor:
    """bool [groups]: True where every sample of the group got the same reward."""
    return (rewards == rewards[:, :1]).all(dim=1)


def clip_rewards(rewards: torch.Tensor, bounds: list[float]) -> torch.Tensor:
    """Rewards clamped to bounds = [low, high] (trainer.rl.reward_clip), before any advantage; [] = unchanged."""
    if not bounds:
        return rewards
    if len(bounds) != 2 or bounds[0] >= bounds[1]:
        raise ValueError(f"reward clip bounds must be [low, high] with low < high, got {bounds}")
    return rewards.clamp(bounds[0], bounds[1])


def clip_advantages(advantages: torch.Tensor, bound: float) -> torch.Tensor:
    """Advantages clamped to [-bound, bound] (trainer.rl.advantage_clip, after they are computed); 0 = unchanged."""
    if bound < 0:
        raise ValueError(f"the advantage clip must be >= 0 (0 = off), got {bound}")
    return advantages.clamp(-bound, bound) if bound > 0 else advantages
