"""Optimizer step: parameter groups, WSD schedule in tokens, clipping, accumulation, bias-rate decay."""

import numpy as np
import pytest
import torch

from common.config import Config, ModelConfig, OptimConfig
from trainer.model import build_model
from trainer.optim import Optimizer, group_of
from trainer.pretrain import PretrainData, Pretrainer
from trainer.schedule import WSD


def test_every_parameter_is_in_exactly_one_group_with_its_learning_rate():
    model = build_model(ModelConfig(), seed=0)
    opt = Optimizer(model, OptimConfig(lr=1.0, router_lr=2.0, expert_lr=3.0))
    seen = {}
    for grp in opt.adamw.param_groups:
        for p in grp["params"]:
            assert id(p) not in seen
            seen[id(p)] = grp
    names = dict(model.named_parameters())
    assert len(seen) == len(names)
    lr_of = {name: seen[id(p)]["peak_lr"] for name, p in names.items()}
    assert lr_of["model.layers.1.mlp.gate.weight"] == 2.0
    assert lr_of["model.layers.1.mlp.experts.gate_up_proj"] == 3.0
    assert lr_of["model.layers.1.mlp.shared_experts.up_proj.weight"] == 1.0
    assert group_of("model.layers.0.mlp.gate_proj.weight") == "dense"


def test_wsd_warms_up_holds_and_decays_by_tokens():
    s = WSD(warmup_tokens=100, decay_tokens=200, total_tokens=1000, min_lr_ratio=0.1)
    assert s.lr_factor(50) == 0.5
    assert s.lr_factor(100) == 1.0 and s.lr_factor(800) == 1.0
    assert s.lr_factor(900) == pytest.approx(0.55)
    assert s.lr_factor(1000) == pytest.approx(0.1) and s.lr_factor(5000) == pytest.approx(0.1)
    assert WSD().lr_factor(10**9) == 1.0


def test_wsd_rejects_phases_longer_than_the_run():
    with pytest.raises(ValueError, match="exceed"):
        WSD.from_config(OptimConfig(warmup_tokens=600, decay_tokens=600, total_tokens=1000))


def test_bias_rate_falls_to_zero_over_the_decay():
    model = build_model(ModelConfig(), seed=0)
    cfg = OptimConfig(bias_update_rate=0.01, decay_tokens=100, total_tokens=200)
    opt = Optimizer(model, cfg)
    assert opt.bias_rate(50) == 0.01 and opt.bias_rate(150) == pytest.approx(0.005) and opt.bias_rate(200) == 0
    cfg.bias_update_decay = False
    assert Optimizer(model, cfg).bias_rate(200) == 0.01


def test_step_clips_the_global_gradient_norm():
    model = torch.nn.Linear(4, 4, bias=False)
    opt = Optimizer(model, OptimConfig(grad_clip=0.5, lr=0.0))
    model.weight.grad = torch.full((4, 4), 1.0)
    clipped = []
    real_step = opt.adamw.step
    opt.adamw.step = lambda: (clipped.append(model.weight.grad.norm().item()), real_step())
    stats = opt.step(tokens=10)
    assert stats.grad_norm == pytest.approx(4.0)
    assert clipped[0] == pytest.approx(0.5, rel=1e-5)


def test_accumulating_two_halves_equals_one_full_batch(tmp_path):
    """Same rows as one batch of 4 or two micro-batches of 2: same loss and gradient norm (Adam alone
    would hide a wrong loss scale, so the gradient norm is what is compared)."""
    np.save(tmp_path / "tokens.npy", np.random.default_rng(0).integers(0, 128, 2000))

    def first_step(accum: int, batch: int):
        cfg = Config()
        cfg.trainer.optim.grad_accum = accum
        cfg.trainer.optim.grad_clip = 0.0
        trainer = Pretrainer(cfg, PretrainData(str(tmp_path / "tokens.npy"), 16, batch), tmp_path / f"r{accum}")
        return trainer.train_step()

    (loss_full, full), (loss_acc, acc) = first_step(1, 4), first_step(2, 2)
    assert loss_acc == pytest.approx(loss_full, rel=1e-6)
    assert acc.grad_norm == pytest.approx(full.grad_norm, rel=1e-5)
    assert acc.tokens == full.tokens == 64


def test_muon_takes_the_blocks_dense_matrices_and_adamw_the_rest():
    from trainer.optim import is_muon_matrix

    cfg = Config()
    cfg.trainer.optim.muon = True
    model = build_model(cfg.trainer.model, seed=0)
    opt = Optimizer(model, cfg.trainer.optim)
    adamw_ids = {id(p) for g in opt.adamw.param_groups for p in g["params"]}
    muon_ids = {id(p) for g in opt.optimizers[1].param_groups for p in g["params"]}
    names = {id(p): n for n, p in model.named_parameters()}
    assert not adamw_ids & muon_ids and adamw_ids | muon_ids == set(names)
    on_muon = sorted(names[i] for i in muon_ids)
    assert "model.layers.0.self_attn.kv_b_proj.weight" in on_muon
    assert "model.layers.1.mlp.shared_experts.down_proj.weight" in on_muon
    assert all(is_muon_matrix(n, p) for n, p in model.named_parameters() if id(p) in muon_ids)
    assert not any(
        ("embed" in n or "lm_head" in n or ".gate." in n or "experts.gate_up" in n or "norm" in n) for n in on_muon
    )
    # A Muon step of a matrix is orthogonalised: its singular values are (nearly) all equal, AdamW's are not.
    w = model.model.layers[0].self_attn.o_proj.weight
    before = w.detach().clone()
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step(1)
    s = torch.linalg.svdvals(w.detach() - before)
    assert float(s.min() / s.max()) > 0.5
