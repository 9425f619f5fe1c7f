"""Rollout routing replay (R3) in the trainer, the mismatch telemetry and the loss corrections, on the
real model (CPU) and, for expert parallelism, real gloo ranks."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.config import Config, ModelConfig, RLConfig
from rollout.client import Sample
from trainer.ep import ProcessGroupTransport, apply_expert_parallel
from trainer.model import build_model
from trainer.rl.loss import ppo_loss
from trainer.rl.replay import MissingRoutingError, routing_batch
from trainer.rl.update import GAP_EDGES, gap_quantile

B, S = 3, 10


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (B, S + 1), generator=torch.Generator().manual_seed(seed))


def _own_routing(model) -> tuple[list[torch.Tensor], list]:
    """Record each MoE layer's own top-k ids [B, S, k] during the next forward."""
    seen: list[torch.Tensor] = []

    def hook(gate, args, out):
        seen.append(out[1].view(B, S, -1).clone())

    handles = [m.gate.register_forward_hook(hook) for m in model.moe_layers()]
    return seen, handles


def _perturb_bias(model, seed: int = 1) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.moe_layers():
            m.gate.e_score_correction_bias.add_(torch.randn(8, generator=gen) * 0.05)


def test_replaying_the_original_routing_gives_back_the_original_log_probs(tiny_model):
    """Replaying the original routing after a bias perturbation gives back the original log-probs."""
    model = build_model(tiny_model, seed=3)
    tokens = _tokens()
    seen, handles = _own_routing(model)
    original = model.token_logprobs(tokens[:, :-1], tokens[:, 1:])
    for h in handles:
        h.remove()
    routing = torch.stack(seen, dim=2)  # [B, S, moe layers, k]
    # The router's own choice given back: disagreement 0 and, replayed, the same function bit for bit.
    same = model.token_logprobs(tokens[:, :-1], tokens[:, 1:], routing=routing, replay=True)
    differ, compared = model.routing_disagreement()
    assert int(differ.sum()) == 0 and int(compared.sum()) == B * S * 2
    assert torch.equal(same, original)
    _perturb_bias(model)
    moved = model.token_logprobs(tokens[:, :-1], tokens[:, 1:], routing=routing, replay=False)
    differ, _ = model.routing_disagreement()
    assert int(differ.sum()) > 0  # the perturbed router chooses other experts for some tokens...
    assert float((moved - original).detach().abs().max()) > 1e-4  # ...which changes the log-probs
    back = model.token_logprobs(tokens[:, :-1], tokens[:, 1:], routing=routing, replay=True)
    assert torch.equal(back, original)  # the bias only chooses; weights come from the unbiased scores


def test_replay_keeps_the_router_gradient_and_leaves_replayed_tokens_out_of_the_bias_load(tiny_model):
    model = build_model(tiny_model, seed=3)
    tokens = _tokens()
    seen, handles = _own_routing(model)
    with torch.no_grad():
        model(tokens[:, :-1])
    for h in handles:
        h.remove()
    routing = torch.stack(seen, dim=2)
    routing[0, 4:] = -1  # row 0 from position 4 on: no rollout routing (the router's own choice)
    model.train()
    for m in model.moe_layers():
        m.tokens_per_expert.zero_()
    model.token_logprobs(tokens[:, :-1], tokens[:, 1:], routing=routing, replay=True).sum().backward()
    for m in model.moe_layers():
        assert m.gate.weight.grad is not None and float(m.gate.weight.grad.abs().sum()) > 0
        # Only the 6 positions without a given routing count (k = 2 slots each).
        assert float(m.tokens_per_expert.sum()) == 6 * 2


def _ep_replay_worker(rank: int, world: int, out: str, model: ModelConfig) -> None:
    cfg = Config()
    cfg.trainer.model = model
    single = build_model(cfg.trainer.model, seed=3)
    sharded = build_model(cfg.trainer.model, seed=3)
    apply_expert_parallel(sharded, ProcessGroupTransport(dist.group.WORLD), None)
    tokens = _tokens()
    seen, handles = _own_routing(single)
    with torch.no_grad():
        expected = single.token_logprobs(tokens[:, :-1], tokens[:, 1:])
    for h in handles:
        h.remove()
    routing = torch.stack(seen, dim=2)
    _perturb_bias(sharded)  # the replayed ids, not this rank's router, must drive the expert dispatch
    with torch.no_grad():
        got = sharded.token_logprobs(tokens[:, :-1], tokens[:, 1:], routing=routing, replay=True)
    torch.save(float((got - expected).abs().max()), f"{out}/rank{rank}.pt")


