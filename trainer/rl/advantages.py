"""GRPO group advantages: each sample's reward minus its group's mean, optionally divided by the
group's standard deviation; groups whose rewards are all equal carry no signal and can be dropped."""

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
