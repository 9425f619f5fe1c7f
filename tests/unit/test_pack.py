"""Sequence packing (trainer/pack.py): the row layout and its balance over ranks, attention that never crosses a
sample's boundary, and the packed RL update, warm start and pretraining rows against the same samples padded."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch

from common.config import Config, ModelConfig
from rollout.client import Sample
from rollout.generator import Rollout
from trainer.core import TrainingCore, cross_entropy_loss, rank_rows
from trainer.model import build_model
from trainer.model.sampling import RowSampling
from trainer.pack import pack_rows, padding_positions, stream_documents
from trainer.ranks import Ranks
from trainer.rl.batch import (
    packed_rl_batch,
    packed_warm_start_batch,
    padded_batch,
    rollout_lengths,
    sampling_rows,
)
from trainer.rl.replay import routing_batch
from trainer.rl.update import mini_batch_rows, proximal_fn, rl_updates

# Samples of very different lengths: (prompt tokens, completion tokens).
SHAPES = [(3, 40), (9, 2), (5, 17), (2, 1), (12, 30), (4, 6), (7, 11), (3, 3)] * 2


def test_rows_hold_every_sample_once_within_the_budget_and_are_balanced_over_ranks():
    g = torch.Generator().manual_seed(3)
    for world in (1, 2, 3, 4):
        lengths = torch.randint(1, 60, (37,), generator=g).tolist()
        rows = pack_rows(lengths, 64, world)
        assert sorted(i for row in rows for i in row) == list(range(37))
        loads = [sum(lengths[i] for i in row) for row in rows]
        assert max(loads) <= 64
        per_rank = [sum(loads[rank_rows(len(rows), world, r)]) for r in range(world)]
        # Greedy longest-first into the least-loaded rank: within one row of each other.
        assert max(per_rank) - min(per_rank) <= max(loads), (world, per_rank)
    assert len(pack_rows([3, 3, 3], 64, world=3)) == 3  # every rank gets a row
    with pytest.raises(ValueError, match="pack_tokens"):
        pack_rows([10, 70], 64)


def test_stream_rows_restart_documents_and_positions_after_each_eos():
    out = stream_documents(torch.tensor([[4, 5, 0, 6, 7, 8, 0, 9]]), eos=0)
    assert out["documents"].tolist() == [[0, 0, 0, 1, 1, 1, 1, 2]]
    assert out["positions"].tolist() == [[0, 1, 2, 0, 1, 2, 3, 0]]


def _models() -> list[ModelConfig]:
    """The default (DeepSeek-V3: MLA) and a Qwen3-MoE (GQA with grouped kv heads) shape."""
    qwen = ModelConfig(arch="qwen3_moe", num_heads=4, num_kv_heads=2, n_shared_experts=0, first_k_dense=0)
    qwen.check()
    return [ModelConfig(), qwen]


@pytest.mark.parametrize("model_cfg", _models(), ids=["mla", "gqa"])
def test_a_token_sees_only_its_own_sample_in_a_packed_row(model_cfg):
    """Each sample of a packed row gives the logits it gives alone; changing one sample changes no other's
    (within float noise: an expert GEMM's rows move with the changed tokens' routing)."""
    model = build_model(model_cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    lengths = [7, 3, 11, 5]
    docs = [torch.randint(0, 128, (n,), generator=g) for n in lengths]
    tokens = torch.cat(docs + [torch.zeros(4, dtype=torch.long)]).unsqueeze(0)  # a padded tail too
    documents = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)] + [torch.full((4,), -1)]).unsqueeze(0)
    positions = torch.cat([torch.arange(n) for n in lengths] + [torch.zeros(4, dtype=torch.long)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions, documents=documents)[0]
        changed = tokens.clone()
        changed[0, 7:10] = (changed[0, 7:10] + 1) % 128  # sample 1
        after = model(changed, positions, documents=documents)[0]
        at = 0
        for d, n in enumerate(lengths):
            alone = model(docs[d].unsqueeze(0))[0]
            assert torch.allclose(packed[at : at + n], alone, atol=1e-5, rtol=1e-5), d
            if d != 1:  # up to the expert GEMMs' row blocking, which the changed tokens' routing moves
                assert torch.allclose(after[at : at + n], packed[at : at + n], atol=1e-6, rtol=0), d
            at += n
        assert not torch.allclose(after[7:10], packed[7:10])


def test_the_flex_document_mask_is_the_dense_one():
    """The CUDA path's mask_mod (run here through eager flex attention on the CPU) attends as the CPU path's
    dense mask, for MLA's unequal q/k and v head dims and for grouped kv heads."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from trainer.model.attention import DocumentMask, attend, same_document

    documents = torch.tensor([[0] * 7 + [1] * 3 + [2] * 11 + [3] * 5 + [-1] * 4, [0] * 20 + [1] * 10])
    B, S = documents.shape
    block_mask = create_block_mask(same_document(documents), B, None, S, S, device="cpu")
    g = torch.Generator().manual_seed(0)
    for heads, kv_heads, d, dv in ((4, 4, 96, 32), (4, 2, 32, 32)):
        q = torch.randn(B, heads, S, d, generator=g)
        k, v = torch.randn(B, kv_heads, S, d, generator=g), torch.randn(B, kv_heads, S, dv, generator=g)
        flex = flex_attention(q, k, v, block_mask=block_mask, scale=0.1, enable_gqa=heads != kv_heads)
        assert torch.allclose(flex, attend(q, k, v, DocumentMask(documents), 0.1), atol=1e-5)


