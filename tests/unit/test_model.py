"""Model behaviour: routing rules, aux-loss-free balancing, the sequence balance loss, RoPE, log-probs."""

import torch

from common.config import ModelConfig
from trainer.model import build_model, count_params, logprobs_of
from trainer.model.moe import MoE, Router
from trainer.model.rope import apply_rope, rope_tables
from trainer.optim import router_stats


def _router(**kw) -> Router:
    r = Router(ModelConfig(hidden_size=16, **kw))
    torch.nn.init.normal_(r.weight, std=1.0)
    return r


def test_group_limited_routing_keeps_experts_inside_the_best_groups():
    r = _router(n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4)
    _, ids, _ = r(torch.randn(64, 16))
    groups = ids // 4
    assert all(len(set(row.tolist())) <= 2 for row in groups)
    # Without the limit, some token would use more than two groups.
    free = _router(n_routed_experts=16, num_experts_per_tok=4)
    free.weight.data.copy_(r.weight.data)
    _, ids_free, _ = free(torch.randn(64, 16, generator=torch.Generator().manual_seed(0)))
    assert any(len(set(row.tolist())) > 2 for row in ids_free // 4)


def test_sigmoid_routing_weights_are_normalised_then_scaled():
    r = _router(n_routed_experts=8, num_experts_per_tok=3, routed_scaling_factor=2.5)
    weights, _, _ = r(torch.randn(10, 16))
    torch.testing.assert_close(weights.sum(-1), torch.full((10,), 2.5))


def test_expert_bias_changes_choice_but_not_weights():
    r = _router(n_routed_experts=8, num_experts_per_tok=2)
    x = torch.randn(32, 16)
    r.e_score_correction_bias[5] = 10.0
    weights, ids, scores = r(x)
    assert (ids == 5).any(-1).all()  # the bias forces expert 5 into every token's top-k
    torch.testing.assert_close(weights, scores.gather(1, ids) / scores.gather(1, ids).sum(-1, keepdim=True))


def test_qwen_softmax_routing_without_bias():
    r = _router(arch="qwen3_moe", n_routed_experts=8, num_experts_per_tok=2, norm_topk_prob=False)
    assert not hasattr(r, "e_score_correction_bias")
    weights, ids, scores = r(torch.randn(10, 16))
    torch.testing.assert_close(scores.sum(-1), torch.ones(10))
    torch.testing.assert_close(weights, scores.topk(2, dim=-1).values)


def _load_cv(layer: MoE, x: torch.Tensor) -> float:
    layer.tokens_per_expert.zero_()
    with torch.no_grad():
        layer(x)
    return router_stats(torch.nn.ModuleDict({"m": layer}))[0].load_cv


def test_aux_free_bias_lowers_load_imbalance_of_a_skewed_router():
    cfg = ModelConfig(hidden_size=32, moe_intermediate_size=16, n_routed_experts=8, num_experts_per_tok=2)
    torch.manual_seed(0)
    layer = MoE(cfg, "reference").train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    layer.gate.weight.data[:2, 0] = 3.0  # inputs carry +1 on feature 0, so experts 0 and 1 win everything

    def batch():
        x = torch.randn(4, 64, 32)
        x[..., 0] += 1.0
        return x

    before = _load_cv(layer, batch())
    assert before > 1.0
    for _ in range(200):
        with torch.no_grad():
            layer(batch())
        layer.update_bias(rate=0.01)
    after = _load_cv(layer, batch())
    assert after < 0.3 * before
    bias = layer.gate.e_score_correction_bias
    assert bias[:2].max() < bias[2:].min()  # the favoured experts were pushed down


def test_bias_update_rate_zero_leaves_bias_and_resets_counts():
    cfg = ModelConfig(hidden_size=16, moe_intermediate_size=8)
    layer = MoE(cfg, "reference").train()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    with torch.no_grad():
        layer(torch.randn(1, 8, 16))
    assert layer.tokens_per_expert.sum() == 8 * cfg.num_experts_per_tok
    layer.update_bias(0.0)
    assert layer.gate.e_score_correction_bias.abs().sum() == 0 and layer.tokens_per_expert.sum() == 0


def test_sequence_aux_loss_is_one_when_balanced_and_larger_when_skewed():
    cfg = ModelConfig(hidden_size=16, moe_intermediate_size=8, n_routed_experts=4, num_experts_per_tok=1)
    layer = MoE(cfg, "reference")
    E, S = 4, 8
    scores = torch.full((S, E), 0.5)
    balanced = torch.arange(S).remainder(E).view(S, 1)
    skewed = torch.zeros(S, 1, dtype=torch.long)
    torch.testing.assert_close(layer._sequence_aux_loss(scores, balanced, 1, S), torch.tensor(1.0))
    skewed_scores = torch.tensor([[0.9, 0.1, 0.1, 0.1]]).expand(S, E)
    torch.testing.assert_close(layer._sequence_aux_loss(skewed_scores, skewed, 1, S), torch.tensor(3.0))


def test_sequence_aux_loss_reaches_the_router_gradient():
    model = build_model(ModelConfig(), seed=0)
    model.set_aux_loss(True)
    model(torch.randint(0, 128, (2, 8)))
    model.aux_loss().backward()
    assert model.model.layers[1].mlp.gate.weight.grad.abs().sum() > 0


def test_rope_scores_depend_only_on_relative_position():
    angles = rope_tables(8, 32, 10000.0)
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)
    for interleaved in (True, False):

        def score(i, j, interleaved=interleaved):
            qi = apply_rope(q, angles.cos()[i : i + 1][None], angles.sin()[i : i + 1][None], interleaved)
            kj = apply_rope(k, angles.cos()[j : j + 1][None], angles.sin()[j : j + 1][None], interleaved)
            return (qi * kj).sum()

        torch.testing.assert_close(score(5, 2), score(13, 10))
        assert not torch.allclose(score(5, 2), score(5, 4))


def test_token_logprobs_match_log_softmax_and_zero_padding():
    logits = torch.randn(2, 3, 11)
    targets = torch.tensor([[1, 2, -1], [4, -1, 0]])
    lp = logprobs_of(logits, targets)
    ref = logits.log_softmax(-1)
    assert lp[0, 0] == ref[0, 0, 1] and lp[1, 2] == ref[1, 2, 0]
    assert lp[0, 2] == 0 and lp[1, 1] == 0


def test_param_counts_of_the_tiny_default():
    total, active = count_params(ModelConfig())
    model = build_model(ModelConfig(), seed=None)
    assert total == sum(p.numel() for p in model.parameters())
    assert active < total
