"""The trainer's log-probs under a sample's sampling distribution (trainer.model.sampling) against vLLM's own
sampler functions, imported as the ground truth: temperature in float32, then top-k and top-p, then
log-softmax (the worker's `--logprobs-mode processed_logprobs`)."""

from __future__ import annotations

import pytest
import torch

from trainer.model.sampling import RowSampling, logprobs_of, sampled_logprobs

V = 50


def vllm_processed_logprobs(logits: torch.Tensor, targets: torch.Tensor, sampling: RowSampling) -> torch.Tensor:
    """vLLM's numbers, position by position: each position of a row is a request of its own to the sampler."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    B, S, _ = logits.shape
    out = torch.zeros(B, S)
    for b in range(B):
        scaled = logits[b].float().div(sampling.temperature[b].float())  # [S, V], vLLM's apply_temperature
        k = int(sampling.top_k[b])
        k_rows = None if k <= 0 or k >= V else torch.full((S,), k)
        p = float(sampling.top_p[b])
        p_rows = None if p >= 1 else torch.full((S,), p, dtype=torch.float32)
        lp = apply_top_k_top_p_pytorch(scaled.clone(), k_rows, p_rows).log_softmax(-1, dtype=torch.float32)
        for s in range(S):
            if targets[b, s] >= 0:
                out[b, s] = lp[s, targets[b, s]]
    return out


def random_case(seed: int, B: int = 6, S: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, S, V, generator=g) * 3
    # Ties: a run of equal logits at the top and around the middle (the k-th and the nucleus edge).
    logits[0, :, :6] = logits[0].max() + 1
    logits[1, :, 10:30] = 0.25
    targets = torch.randint(0, V, (B, S), generator=g)
    targets[:, -1] = -1  # padding
    return logits, targets


def sampled_from(logits: torch.Tensor, sampling: RowSampling, seed: int) -> torch.Tensor:
    """Targets drawn from vLLM's processed distribution (so every target is inside its kept set)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    g = torch.Generator().manual_seed(seed)
    B, S, _ = logits.shape
    rows = []
    for b in range(B):
        scaled = logits[b].float().div(sampling.temperature[b].float())
        k = int(sampling.top_k[b])
        k_rows = None if k <= 0 or k >= V else torch.full((S,), k)
        p_rows = None if float(sampling.top_p[b]) >= 1 else torch.full((S,), float(sampling.top_p[b]))
        probs = apply_top_k_top_p_pytorch(scaled.clone(), k_rows, p_rows).softmax(-1)
        rows.append(torch.multinomial(probs, 1, generator=g).squeeze(1))
    return torch.stack(rows)


MIXED = RowSampling(
    temperature=torch.tensor([1.0, 0.7, 0.7, 1.0, 1.3, 0.5]),
    top_k=torch.tensor([0, 0, 5, -1, 12, 1]),
    top_p=torch.tensor([1.0, 1.0, 1.0, 0.6, 0.95, 1.0]),
)  # rows: plain, tempered only, top-k, top-p, all three, top-k 1


@pytest.mark.parametrize(
    "sampling",
    [
        MIXED,
        RowSampling(torch.full((6,), 0.7), torch.zeros(6, dtype=torch.long), torch.full((6,), 0.9)),
        RowSampling(torch.ones(6), torch.full((6,), 3), torch.ones(6)),
        RowSampling(torch.full((6,), 0.6), torch.full((6,), 8), torch.full((6,), 0.5)),
    ],
    ids=["mixed rows", "T=0.7 top_p=0.9", "top_k=3", "T=0.6 top_k=8 top_p=0.5"],
)
def test_sampled_logprobs_equal_vllms_processed_logprobs_of_sampled_tokens(sampling):
    for seed in range(3):
        logits, _ = random_case(seed)
        targets = sampled_from(logits, sampling, seed)
        targets[:, -1] = -1
        ours, outside = sampled_logprobs(logits, targets, sampling)
        theirs = vllm_processed_logprobs(logits, targets, sampling)
        assert not outside.any()
        assert ours.dtype == torch.float32
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        assert (ours[:, -1] == 0).all()


def test_rows_sampled_at_temperature_one_over_the_whole_vocabulary_give_todays_logprobs_bitwise():
    logits, targets = random_case(4)
    plain = RowSampling(torch.ones(6), torch.tensor([0, -1, 0, V, 0, 0]), torch.ones(6))
    ours, _ = sampled_logprobs(logits, targets, plain)
    assert torch.equal(ours, logprobs_of(logits, targets))
    # In a batch mixed with truncated rows, the plain rows keep their numbers too.
    mixed, _ = sampled_logprobs(logits, targets, MIXED)
    today = logprobs_of(logits, targets)
    assert torch.equal(mixed[0], today[0])
    assert not torch.allclose(mixed[1], today[1])  # tempered rows differ from T = 1