def _rollouts(routed: bool, layers: int, k: int) -> list[Rollout]:
    """Samples of SHAPES with their own temperatures, top-k and top-p (and vLLM's routing when `routed`)."""
    g = torch.Generator().manual_seed(5)
    settings = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 20, 1.0), (0.8, 10, 0.8)]
    out = []
    for i, (p, n) in enumerate(SHAPES):
        T, top_k, top_p = settings[i % len(settings)]
        experts = None
        if routed:  # one row per position but the last, every decoder layer (dense ones 0)
            experts = torch.randint(0, 8, (p + n - 1, layers, k), generator=g).numpy().astype(np.uint8)
        sample = Sample(
            torch.randint(1, 128, (p,), generator=g).tolist(),
            torch.randint(1, 128, (n,), generator=g).tolist(),
            (-torch.rand(n, generator=g) * 3).tolist(),
            [0] * n,
            "stop",
            routed_experts=experts,
            temperature=T,
            top_k=top_k,
            top_p=top_p,
        )
        out.append(Rollout(sample, 1.0, ""))
    return out


def _padded_rl_batch(cfg: Config, rollouts: list[Rollout], model) -> dict[str, torch.Tensor]:
    """The RL step's batch as trainer/rl/driver.py's `_update` builds it, its behaviour log-probs the seed-0
    model's plus noise per token and per sample (so that both correction bands leave some tokens out)."""
    tokens, targets, behaviour, mask = padded_batch(rollouts, pad_id=0)
    g = torch.Generator().manual_seed(9)
    with torch.no_grad():
        own = build_model(cfg.trainer.model, seed=0).eval()
        exact = own.token_logprobs(tokens, targets, sampling=RowSampling(**sampling_rows(rollouts)))
    noise = 0.3 * torch.randn(behaviour.shape, generator=g) + 0.5 * torch.randn(len(rollouts), 1, generator=g)
    behaviour = (exact + noise) * mask
    batch = {
        "tokens": tokens,
        "targets": targets,
        "behaviour": behaviour,
        "mask": mask,
        "advantages": torch.randn(len(rollouts), generator=g),
        "fresh": (torch.arange(len(rollouts)) % 3 == 0).float(),
        "step_tokens": torch.full((len(rollouts),), float(mask.sum())),
        **sampling_rows(rollouts),
    }
    if rollouts[0].sample.routed_experts is not None:
        batch["routing"] = routing_batch(
            [r.sample for r in rollouts], tokens.shape[1], model.moe_layer_ids(), cfg.trainer.model.num_experts_per_tok
        )
    return batch