def _entry(rank: int, world: int, store: str, out: str, model: ModelConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _ep_replay_worker(rank, world, out, model)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_replayed_ids_drive_the_expert_parallel_dispatch(tmp_path: Path, tiny_model):
    """Two real gloo ranks, EP = 2: replay through the RDEP exchange gives the single-rank log-probs."""
    mp.spawn(_entry, args=(2, str(tmp_path / "store"), str(tmp_path), tiny_model), nprocs=2, join=True)
    for r in range(2):
        assert torch.load(tmp_path / f"rank{r}.pt") < 1e-5


def _sample(prompt: int, completion: int, layers: int = 3, k: int = 2, fill: int = 5) -> Sample:
    rows = np.full((prompt + completion - 1, layers, k), fill, dtype=np.uint8)
    rows[:, :, 1] = np.arange(prompt + completion - 1)[:, None] % 7
    return Sample(list(range(prompt)), list(range(completion)), [0.0] * completion, [0] * completion, "stop", rows)


def test_routing_batch_puts_row_i_at_position_i_and_marks_the_rest_unknown():
    a, b = _sample(4, 3), _sample(2, 2)
    out = routing_batch([a, b], 8, [1, 2], 2)
    assert out.shape == (2, 8, 2, 2) and out.dtype == torch.int16
    assert torch.equal(out[0, :6], torch.from_numpy(a.routed_experts[:, [1, 2]].astype(np.int16)))
    assert bool((out[0, 6:] == -1).all()) and bool((out[1, 3:] == -1).all())
    with pytest.raises(MissingRoutingError, match="return_routed_experts"):
        routing_batch([Sample([1], [2], [0.0], [0], "stop")], 4, [1, 2], 2)
    with pytest.raises(MissingRoutingError, match="another model shape"):
        routing_batch([a], 8, [1, 2], 4)


def test_token_and_sequence_masks_leave_tokens_out_and_say_how_many():
    behaviour = torch.zeros(2, 3)
    proximal = torch.log(torch.tensor([[1.0, 3.0, 1.0], [0.25, 0.25, 1.0]]))  # iw per token
    mask = torch.ones(2, 3)
    adv = torch.tensor([1.0, 1.0])
    rl = RLConfig(clip_low=0.2, clip_high=0.2, tis_cap=10.0)
    plain = ppo_loss(proximal.clone().requires_grad_(), proximal, behaviour, adv, mask, rl)
    token = RLConfig(**{**rl.__dict__, "token_mask_band": [0.5, 2.0]})
    out = ppo_loss(proximal.clone().requires_grad_(), proximal, behaviour, adv, mask, token)
    assert out.stats["token_masked_fraction"] == pytest.approx(3 / 6)  # iw 3, 0.25, 0.25 are outside
    assert out.loss.item() == pytest.approx(-(1 + 1 + 1) / 6)  # ratio 1 x iw 1 on the three kept tokens
    seq = RLConfig(**{**rl.__dict__, "seq_mask_band": [0.5, 2.0]})
    out = ppo_loss(proximal.clone().requires_grad_(), proximal, behaviour, adv, mask, seq)
    # Row 0: geometric mean 3^(1/3) = 1.44 kept; row 1: 0.0625^(1/3) = 0.40 masked.
    assert out.stats["seq_masked_fraction"] == pytest.approx(3 / 6)
    assert out.loss.item() == pytest.approx(-(1 + 3 + 1) / 6)
    assert plain.stats["token_masked_fraction"] == plain.stats["seq_masked_fraction"] == 0.0
    k3 = float((proximal.exp() - proximal - 1).mean())
    assert plain.stats["behaviour_proximal_k3"] == pytest.approx(k3)
    assert plain.stats["behaviour_proximal_abs_logp_diff_max"] == pytest.approx(float(np.log(4)))


def test_gap_quantile_is_within_one_bin_of_the_exact_quantile():
    gaps = torch.tensor(np.random.default_rng(0).lognormal(-8, 2, 5000))
    hist = torch.histogram(gaps.clamp(GAP_EDGES[0], GAP_EDGES[-1]), GAP_EDGES).hist
    exact = float(torch.quantile(gaps, 0.99))
    assert exact <= gap_quantile(hist, 0.99) <= exact * 1.13
    assert gap_quantile(torch.zeros(220, dtype=torch.float64), 0.99) == 0.0


def test_a_mask_band_that_cannot_mask_is_refused():
    from common.config import ConfigError, validate

    cfg = Config()
    cfg.trainer.rl.token_mask_band = [1.5, 2.0]
    with pytest.raises(ConfigError, match="token_mask_band"):
        validate(cfg)


def test_replay_without_routed_experts_from_the_workers_is_refused():
    from common.config import ConfigError, validate

    cfg = Config()
    cfg.trainer.rl.routing_replay = "rollout"
    cfg.rollout.return_routed_experts = False
    with pytest.raises(ConfigError, match="return_routed_experts = true"):
        validate(cfg)
