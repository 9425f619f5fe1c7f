"""GRPO advantages and the decoupled PPO loss against values computed by hand."""

from __future__ import annotations

import math

import pytest
import torch

from common.config import RLConfig
from trainer.rl.advantages import clip_advantages, clip_rewards, group_advantages, zero_variance_groups
from trainer.rl.kl import kl_estimate, kl_k3
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


def one_row_micro_batches(
    logp: torch.Tensor,
    adv: torch.Tensor,
    mask: torch.Tensor,
    rl: RLConfig,
    total: float,
    ref_logp: torch.Tensor | None = None,
) -> float:
    """The on-policy loss of each row alone as a micro-batch (normalised by the whole batch's `total`), summed."""
    return sum(
        ppo_loss(
            logp[i : i + 1],
            logp[i : i + 1],
            logp[i : i + 1],
            adv[i : i + 1],
            mask[i : i + 1],
            rl,
            ref_logp=None if ref_logp is None else ref_logp[i : i + 1],
            total=total,
        ).loss.item()
        for i in range(len(logp))
    )


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


def test_kl_estimators_against_a_float64_hand_computation():
    """k1 = log(pi/ref), k2 = 0.5 log(pi/ref)^2, k3 = ref/pi - 1 - log(ref/pi), per token, in float32 against
    float64 math (k3 also where pi and ref nearly agree, where r - 1 and log r cancel)."""
    pi = [0.5, 0.25, 0.9, 0.3, 0.123456]
    ref = [0.25, 0.5, 0.9 * (1 + 1e-6), 0.6, 0.02]
    logp = torch.log(torch.tensor([pi], dtype=torch.float64)).float()
    ref_logp = torch.log(torch.tensor([ref], dtype=torch.float64)).float()
    for name in ("k1", "k2", "k3"):
        got = kl_estimate(name, logp, ref_logp)
        for i in range(len(pi)):
            log_ratio = float(logp[0, i].double()) - float(ref_logp[0, i].double())  # log(pi / ref) as stored
            want = {
                "k1": log_ratio,
                "k2": 0.5 * log_ratio**2,
                "k3": math.expm1(-log_ratio) + log_ratio,
            }[name]
            assert float(got[0, i]) == pytest.approx(want, rel=1e-5, abs=1e-12), (name, i)
    # At the near-tie (log ratio ~ -1e-6) k3 is ~ 0.5e-12: positive and right, not rounding noise.
    assert 0 < float(kl_k3(logp, ref_logp)[0, 2]) < 1e-11
    with pytest.raises(ValueError, match="k1, k2, k3"):
        kl_estimate("k4", logp, ref_logp)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_the_loss_with_a_kl_term_by_hand_value_and_gradient(estimator, aggregation):
    """On a fixed batch of two samples (the second one token shorter): loss = pg + kl_coef * aggregate(k),
    with the gradient of each estimator's own formula; kl_k1 / kl_k3 logged beside; micro-batches of one
    sample with the update's `total` sum to the batch's loss."""
    pi = torch.tensor([[0.5, 0.25, 0.8], [0.4, 0.6, 0.7]])
    ref = torch.tensor([[0.25, 0.5, 0.8], [0.5, 0.3, 0.1]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    adv = torch.tensor([1.0, -0.5])
    logp = torch.log(pi).requires_grad_()
    c = 0.3
    out = ppo_loss(
        logp,
        logp.detach(),
        logp.detach(),
        adv,
        mask,
        cfg(kl_coef=c, kl_estimator=estimator, aggregation=aggregation),
        ref_logp=torch.log(ref),
    )
    # By hand: on-policy, so the pg term per token is -A (gradient -A per token); d = log(pi / ref).
    d = [
        [math.log(p / q) for p, q in zip(row_p, row_q, strict=True)]
        for row_p, row_q in zip(pi.tolist(), ref.tolist(), strict=True)
    ]
    value = {"k1": lambda x: x, "k2": lambda x: 0.5 * x * x, "k3": lambda x: math.exp(-x) - 1 + x}[estimator]
    slope = {"k1": lambda x: 1.0, "k2": lambda x: x, "k3": lambda x: 1 - math.exp(-x)}[estimator]  # d/dlogp
    lengths = [3, 2]
    A = adv.tolist()

    def weight(b: int) -> float:  # each token's weight in the aggregate
        return {"token-mean": 1 / 5, "seq-mean-token-sum": 1 / 2, "seq-mean-token-mean": 1 / (2 * lengths[b])}[
            aggregation
        ]

    tokens = [(b, t) for b in range(2) for t in range(lengths[b])]
    pg = sum(-A[b] * weight(b) for b, t in tokens)
    kl = sum(value(d[b][t]) * weight(b) for b, t in tokens)
    assert out.stats["pg_loss"] == pytest.approx(pg, rel=1e-5)
    assert out.stats["kl"] == pytest.approx(kl, rel=1e-5)
    assert out.loss.item() == pytest.approx(pg + c * kl, rel=1e-5)
    assert out.stats["kl_k1"] == pytest.approx(sum(d[b][t] * weight(b) for b, t in tokens), rel=1e-5, abs=1e-7)
    k3 = sum((math.exp(-d[b][t]) - 1 + d[b][t]) * weight(b) for b, t in tokens)
    assert out.stats["kl_k3"] == pytest.approx(k3, rel=1e-5)
    out.loss.backward()
    want = torch.zeros(2, 3)
    for b, t in tokens:
        want[b, t] = weight(b) * (-A[b] + c * slope(d[b][t]))
    assert torch.allclose(logp.grad, want, atol=1e-6)
    total = 5.0 if aggregation == "token-mean" else 2.0
    rl = cfg(kl_coef=c, kl_estimator=estimator, aggregation=aggregation)
    parts = one_row_micro_batches(logp, adv, mask, rl, total, ref_logp=torch.log(ref))
    assert parts == pytest.approx(out.loss.item(), rel=1e-5)


def test_the_kl_is_logged_without_entering_the_loss_when_kl_coef_is_zero():
    logp = torch.log(torch.tensor([[0.5, 0.5]])).requires_grad_()
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    out = ppo_loss(
        logp, logp.detach(), logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), cfg(log_kl=True), ref_logp=ref
    )
    assert out.stats["kl_k3"] == pytest.approx((0.5 - 1 + math.log(2)) / 2)
    assert out.stats["kl"] == out.stats["kl_k3"]  # k3 is the default estimator
    assert out.loss.item() == pytest.approx(-1.0)  # the policy-gradient term alone
    with pytest.raises(ValueError, match="reference policy's log-probs"):
        ppo_loss(logp, logp, logp, torch.tensor([0.0]), torch.ones(1, 2), cfg(kl_coef=0.1))


def test_the_three_aggregations_and_micro_batches_summing_to_the_batch():
    logp = torch.zeros(2, 4)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, 3.0])
    want = {
        "token-mean": -(4 * 1.0 + 3.0) / 5,  # every token alike
        "seq-mean-token-sum": -(4 * 1.0 + 1 * 3.0) / 2,  # per sample the sum of its tokens, mean over samples
        "seq-mean-token-mean": -(1.0 + 3.0) / 2,  # per sample the mean of its tokens, mean over samples
    }
    for how, total in (("token-mean", 5.0), ("seq-mean-token-sum", 2.0), ("seq-mean-token-mean", 2.0)):
        whole = ppo_loss(logp, logp, logp, adv, mask, cfg(aggregation=how)).loss.item()
        assert whole == pytest.approx(want[how]), how
        parts = one_row_micro_batches(logp, adv, mask, cfg(aggregation=how), total)
        assert parts == pytest.approx(whole), how