def _weights(model) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def rl_step(cfg: Config, packed: bool, world: int = 1, core: TrainingCore | None = None):
    """One RL step (trainer.rl.mini_batches updates) on the core from seed-0 weights, padded or packed."""
    rl = cfg.trainer.rl
    core = core or TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))
    rollouts = _rollouts(rl.routing_replay == "rollout", cfg.trainer.model.num_layers, 2)
    batch = _padded_rl_batch(cfg, rollouts, core.model)
    rows = mini_batch_rows([4] * (len(rollouts) // 4), rl.mini_batches)
    if packed:
        batch, rows = packed_rl_batch(batch, rollout_lengths(rollouts), rows, cfg.trainer.pack_tokens, world, pad_id=0)
    result = core.step_updates(rl_updates(batch, rows, rl), rl.micro_batch_samples, prepare=proximal_fn(rl))
    return core, result, batch


def _rl_config(aggregation: str, mini_batches: int, replay: bool) -> Config:
    cfg = Config()
    rl = cfg.trainer.rl
    rl.aggregation, rl.mini_batches = aggregation, mini_batches
    rl.micro_batch_samples = 3  # several micro-batches per update, padded and packed
    rl.token_mask_band, rl.seq_mask_band = [0.3, 3.0], [0.6, 1.6]  # both per-sample corrections act
    rl.routing_replay = "rollout" if replay else "off"
    return cfg


@pytest.mark.parametrize(
    ("aggregation", "mini_batches", "replay", "pack_tokens"),
    [
        ("token-mean", 1, False, 0),
        ("seq-mean-token-sum", 1, False, 0),
        ("seq-mean-token-mean", 1, False, 0),
        ("seq-mean-token-mean", 2, True, 0),
        ("token-mean", 1, False, 120),
    ],
)
def test_a_packed_rl_update_is_the_padded_update(aggregation, mini_batches, replay, pack_tokens):
    """The same samples (lengths 3 to 52, each with its own temperature, top-k and top-p, vLLM's routing
    replayed per token) padded and packed: the decoupled PPO update gives the same losses (1e-5 relative) and
    the same weights (1e-5), on fewer positions."""
    cfg = _rl_config(aggregation, mini_batches, replay)
    cfg.trainer.pack_tokens = pack_tokens
    start = _weights(build_model(cfg.trainer.model, seed=0))
    padded_core, padded, padded_batch_ = rl_step(cfg, packed=False)
    packed_core, packed, packed_batch_ = rl_step(cfg, packed=True)
    assert packed_batch_["tokens"].numel() < padded_batch_["tokens"].numel() * 0.7
    for k in ("loss", "pg_loss", "tokens", "clip_fraction", "token_masked_fraction", "seq_masked_fraction"):
        a, b = padded.figures[k], packed.figures[k]
        print(f"{k}: padded {a:.9g} packed {b:.9g}")
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), k
    assert 0 < packed.figures["seq_masked_fraction"] < 0.5 and 0 < packed.figures["token_masked_fraction"] < 0.5
    # Adam's first steps move every weight by about lr whatever its gradient's size: the gradients themselves.
    for u, v in zip(padded.updates, packed.updates, strict=True):
        print(f"grad norm: padded {u.grad_norm:.9g} packed {v.grad_norm:.9g}")
        assert abs(u.grad_norm - v.grad_norm) <= 1e-5 * u.grad_norm
    assert packed.figures["fresh_tokens"] == padded.figures["fresh_tokens"]
    assert packed.figures["sampling_outside_tokens"] == padded.figures["sampling_outside_tokens"]
    if replay:
        assert packed.figures["routing_compared"] == padded.figures["routing_compared"] > 0
    a, b = _weights(padded_core.model), _weights(packed_core.model)
    diff = float((a - b).abs().max())
    print(f"max |weight diff| {diff:.3g}, moved {float((a - start).abs().max()):.3g}")
    assert float((a - start).abs().max()) > 1e-4  # it moved
    assert diff <= 1e-5


@pytest.mark.parametrize("checkpointing", ["none", "selective"])
def test_the_warm_start_packed_is_the_warm_start_padded(checkpointing):
    """A supervised step on rows of prompt + answer (the warm start's layout) packed and padded, with the blocks'
    activations kept or (selective) recomputed in the backward, where the document mask goes along."""
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(1, 128, (p + n + 1,), generator=g) for p, n in SHAPES]
    L = max(map(len, rows))
    tokens = torch.stack([torch.cat([r, torch.zeros(L - len(r), dtype=torch.long)]) for r in rows])
    mask = torch.zeros_like(tokens)
    for b, (p, n) in enumerate(SHAPES):
        mask[b, p : p + n + 1] = 1
    targets = torch.where(mask[:, 1:] > 0, tokens[:, 1:], torch.full_like(tokens[:, 1:], -1))
    batch = {"tokens": tokens[:, :-1], "targets": targets}
    n_targets = int((targets >= 0).sum())
    cores = []
    for b in (batch, packed_warm_start_batch(batch, 0, 1, pad_id=0)):
        cfg = Config()
        cfg.trainer.activation_checkpoint = checkpointing
        core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))
        result = core.step(b, cross_entropy_loss(n_targets), 4, tokens=0, lr=1e-3)
        cores.append((core, result.figures["loss"], b["tokens"].numel()))
    (padded, padded_loss, padded_n), (packed, packed_loss, packed_n) = cores
    assert packed_n < padded_n * 0.7
    assert abs(padded_loss - packed_loss) <= 1e-5 * padded_loss
    assert float((_weights(padded.model) - _weights(packed.model)).abs().max()) <= 1e-5


