"""FSDP2 of the dense weights (trainer.parallel.dp_shard, trainer/fsdp.py) over real processes (gloo, spawn)
against the single-rank run: pretraining steps at W = 2 (dp_shard 2) and W = 4 (dp_shard 2 x ep 2) make
W = 1's losses and weights; the per-rank bytes of the dense weights and their optimizer state halve, measured
from the tensors, and trainer/plan.py counts them; a packed RL step at (2 x 2) is one rank's padded step, and
its checkpoint resumes at W = 1 and at (1 x 2) with the same next-step loss."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from common.config import Config, ConfigError, ModelConfig
from common.config.validation import validate
from tests.unit.test_ep_dist import _spawn
from trainer.checkpoint import TrainState
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


def _worker(rank: int, world: int, out: str, tiny: ModelConfig, ep: int, dp_shard: int) -> None:
    cfg = _config(tiny, ep, dp_shard)
    core = TrainingCore(cfg, _ranks(rank, world), build_model(tiny, seed=0))
    losses, norms = _train(core, tiny.vocab_size)
    result = {"losses": losses, "norms": norms, "part": core.hf_part(), "dense_bytes": _dense_state_bytes(core)}
    torch.save(result, f"{out}/rank{rank}.pt")


def _ranks(rank: int, world: int) -> Ranks:
    """This spawned process's place among the gloo ranks that tests/unit/test_ep_dist.py's `_entry` formed."""
    return Ranks(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), dist.group.WORLD)


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
        and trainer/plan.py's dense bytes per rank are the ones measured. Each rank's part of a published version
    (`hf_part`) holds the dense tensors it owns, gathered from their shards, and its experts: together exactly
    W = 1's tensors, each once, no rank writing more than 0.6x of the dense bytes."""
    _spawn(tmp_path, world, _worker, str(tmp_path), tiny_model, ep, dp_shard)
    one = _one_rank(tiny_model)
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    merged = {name: t for p in parts for name, t in p["part"].items()}
    assert merged.keys() == one["part"].keys()
    # Each tensor is written by one rank, and the dense tensors are spread: none writes the whole dense part.
    assert sum(len(p["part"]) for p in parts) == len(merged)
    routed = ".mlp.experts."
    dense_total = sum(t.numel() * t.element_size() for n, t in one["part"].items() if routed not in n)
    written = [sum(t.numel() * t.element_size() for n, t in p["part"].items() if routed not in n) for p in parts]
    print(f"dense bytes written per rank {written} of {dense_total}")
    assert max(written) <= 0.6 * dense_total
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


def _next_loss(core: TrainingCore) -> float:
    """The loss of a pretraining step on a fixed batch: a function of the weights the step begins with."""
    batch = _batch(STEPS, core.cfg.trainer.model.vocab_size)
    n = int((batch["targets"] >= 0).sum())
    return core.step(batch, cross_entropy_loss(n), rows_per_forward=2, tokens=n).figures["loss"]


def _rl_core(ranks: Ranks, ep: int, dp_shard: int, seed: int = 0) -> TrainingCore:
    from tests.unit.test_pack import _rl_config

    cfg = _rl_config("seq-mean-token-mean", 2, True)  # 2 mini-batches, routing replay, both mask corrections
    cfg.trainer.parallel.ep, cfg.trainer.parallel.dp_shard = ep, dp_shard
    return TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=seed))


def _rl_step_and_checkpoint_worker(rank: int, world: int, out: str) -> None:
    """At (dp_shard 2 x ep 2): a packed RL step, a checkpoint, then the next step's loss."""
    from tests.unit.test_pack import rl_step

    core = _rl_core(_ranks(rank, world), 2, 2)
    _, result, _ = rl_step(core.cfg, packed=True, world=world, core=core)
    part = {name: t.clone() for name, t in core.hf_part().items()}  # the next step writes the masters
    core.save(Path(out) / "ckpt", TrainState(step=1))
    torch.save({"part": part, "figures": result.figures, "next": _next_loss(core)}, f"{out}/rank{rank}.pt")


def _resume_worker(rank: int, world: int, out: str, ep: int) -> None:
    core = _rl_core(_ranks(rank, world), ep, 1, seed=1)  # other weights: the load must replace them all
    state = core.resume(Path(out) / "ckpt")
    assert state is not None and state.step == 1
    Path(out, f"resumed{world}-{rank}.txt").write_text(repr(_next_loss(core)))


def test_a_packed_rl_step_at_2x2_is_the_padded_one_rank_step_and_its_checkpoint_resumes_at_1_and_at_ep_2(tmp_path):
    """(dp_shard 2 x ep 2, real gloo processes): one RL step of decoupled PPO (2 mini-batches, packed rows
    dealt by token count, routing replay) makes one rank's padded step: the same figures (1e-5 relative) and
    weights (test_core's EP_STEP_BOUND, and within 1e-5); its DCP checkpoint then loads at W = 1 and at
    (dp_shard 1 x ep 2) into other weights, and the next step's loss is the (2 x 2) run's own."""
    from tests.unit.test_core import EP_STEP_BOUND, worst_relative_difference
    from tests.unit.test_pack import rl_step

    world = 4
    _spawn(tmp_path, world, _rl_step_and_checkpoint_worker, str(tmp_path))
    parts = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    core = _rl_core(Ranks.single(torch.device("cpu")), 1, 1)
    start = {name: t.clone() for name, t in hf_tensors(core.model)}
    _, one, _ = rl_step(core.cfg, packed=False, core=core)
    for k in ("loss", "pg_loss", "tokens", "seq_masked_fraction", "routing_compared"):
        a, b = one.figures[k], parts[0]["figures"][k]
        assert abs(a - b) <= 1e-5 * max(abs(a), 1e-3), (k, a, b)
    bias = "e_score_correction_bias"  # follows the load, which counts padding (test_pack says why)
    mesh = {k: v for p in parts for k, v in p["part"].items() if not k.endswith(bias)}
    one_rank = {k: v for k, v in hf_tensors(core.model) if not k.endswith(bias)}
    worst, difference = worst_relative_difference(mesh, one_rank, start)
    largest = max(float((mesh[k] - v).abs().max()) for k, v in one_rank.items())
    print(f"(2 x 2) packed against 1 rank padded: largest weight difference {largest:.3g}")
    assert difference <= EP_STEP_BOUND and largest < 1e-5, worst  # measured: 1.9e-5 relative, 6.4e-6 absolute

    expected = parts[0]["next"]
    resumed = _rl_core(Ranks.single(torch.device("cpu")), 1, 1, seed=1)
    assert resumed.resume(tmp_path / "ckpt").step == 1
    losses = {"W=1": _next_loss(resumed)}
    _spawn(tmp_path, 2, _resume_worker, str(tmp_path), 2)
    losses |= {f"ep 2 rank {r}": float((tmp_path / f"resumed2-{r}.txt").read_text()) for r in range(2)}
    print(f"next-step loss at (2 x 2) {expected!r}; resumed {losses}")
    for where, loss in losses.items():
        assert loss == expected, where  # the same weights in the same forward: bitwise (measured)
