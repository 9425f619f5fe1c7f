"""Expert-parallel layout without processes: the plan's offsets reproduce the single-rank expert order,
and the one-rank transport leaves the model's results bitwise unchanged."""

import pytest
import torch

from common.config import ModelConfig
from trainer.ep import (
    LocalTransport,
    ProcessGroupTransport,
    ShardedExperts,
    SymmetricMemoryTransport,
    TransportUnavailable,
    apply_expert_parallel,
    make_plan,
    make_transport,
)
from trainer.model import build_model


def _counts(world: int, experts: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 5, (world, experts), generator=torch.Generator().manual_seed(seed))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("world", [1, 2, 4])
def test_placed_rows_are_the_single_rank_expert_order(world):
    """Every source's rows, put at the plan's offsets, give each owner the rows of its experts in the
    order one rank sorting the concatenated batch would see them (expert, then source, then token)."""
    E, H = 8, 3
    counts = _counts(world, E, seed=world)
    plans = [make_plan(counts, r, "cpu") for r in range(world)]
    # Source s's sorted rows carry (expert, source, index within that expert's rows from s).
    rows = [
        torch.tensor([[e, s, i] for e in range(E) for i in range(int(counts[s, e]))], dtype=torch.float32).view(-1, H)
        for s in range(world)
    ]
    El = E // world
    for owner in range(world):
        buf = torch.full((plans[owner].rows_in, H), -1.0)
        for s in range(world):
            p = plans[s]
            segment = rows[s][p.send_offsets[owner] : p.send_offsets[owner] + p.send_splits[owner]]
            buf[p.put_index[owner]] = segment
        expected = torch.cat([r[r[:, 0] == e] for e in range(owner * El, (owner + 1) * El) for r in rows])
        assert torch.equal(buf, expected)
        # The owner's own view (source-major receive + recv_index) is the same placement.
        received = torch.cat(
            [rows[s][plans[s].send_offsets[owner] :][: plans[s].send_splits[owner]] for s in range(world)]
        )
        assert torch.equal(buf[plans[owner].recv_index], received)
        ends = torch.cumsum(counts[:, owner * El : (owner + 1) * El].sum(0), 0)
        assert plans[owner].expert_offsets.tolist() == ends.tolist()
        # Results return to where each source's segment began in its own sorted rows.
        for s in range(world):
            assert plans[owner].return_offsets[s] == plans[s].send_offsets[owner]


@pytest.mark.timeout(30)
def test_max_rows_follows_the_counts_not_the_worst_case():
    counts = torch.zeros(2, 8, dtype=torch.int64)
    counts[:, 0] = torch.tensor([5, 7])  # every row to expert 0, owned by rank 0
    plan0, plan1 = make_plan(counts, 0, "cpu"), make_plan(counts, 1, "cpu")
    assert (plan0.rows_in, plan1.rows_in) == (12, 0)
    assert (plan0.rows_out, plan1.rows_out) == (5, 7)
    assert plan0.max_rows == plan1.max_rows == 12


@pytest.mark.timeout(30)
def test_plan_refuses_experts_that_do_not_split():
    with pytest.raises(ValueError, match="6 experts do not split over 4 ranks"):
        make_plan(torch.zeros(4, 6, dtype=torch.int64), 0, "cpu")


@pytest.mark.timeout(60)
def test_local_transport_is_bitwise_the_plain_model():
    cfg = ModelConfig(num_layers=3, kv_lora_rank=16)
    plain, sharded = build_model(cfg, seed=3), build_model(cfg, seed=3)
    ep = apply_expert_parallel(sharded, LocalTransport())
    assert all(isinstance(m.experts, ShardedExperts) for m in sharded.moe_layers())
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))
    a, b = plain(tokens), sharded(tokens)
    assert torch.equal(a, b)
    a.square().mean().backward()
    b.square().mean().backward()
    for (name, p), q in zip(plain.named_parameters(), sharded.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert ep.transport.allocated_bytes == 0


@pytest.mark.timeout(30)
def test_distributed_transports_refuse_to_start_without_what_they_need():
    assert not torch.distributed.is_initialized()
    with pytest.raises(TransportUnavailable, match="init_process_group"):
        ProcessGroupTransport()
    with pytest.raises(TransportUnavailable, match="torch.distributed"):
        SymmetricMemoryTransport()
    with pytest.raises(ValueError, match="use local, p2p or symm_mem"):
        make_transport("all_to_all")


@pytest.mark.timeout(30)
def test_sharding_refuses_an_expert_count_that_does_not_split():
    model = build_model(ModelConfig(num_layers=2, kv_lora_rank=16, n_routed_experts=6, num_experts_per_tok=2))
    transport = LocalTransport()
    transport.world = 4  # as if a group of 4: only the expert split is checked before any exchange
    with pytest.raises(ValueError, match="n_routed_experts = 6 does not split over an expert-parallel group of 4"):
        apply_expert_parallel(model, transport)


@pytest.mark.timeout(60)
def test_sharded_experts_run_on_the_per_step_weight_copy_like_the_plain_model(monkeypatch):
    """Under bf16 autocast over fp32 masters the sharded experts, like `Experts`, ask for a bf16 copy of their
    block, get it from the optimizer's refresh, and then run the GEMMs on it (no per-call cast of the masters);
    the result stays bitwise the plain model's, before and after an optimizer step."""
    import trainer.model.moe as moe
    from trainer.experts import BACKENDS
    from trainer.model.moe import refresh_expert_weight_copies

    seen: list[bool] = []
    grouped = BACKENDS["grouped_mm"]

    def recording(x, offsets, gate_up, down, cast_weights=None):
        seen.append(cast_weights is not None)
        return grouped(x, offsets, gate_up, down, cast_weights)

    monkeypatch.setitem(moe.BACKENDS, "grouped_mm", recording)
    cfg = ModelConfig(num_layers=2, kv_lora_rank=16)
    plain, sharded = build_model(cfg, "grouped_mm", seed=3), build_model(cfg, "grouped_mm", seed=3)
    apply_expert_parallel(sharded, LocalTransport())
    tokens = torch.randint(0, cfg.vocab_size, (2, 10), generator=torch.Generator().manual_seed(0))

    def outputs() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("cpu", torch.bfloat16):
            return plain(tokens), sharded(tokens)

    a, b = outputs()
    assert torch.equal(a, b) and seen == [False, False]  # no copy yet: cast per call, and one asked for
    for model in (plain, sharded):
        refresh_expert_weight_copies(model)
    layer = sharded.moe_layers()[0].experts
    assert isinstance(layer, ShardedExperts) and layer._cast[0].dtype == torch.bfloat16
    seen.clear()
    a, b = outputs()
    assert torch.equal(a, b) and seen == [True, True]
    with torch.no_grad():
        for model in (plain, sharded):
            for m in model.moe_layers():
                m.experts.gate_up_proj.mul_(0.5)
            refresh_expert_weight_copies(model)
    a2, b2 = outputs()
    assert torch.equal(a2, b2) and not torch.equal(a2, a)
