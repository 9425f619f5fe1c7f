"""FSDP2 of the dense weights (trainer.parallel.dp_shard, trainer/fsdp.py) over real processes (gloo, spawn)
against the single-rank run: pretraining steps at W = 2 (dp_shard 2) and W = 4 (dp_shard 2 x ep 2) make
W = 1's losses and weights; the per-rank bytes of the dense weights and their optimizer state halve, measured
from the tensors, and trainer/plan.py counts them."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from common.config import Config, ConfigError, ModelConfig
from common.config.validation import validate
from trainer.core import TrainingCore, cross_entropy_loss
from trainer.fsdp import mesh_ranks, routed_expert_params
from trainer.hf import hf_tensors
from trainer.model import build_model
from trainer.plan import state_bytes
from trainer.ranks import RankInfo, Ranks

STEPS, ROWS, SEQ = 20, 8, 12
# Below every step's gradient norm (0.3-0.5 here), so every update is clipped by the global norm over the mesh.
CLIP = 0.2


def _config(model: ModelConfig, ep: int = 1, dp_shard: int = 1) -> Config:
    cfg = Config()
    cfg.trainer.model = model
    cfg.trainer.optim.lr = cfg.trainer.optim.expert_lr = cfg.trainer.optim.router_lr = 3e-3
    cfg.trainer.optim.bias_update_rate = 0.01
    cfg.trainer.optim.grad_clip = CLIP
    cfg.trainer.parallel.ep, cfg.trainer.parallel.dp_shard = ep, dp_shard
    return cfg


def _batch(step: int, vocab: int) -> dict[str, torch.Tensor]:
    seq = torch.randint(0, vocab, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    targets = seq[:, 1:].clone()
    targets[step % ROWS, -3:] = -1  # some untrained positions
    return {"tokens": seq[:, :-1], "targets": targets}


def _train(core: TrainingCore, vocab: int) -> tuple[list[float], list[float]]:
    """The losses and the gradient norms (before clipping) of STEPS steps."""
    losses, norms = [], []
    for step in range(STEPS):
        batch = _batch(step, vocab)
        n = int((batch["targets"] >= 0).sum())
        result = core.step(batch, cross_entropy_loss(n), rows_per_forward=2, tokens=n)
        losses.append(result.figures["loss"])
        norms.append(result.optim.grad_norm)
    return losses, norms


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def _dense_state_bytes(core: TrainingCore) -> int:
    """This rank's bytes of the dense parameters and their AdamW moments, from the tensors it holds."""
    routed = routed_expert_params(core.model)
    dense = [p for p in core.model.parameters() if p not in routed]
    state = core.optimizer.adamw.state
    moments = sum(_local_bytes(v) for p in dense for k, v in state[p].items() if k != "step")
    return sum(_local_bytes(p) for p in dense) + moments


def _worker(rank: int, world: int, store: str, out: str, tiny: ModelConfig, ep: int, dp_shard: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = _config(tiny, ep, dp_shard)
        ranks = Ranks(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), dist.group.WORLD)
        core = TrainingCore(cfg, ranks, build_model(tiny, seed=0))
        losses, norms = _train(core, tiny.vocab_size)
        result = {"losses": losses, "norms": norms, "part": core.hf_part(), "dense_bytes": _dense_state_bytes(core)}
        torch.save(result, f"{out}/rank{rank}.pt")
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    sys.stdout.flush()
    os._exit(0)  # past the barrier: see tests/unit/test_ep_dist.py's _entry


def _one_rank(tiny: ModelConfig) -> dict:
    cfg = _config(tiny)
    core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(tiny, seed=0))
    losses, norms = _train(core, tiny.vocab_size)
    return {"losses": losses, "norms": norms, "part": core.hf_part(), "dense_bytes": _dense_state_bytes(core)}


def test_the_mesh_puts_ep_innermost_and_shards_over_dp_shard():
    # 8 ranks = dp_replicate 2 x dp_shard 2 x ep 2: rank r is EP rank r % 2 of data-parallel index r // 2.
    ranks = mesh_ranks(8, ep=2, dp_shard=2)
    assert ranks.tolist() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert mesh_ranks(2, ep=1, dp_shard=2).tolist() == [[0, 1]]
    with pytest.raises(ValueError, match="dp_shard = 4 does not divide the trainer's 6 ranks"):
        mesh_ranks(6, ep=1, dp_shard=4)


def test_muon_is_refused_with_sharded_dense_weights_naming_why():
    cfg = Config()
    cfg.trainer.optim.muon = True
    cfg.trainer.parallel.dp_shard = 2
    with pytest.raises(ConfigError, match="muon orthogonalises whole matrices"):
        validate(cfg)


@pytest.mark.parametrize(("world", "ep", "dp_shard"), [(2, 1, 2), (4, 2, 2)])
def test_pretraining_on_a_sharded_mesh_makes_the_one_rank_steps(tmp_path, tiny_model, world, ep, dp_shard):
    """20 pretraining steps (2 micro-batches per rank, AdamW, clipping, the bias update) at W ranks with the
    dense weights FSDP2-sharded give W = 1's losses and gradient norms within 1e-5 relative and its final weights within 1e-5;
    each rank holds at most 0.55x of W = 1's dense parameter and optimizer bytes (0.5x plus dim-0 padding),
    and trainer/plan.py's dense bytes per rank are the ones measured."""
    mp.spawn(
        _worker, args=(world, str(tmp_path / "store"), str(tmp_path), tiny_model, ep, dp_shard), nprocs=world, join=True
    )
    one = _one_rank(tiny_model)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    merged = {name: t for p in parts for name, t in p["part"].items()}
    assert merged.keys() == one["part"].keys()
    assert min(one["norms"]) > CLIP
    for p in parts:
        for key in ("losses", "norms"):
            rel = max(abs(a - b) / abs(b) for a, b in zip(p[key], one[key], strict=True))
            assert rel < 1e-5, (key, p[key], one[key])
    worst = max(float((merged[n] - t).abs().max()) for n, t in one["part"].items())
    start = dict(hf_tensors(build_model(tiny_model, seed=0)))
    moved = min(float((t - start[n]).abs().max()) for n, t in one["part"].items())
    print(
        f"W={world} (ep {ep} x dp_shard {dp_shard}): losses {one['losses'][0]:.4f} -> {one['losses'][-1]:.4f}, "
        f"worst weight difference {worst:.3g} (every tensor moved at least {moved:.3g}); dense bytes per rank "
        f"{[p['dense_bytes'] for p in parts]} against {one['dense_bytes']}"
    )
    assert worst < 1e-5 and moved > 1e-3
    for p in parts:
        assert p["dense_bytes"] <= 0.55 * one["dense_bytes"]
    planned_dense, _, _, _ = state_bytes(_config(tiny_model), ep, dp_shard)
    buffers = sum(b.numel() * b.element_size() for b in build_model(tiny_model, seed=0).buffers())
    measured_params = max(p["dense_bytes"] for p in parts) / 3  # parameters + two moments of the same size
    assert abs((planned_dense - buffers) - measured_params) <= 0.05 * measured_params