def test_a_pretraining_row_trains_each_document_as_if_alone():
    """A stream row of EOS-ended documents: each document's loss is what it has alone in a row."""
    model = build_model(ModelConfig(), seed=0)
    eos = 0
    g = torch.Generator().manual_seed(4)
    docs = [torch.cat([torch.randint(1, 128, (n,), generator=g), torch.tensor([eos])]) for n in (6, 13, 2, 9)]
    stream = torch.cat(docs)
    tokens, targets = stream[:-1].unsqueeze(0), stream[1:].unsqueeze(0)
    packed = cross_entropy_loss(1)(model, {"tokens": tokens, "targets": targets, **stream_documents(tokens, eos)})
    # Alone: each document's tokens predict their next token (the EOS predicts the next document's first).
    total, at = torch.zeros(()), 0
    for d in docs:
        n = min(len(d), tokens.shape[1] - at)
        alone = {"tokens": tokens[:, at : at + n], "targets": targets[:, at : at + n]}
        total = total + cross_entropy_loss(1)(model, alone).loss
        at += n
    assert torch.allclose(packed.loss, total, rtol=1e-5)
    assert not torch.allclose(cross_entropy_loss(1)(model, {"tokens": tokens, "targets": targets}).loss, total)


def test_the_demo_mix_computes_fewer_positions_packed():
    packed, padded = padding_positions([p + n for p, n in SHAPES], budget=max(p + n for p, n in SHAPES), world=2)
    assert packed < padded


def _packed_on_ranks(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.ranks import RankInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = _rl_config("seq-mean-token-mean", 2, True)
        cfg.trainer.parallel.ep = world
        ranks = Ranks(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), dist.group.WORLD)
        core = TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=0))
        _, result, _ = rl_step(cfg, packed=True, world=world, core=core)
        torch.save({"part": core.hf_part(), "figures": result.figures}, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_a_packed_rl_step_on_two_expert_parallel_ranks_is_the_padded_one_rank_step(tmp_path):
    """Packed rows dealt to 2 ranks (EP = 2, real gloo processes) by token count make one rank's padded step:
    the same losses and, up to test_core's EP_STEP_BOUND (float summation order through Adam), weights."""
    import torch.multiprocessing as mp

    from tests.unit.test_core import EP_STEP_BOUND, worst_relative_difference
    from trainer.hf import hf_tensors

    mp.spawn(_packed_on_ranks, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    cfg = _rl_config("seq-mean-token-mean", 2, True)
    core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))
    start = {name: t.clone() for name, t in hf_tensors(core.model)}
    _, one, _ = rl_step(cfg, packed=False, core=core)
    for k in ("loss", "pg_loss", "tokens", "seq_masked_fraction", "routing_compared"):
        a, b = one.figures[k], parts[0]["figures"][k]
        print(f"{k}: padded 1 rank {a:.9g}, packed 2 ranks {b:.9g}")
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), k
    two = parts[0]["part"] | parts[1]["part"]
    # The aux-loss-free bias is no weight: it follows the experts' load, which counts every position a row
    # routes, padding too (padded rows route their padding, packed rows less of it). Packing changes it.
    bias = "e_score_correction_bias"
    one_rank = {k: v for k, v in hf_tensors(core.model) if not k.endswith(bias)}
    worst, difference = worst_relative_difference(
        {k: v for k, v in two.items() if not k.endswith(bias)}, one_rank, start
    )
    assert difference <= EP_STEP_BOUND, worst


def test_packing_is_the_default_and_applies_where_it_is_exact():
    assert Config().trainer.packs()
    cfg = Config()
    cfg.trainer.pack = False
    assert not cfg.trainer.packs()
    cfg.trainer.pack = True
    cfg.trainer.optim.seq_aux_loss_coef = 1e-3
    assert not cfg.trainer.packs()
    cfg = copy.deepcopy(Config())
    cfg.trainer.pack = True
    cfg.trainer.rl.algorithm = "ppo"
    assert not cfg.trainer.packs()


def test_a_run_asked_to_pack_that_trains_padded_rows_says_why_once_at_the_start(caplog):
    cfg = Config()
    cfg.trainer.pack = True
    cfg.trainer.rl.algorithm = "ppo"
    cfg.trainer.optim.seq_aux_loss_coef = 1e-3
    model = build_model(cfg.trainer.model, seed=0)
    with caplog.at_level(logging.INFO, logger="trainer.core"):
        TrainingCore(cfg, Ranks.single(torch.device("cpu")), model)
    said = [r.getMessage() for r in caplog.records if "trainer.pack" in r.getMessage()]
    assert said == [
        'trainer.pack = true, but rows stay padded: trainer.rl.algorithm = "ppo" (its critic\'s GAE runs per row; '
        '"grpo" packs); trainer.optim.seq_aux_loss_coef = 0.001 (the sequence balance loss is taken per row; 0 packs)'
    ]
    caplog.clear()
    cfg.trainer.pack = False  # asked for padding: nothing to say
    with caplog.at_level(logging.INFO, logger="trainer.core"):
        TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))
    assert not [r for r in caplog.records if "trainer.pack" in r.getMessage()]


def test_pretraining_has_no_critic_to_keep_its_rows_padded():
    cfg = Config()
    cfg.trainer.pack = True
    cfg.trainer.mode, cfg.trainer.rl.algorithm = "pretrain", "ppo"
    assert cfg.trainer.packs()
