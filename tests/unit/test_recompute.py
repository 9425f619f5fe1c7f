"""Activation checkpointing (trainer.activation_checkpoint): the same training step in every mode, with fewer
activations kept; the MoE load counted once; under expert parallelism (real gloo processes) too."""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.config import Config, ConfigError, ModelConfig, load_config
from trainer.core import TrainingCore, cross_entropy_loss
from trainer.hf import hf_tensors
from trainer.model import build_model
from trainer.model.recompute import run_block
from trainer.ranks import RankInfo, Ranks

ROWS, SEQ = 4, 24


def _config(model: ModelConfig, mode: str, ep: int = 1) -> Config:
    cfg = Config()
    cfg.trainer.model = replace(model, max_seq_len=SEQ)
    cfg.trainer.activation_checkpoint = mode  # type: ignore[assignment]
    cfg.trainer.parallel.ep = ep
    cfg.trainer.optim.bias_update_rate = 0.01  # the bias update sees the counted load
    cfg.trainer.optim.seq_aux_loss_coef = 1e-3  # and the balance loss goes through the recomputed forward
    return cfg


def _batch(step: int, vocab: int) -> dict[str, torch.Tensor]:
    x = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))
    return {"tokens": x[:, :-1], "targets": x[:, 1:]}


def _two_steps(core: TrainingCore) -> tuple[list[float], dict[str, torch.Tensor]]:
    vocab = core.cfg.trainer.model.vocab_size
    losses = []
    for step in range(2):
        r = core.step(_batch(step, vocab), cross_entropy_loss(ROWS * SEQ), 2, tokens=ROWS * SEQ)
        losses.append(r.figures["loss"])
    return losses, {n: t.detach().clone() for n, t in hf_tensors(core.model)}


def _kept_bytes(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    """Bytes a forward leaves allocated until its backward (what it keeps for the backward, plus its small
    output): the net of every allocation and free of the forward, from the profiler's memory events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(batch["tokens"]).float().logsumexp(-1).mean()
    loss.backward()
    return sum(e.self_cpu_memory_usage for e in prof.events())


def test_every_mode_makes_the_same_steps_and_keeps_fewer_activations(tiny_model):
    """Two optimizer steps (2 micro-batches each, bias update and balance loss on) in each mode: the same losses
    and the same weights bit for bit (the recomputation repeats the forward's arithmetic exactly on the CPU), the
    expert bias moved by the load counted once; full keeps least, selective less than none."""
    runs = {}
    for mode in ("none", "full", "selective"):
        cfg = _config(tiny_model, mode)
        core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))
        runs[mode] = _two_steps(core)
    for mode in ("full", "selective"):
        assert runs[mode][0] == runs["none"][0], mode
        for name, t in runs["none"][1].items():
            assert torch.equal(runs[mode][1][name], t), (mode, name)
    kept = {}
    for mode in ("none", "full", "selective"):
        model = build_model(replace(tiny_model, max_seq_len=SEQ), seed=0)
        model.activation_checkpoint = mode
        kept[mode] = _kept_bytes(model, _batch(0, tiny_model.vocab_size))
    print(f"activation bytes kept: {kept}")
    assert kept["full"] < kept["selective"] < kept["none"], kept


def test_the_recomputed_forward_does_not_count_the_expert_load_again(tiny_model):
    """The load the aux-loss-free bias update balances is counted in the forward only (the backward's second
    forward of a checkpointed block leaves tokens_per_expert alone)."""
    loads = {}
    for mode in ("none", "full", "selective"):
        model = build_model(replace(tiny_model, max_seq_len=SEQ), seed=0)
        model.activation_checkpoint = mode
        model(_batch(0, tiny_model.vocab_size)["tokens"]).sum().backward()
        loads[mode] = [m.tokens_per_expert.clone() for m in model.moe_layers()]
        assert all(not m.recomputing for m in model.moe_layers())
    for mode in ("full", "selective"):
        for a, b in zip(loads[mode], loads["none"], strict=True):
            assert torch.equal(a, b), mode
    assert float(loads["none"][0].sum()) == ROWS * SEQ * tiny_model.num_experts_per_tok


def test_an_unknown_mode_is_refused_naming_the_choices(tmp_path, tiny_model):
    path = tmp_path / "c.toml"
    path.write_text('[trainer]\nactivation_checkpoint = "some"\n')
    with pytest.raises(ConfigError, match="activation_checkpoint"):
        load_config(path)
    block = build_model(replace(tiny_model, max_seq_len=SEQ), seed=0).model.layers[0]
    with pytest.raises(ValueError, match="none, full, selective"):
        run_block(block, "some", torch.zeros(1, 2, tiny_model.hidden_size), torch.zeros(2, 8), torch.zeros(2, 8))


def _ep_worker(rank: int, world: int, store: str, out: str, tiny: ModelConfig) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ranks = Ranks(RankInfo(rank, world, rank, "test"), torch.device("cpu"), dist.group.WORLD)
        for mode in ("none", "full", "selective"):
            cfg = _config(tiny, mode, ep=world)
            core = TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=0))
            losses, _ = _two_steps(core)
            torch.save({"losses": losses, "part": core.hf_part()}, f"{out}/{mode}-{rank}.pt")
        dist.barrier()
    finally:
        sys.stdout.flush()
        os._exit(0)  # tests/unit/test_ep_dist.py: gloo's destructors abort a rank now and then


@pytest.mark.timeout(120)
def test_under_expert_parallelism_the_modes_make_the_same_steps(tmp_path, tiny_model):
    """Two ranks with EP = 2 (gloo processes): each rank recomputes its blocks in the backward, expert exchange
    included, in the same order on both, so the exchanges pair up; losses and weights equal the plain mode's."""
    mp.spawn(_ep_worker, args=(2, str(tmp_path / "store"), str(tmp_path), tiny_model), nprocs=2, join=True)
    runs = {
        mode: [torch.load(Path(tmp_path, f"{mode}-{r}.pt")) for r in range(2)] for mode in ("none", "full", "selective")
    }
    for mode in ("full", "selective"):
        for r in range(2):
            assert runs[mode][r]["losses"] == runs["none"][r]["losses"], mode
            for name, t in runs["none"][r]["part"].items():
                assert torch.equal(runs[mode][r]["part"][name], t), (mode, r, name)


def test_an_rl_step_is_the_same_in_every_mode():
    """The decoupled-PPO step of three mini-batches (proximal log-probs computed without gradient first, which
    checkpointing leaves alone): the same weights and step figures in every mode."""
    from tests.unit.test_core import _rl_batch
    from trainer.rl.update import proximal_fn, rl_updates

    results = {}
    for mode in ("none", "full", "selective"):
        cfg = Config()
        cfg.trainer.activation_checkpoint = mode  # type: ignore[assignment]
        core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))
        batch, rows = _rl_batch()
        step = core.step_updates(rl_updates(batch, rows, cfg.trainer.rl), 3, prepare=proximal_fn(cfg.trainer.rl))
        results[mode] = (step.figures, dict(hf_tensors(core.model)))
    for mode in ("full", "selective"):
        figures, plain = results[mode][0], results["none"][0]
        assert figures.keys() == plain.keys()
        for k, v in plain.items():  # a few figures are histograms (tensors)
            assert torch.equal(figures[k], v) if isinstance(v, torch.Tensor) else figures[k] == v, (mode, k)
        for name, t in results["none"][1].items():
            assert torch.equal(results[mode][1][name], t), (mode, name)
