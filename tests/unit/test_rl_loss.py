"""GRPO advantages and the decoupled PPO loss against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import RLConfig
from trainer.rl.advantages import group_advantages, zero_variance_groups
from trainer.rl.loss import ppo_loss


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 3.0]])
    centred = group_advantages(rewards, normalize_std=False)
    assert torch.allclose(centred, torch.tensor([[0.5, -0.5, -0.5, 0.5], [0, 0, 0, 0], [-0.75, -0.75, -0.75, 2.25]]))
    normed = group_advantages(rewards, normalize_std=True, eps=0.0 + 1e-12)
    std0 = math.sqrt((4 * 0.25) / 3)  # unbiased std of [1, 0, 0, 1]
    assert normed[0, 0].item() == pytest.approx(0.5 / std0)
    assert torch.equal(normed[1], torch.zeros(4))
    std2 = math.sqrt((3 * 0.75**2 + 2.25**2) / 3)
    assert normed[2, 3].item() == pytest.approx(2.25 / std2)
    assert zero_variance_groups(rewards).tolist() == [False, True, False]
    with pytest.raises(ValueError, match="at least 2 samples"):
        group_advantages(torch.ones(3, 1))


def cfg(**kw) -> RLConfig:
    return RLConfig(**({"clip_low": 0.2, "clip_high": 0.2, "tis_cap": 2.0} | kw))


def test_on_policy_loss_is_minus_mean_advantage_and_gradient_is_the_policy_gradient():
    logp = torch.log(torch.tensor([[0.5, 0.25], [0.5, 0.5]])).requires_grad_()
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    out = ppo_loss(logp, logp.detach(), logp.detach(), adv, mask, cfg())
    # ratio = 1 and iw = 1 everywhere: loss = -(1 + 1 - 2) / 3 tokens
    assert out.loss.item() == pytest.approx(0.0)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-1 / 3, -1 / 3], [2 / 3, 0.0]]))
    assert out.stats["clip_fraction"] == 0.0 and out.stats["iw_mean"] == pytest.approx(1.0)
    assert out.stats["tokens"] == 3.0


def test_clip_stops_the_gradient_beyond_the_trust_region():
    prox = torch.zeros(1, 3)
    # ratios 1.5 (above 1+0.2), 1.1 (inside), 0.5 (below 1-0.2)
    logp = torch.log(torch.tensor([[1.5, 1.1, 0.5]])).requires_grad_()
    mask = torch.ones(1, 3)
    out = ppo_loss(logp, prox, prox, torch.tensor([1.0]), mask, cfg())
    # A > 0: min(r*A, clip(r)*A) = [1.2, 1.1, 0.5]; loss = -(1.2 + 1.1 + 0.5) / 3
    assert out.loss.item() == pytest.approx(-(1.2 + 1.1 + 0.5) / 3)
    out.loss.backward()
    # d/dlogp of -r/3 is -r/3 where unclipped; zero where the clipped branch is the minimum.
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -1.1 / 3, -0.5 / 3]]))
    assert out.stats["clip_fraction"] == pytest.approx(1 / 3)
    assert out.stats["ratio_max"] == pytest.approx(1.5) and out.stats["ratio_min"] == pytest.approx(0.5)
    # A < 0: the low side clips instead.
    logp2 = logp.detach().clone().requires_grad_()
    out = ppo_loss(logp2, prox, prox, torch.tensor([-1.0]), mask, cfg())
    assert out.loss.item() == pytest.approx((1.5 + 1.1 + 0.8) / 3)
    out.loss.backward()
    assert torch.allclose(logp2.grad, torch.tensor([[1.5 / 3, 1.1 / 3, 0.0]]))


def test_truncated_importance_weight_scales_the_loss_and_is_capped():
    logp = torch.zeros(1, 3, requires_grad=True)
    prox = torch.zeros(1, 3)
    behaviour = torch.log(torch.tensor([[2.0, 0.25, 1.0]]))  # iw = prox/behaviour = 0.5, 4 (capped to 2), 1
    out = ppo_loss(logp, prox, behaviour, torch.tensor([1.0]), torch.ones(1, 3), cfg(tis_cap=2.0))
    assert out.loss.item() == pytest.approx(-(0.5 + 2.0 + 1.0) / 3)
    assert out.stats["iw_max"] == pytest.approx(4.0) and out.stats["iw_min"] == pytest.approx(0.5)
    assert out.stats["iw_truncated_fraction"] == pytest.approx(1 / 3)
    out.loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[-0.5 / 3, -2.0 / 3, -1.0 / 3]]))


def test_k3_kl_to_the_reference_by_hand():
    logp = torch.log(torch.tensor([[0.5, 0.5]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    out = ppo_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), cfg(kl_coef=0.1), ref_logp=ref)
    k3 = (0.5 - math.log(0.5) - 1.0 + 0.0) / 2  # exp(d) - d - 1 with d = log(1/2), then 0
    assert out.stats["kl"] == pytest.approx(k3)
    assert out.loss.item() == pytest.approx(0.1 * k3)
    with pytest.raises(ValueError, match="reference log-probs"):
        ppo_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), cfg(kl_coef=0.1))


def test_sequence_mean_weighs_sequences_equally_and_micro_batches_sum_to_the_batch():
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 3.0])
    token = ppo_loss(logp, logp, logp, adv, mask, cfg(aggregation="token_mean")).loss.item()
    seq = ppo_loss(logp, logp, logp, adv, mask, cfg(aggregation="seq_mean")).loss.item()
    assert token == pytest.approx(-(4 * 1.0 + 3.0) / 5)
    assert seq == pytest.approx(-(1.0 + 3.0) / 2)
    for how, total in (("token_mean", 5.0), ("seq_mean", 2.0)):
        parts = sum(
            ppo_loss(
                logp[i : i + 1],
                logp[i : i + 1],
                logp[i : i + 1],
                adv[i : i + 1],
                mask[i : i + 1],
                cfg(aggregation=how),
                total=total,
            ).loss.item()
            for i in range(2)
        )
        assert parts == pytest.approx(token if how == "token_mean" else seq)