def test_old_aggregation_names_and_bad_kl_reward_or_advantage_settings_are_refused_naming_the_fix():
    from common.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="'token-mean'"):
        load_config(None, ["trainer.rl.aggregation=token_mean"])
    with pytest.raises(ConfigError, match="'seq-mean-token-mean'"):
        load_config(None, ["trainer.rl.aggregation=seq_mean"])
    with pytest.raises(ConfigError, match='kl_mode = "loss"'):
        load_config(None, ["trainer.rl.kl_coef=0.1", "trainer.rl.kl_mode=reward"])
    with pytest.raises(ConfigError, match="kl_coef > 0 or trainer.rl.log_kl"):
        load_config(None, ["trainer.rl.reference_refresh_steps=5"])
    with pytest.raises(ConfigError, match="reward_clip"):
        load_config(None, ["trainer.rl.reward_clip=[1.0, 0.0]"])
    with pytest.raises(ConfigError, match="advantage_clip"):
        load_config(None, ["trainer.rl.advantage_clip=-1"])
    cfg_ok = load_config(
        None, ["trainer.rl.kl_coef=0.1", "trainer.rl.kl_estimator=k2", "trainer.rl.aggregation=seq-mean-token-sum"]
    )
    assert cfg_ok.trainer.rl.keeps_reference


def test_rewards_are_clipped_before_and_advantages_after_the_group_advantages():
    rewards = torch.tensor([[5.0, 0.0, -3.0, 1.0]])
    clipped = clip_rewards(rewards, [-1.0, 1.0])
    assert clipped.tolist() == [[1.0, 0.0, -1.0, 1.0]]
    assert clip_rewards(rewards, []) is rewards
    adv = group_advantages(clipped, normalize_std=False)  # mean 0.25
    assert adv.tolist() == [[0.75, -0.25, -1.25, 0.75]]
    assert clip_advantages(adv, 1.0).tolist() == [[0.75, -0.25, -1.0, 0.75]]
    assert clip_advantages(adv, 0.0) is adv
    with pytest.raises(ValueError, match="low < high"):
        clip_rewards(rewards, [1.0, -1.0])