def test_the_old_temperature_one_logprobs_differ_from_vllms_at_a_tempered_truncated_setting():
    """So that a trainer ignoring the sampling parameters is caught: its numbers are far from vLLM's."""
    logits, _ = random_case(5)
    sampling = RowSampling(torch.full((6,), 0.7), torch.zeros(6, dtype=torch.long), torch.full((6,), 0.9))
    targets = sampled_from(logits, sampling, 5)
    theirs = vllm_processed_logprobs(logits, targets, sampling)
    assert float((logprobs_of(logits, targets) - theirs).abs().mean()) > 0.1


def test_gradient_is_finite_and_flows_only_through_kept_logits():
    logits, _ = random_case(6)
    logits.requires_grad_(True)
    targets = sampled_from(logits.detach(), MIXED, 6)
    ours, _ = sampled_logprobs(logits, targets, MIXED)
    ours.sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    # Row 5 keeps only its top token (top_k = 1): its log-prob is 0 whatever the logits, so no gradient.
    assert ours[5].abs().max() == 0 and logits.grad[5].abs().max() == 0
    assert logits.grad[1].abs().sum() > 0


def test_a_target_outside_the_trainers_kept_set_stays_finite_and_is_counted():
    logits = torch.zeros(2, 2, V)
    logits[:, :, 0] = 5.0  # token 0 holds almost all the mass: top_p 0.5 keeps it alone
    targets = torch.tensor([[7, 0], [3, -1]])
    sampling = RowSampling(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.full((2,), 0.5))
    logp, outside = sampled_logprobs(logits, targets, sampling)
    assert torch.isfinite(logp).all()
    assert outside.tolist() == [[True, False], [True, False]]  # the padding position is never counted
    # Kept beside token 0 in its own set: log(e^0 / (e^5 + e^0)).
    expected = -torch.log1p(torch.exp(torch.tensor(5.0)))
    torch.testing.assert_close(logp[0, 0], expected)
    assert logp[0, 1] == 0 and logp[1, 1] == 0  # token 0 alone: probability 1; padding: 0


def test_the_model_counts_outside_targets_of_its_last_sampled_logprobs():
    from common.config import Config
    from trainer.model import build_model

    cfg = Config()
    model = build_model(cfg.trainer.model, seed=0)
    tokens = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(0))
    targets = tokens.roll(-1, 1)
    with pytest.raises(RuntimeError, match="not given a sampling"):
        model.sampling_outside()
    narrow = RowSampling(torch.ones(2), torch.ones(2, dtype=torch.long), torch.ones(2))  # top_k = 1
    logp = model.token_logprobs(tokens, targets, sampling=narrow)
    kept = model(tokens).argmax(-1)
    assert model.sampling_outside().tolist() == (kept != targets).sum(1).tolist()
    assert torch.isfinite(logp).all()
    plain = RowSampling(torch.ones(2), torch.zeros(2, dtype=torch.long), torch.ones(2))
    assert torch.equal(model.token_logprobs(tokens, targets, sampling=plain), model.token_logprobs(tokens, targets))


def test_kept_sets_found_in_chunks_are_those_found_at_once(monkeypatch):
    import trainer.model.sampling as sampling_module

    logits, targets = random_case(7)
    whole, _ = sampled_logprobs(logits, targets, MIXED)
    monkeypatch.setattr(sampling_module, "SORT_CHUNK_LOGITS", 3 * V)  # three positions a sort
    chunked, _ = sampled_logprobs(logits, targets, MIXED)
    assert torch.equal(whole, chunked)


def test_a_nucleus_edge_that_falls_exactly_on_a_cumulative_probability_drops_that_token_as_vllm_does():
    """Four equal tokens hold all the mass: cumulative 0.25, 0.5, 0.75, 1 in ascending order, and top_p 0.5
    drops those <= 0.5, so two are kept (each 1/2), not three."""
    logits = torch.full((1, 3, V), -1e9)
    logits[:, :, 10:14] = 10.0
    sampling = RowSampling(torch.ones(1), torch.zeros(1, dtype=torch.long), torch.full((1,), 0.5))
    targets = sampled_from(logits, sampling, 0)
    ours, outside = sampled_logprobs(logits, targets, sampling)
    theirs = vllm_processed_logprobs(logits, targets, sampling)
    assert not outside.any()
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours, torch.full((1, 3), 0.5).log())
