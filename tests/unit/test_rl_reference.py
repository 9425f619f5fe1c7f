"""The frozen reference policy through a trainer rank's own handlers (trainer/commands.py): started from the
policy, refreshed every reference_refresh_steps, checkpointed and resumed exactly, loaded from a checkpoint
path; the KL term keeping the policy nearer its reference; grad_accum in the RL step."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from common.config import Config
from trainer.commands import RLStep, StartRL, TrainerRank
from trainer.core import TrainingCore
from trainer.model import build_model
from trainer.ranks import Ranks
from trainer.rl.update import mini_batch_rows, rl_step_figures


def _rank(cfg: Config, seed: int = 0, ranks: Ranks | None = None) -> TrainerRank:
    """A TrainerRank on the CPU (one rank unless `ranks`) with only what its training handlers read (no run
    context)."""
    rank = object.__new__(TrainerRank)
    rank.cfg, rank.device = cfg, torch.device("cpu")
    ranks = ranks or Ranks.single(rank.device)
    rank.core = TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=seed))
    rank.keep_companions()
    return rank


def _cfg(**rl: object) -> Config:
    cfg = Config()
    for k, v in rl.items():
        setattr(cfg.trainer.rl, k, v)
    cfg.trainer.check()
    return cfg


def _batch(seed: int = 3) -> tuple[dict[str, torch.Tensor], list[slice]]:
    """An RL step of 4 groups of 4 samples with fixed random tokens and advantages, one mini-batch."""
    g = torch.Generator().manual_seed(seed)
    N, L = 16, 10
    tokens, targets = torch.randint(0, 128, (N, L), generator=g), torch.randint(0, 128, (N, L), generator=g)
    targets[:, :4] = -1
    targets[::3, -2:] = -1
    mask = (targets >= 0).float()
    batch = {
        "tokens": tokens,
        "targets": targets,
        "behaviour": -torch.rand(N, L, generator=g) * 3 * mask,
        "mask": mask,
        "advantages": torch.randn(N, generator=g),
        "fresh": torch.zeros(N),
        "step_tokens": torch.full((N,), float(mask.sum())),
        # Half the rows sampled at temperature 0.8 with top-p 0.95: the reference takes their distribution too.
        "temperature": torch.tensor([1.0, 0.8] * (N // 2)),
        "top_k": torch.zeros(N, dtype=torch.long),
        "top_p": torch.tensor([1.0, 0.95] * (N // 2)),
    }
    return batch, mini_batch_rows([4] * 4, 1)


def _step(rank: TrainerRank, step: int, seed: int = 3) -> dict[str, float]:
    batch, rows = _batch(seed)
    return rl_step_figures(rank.rl_step(RLStep(batch, rows, step)))


def _weights(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_no_reference_is_kept_unless_the_kl_is_trained_or_logged():
    assert _rank(_cfg()).reference is None
    rank = _rank(_cfg(log_kl=True))
    assert rank.reference is not None and "reference" in rank.core.companions
    ref = rank.reference.model
    assert not ref.training and all(not p.requires_grad for p in ref.parameters())
    assert torch.equal(_weights(ref), _weights(rank.core.model))


def test_the_reference_starts_as_the_policy_and_a_refresh_makes_the_next_first_pass_kl_zero():
    """Step 0 against the reference made from the policy: KL 0 (one mini-batch: every micro-batch runs before
    the update). Step 1: the policy moved, KL > 0. Step 2 refreshes (every 2 steps) before its first pass:
    KL 0 again; step 3 does not: KL > 0."""
    rank = _rank(_cfg(kl_coef=0.1, reference_refresh_steps=2))
    rank.start_rl(StartRL())
    kls = [_step(rank, step) for step in range(4)]
    print("kl_k3 per step:", [f"{f['kl_k3']:.3g}" for f in kls])
    for f in (kls[0], kls[2]):
        assert abs(f["kl_k3"]) < 1e-9 and abs(f["kl_k1"]) < 1e-6
    assert kls[1]["kl_k3"] > 1e-4 and kls[3]["kl_k3"] > 1e-4


def test_a_resumed_run_has_exactly_the_reference_it_saved(tmp_path):
    """Two steps, a checkpoint, a third step; a new rank (its reference made from other weights) resumed
    from the checkpoint makes the same third step: the same loss and KL, bitwise, and the same weights."""
    from trainer.checkpoint import CheckpointMismatch, TrainState

    cfg = _cfg(kl_coef=0.2)
    first = _rank(cfg)
    first.start_rl(StartRL())
    _step(first, 0, seed=3)
    _step(first, 1, seed=4)
    first.core.save(tmp_path, TrainState(step=2))
    want = _step(first, 2, seed=5)
    again = _rank(cfg, seed=9)
    assert again.core.resume(tmp_path) is not None
    got = _step(again, 2, seed=5)
    assert want["kl"] > 1e-4
    for k in ("loss", "pg_loss", "kl", "kl_k1", "kl_k3"):
        assert got[k] == want[k], k
    assert torch.equal(_weights(again.core.model), _weights(first.core.model))
    # A run that keeps a reference refuses a checkpoint without one, naming it.
    plain = _rank(_cfg())
    plain.core.save(tmp_path / "plain", TrainState(step=1))
    logging_rank = _rank(_cfg(log_kl=True))
    try:
        logging_rank.core.resume(tmp_path / "plain")
    except CheckpointMismatch as exc:
        assert "holds no reference model" in str(exc)
    else:
        raise AssertionError("a checkpoint without the reference was accepted")


def _resume_on_ranks(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from trainer.checkpoint import TrainState
    from trainer.ranks import RankInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        cfg = _cfg(kl_coef=0.2, reference_refresh_steps=3)
        cfg.trainer.parallel.ep = world

        def ranks() -> Ranks:
            return Ranks(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), dist.group.WORLD)

        first = _rank(cfg, ranks=ranks())
        first.start_rl(StartRL())
        figures = [_step(first, 0, seed=3), _step(first, 1, seed=4)]
        first.core.save(Path(out) / "ckpt", TrainState(step=2))
        figures += [_step(first, 2, seed=5), _step(first, 3, seed=6)]
        again = _rank(cfg, seed=9, ranks=ranks())
        assert again.core.resume(Path(out) / "ckpt") is not None
        resumed = [_step(again, 2, seed=5), _step(again, 3, seed=6)]
        torch.save({"figures": figures, "resumed": resumed}, f"{out}/rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_on_two_expert_parallel_ranks_the_reference_refreshes_and_resumes_as_on_one(tmp_path):
    """EP = 2 (gloo processes), each rank's reference holding its experts: four steps with a refresh at step 3
    give one rank's KL figures (within 1e-5), and two ranks resumed from the checkpoint after step 1 make
    steps 2 and 3 bitwise as the run that went on."""
    import torch.multiprocessing as mp

    mp.spawn(_resume_on_ranks, args=(2, str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    got = torch.load(tmp_path / "rank0.pt")
    one = _rank(_cfg(kl_coef=0.2, reference_refresh_steps=3))
    one.start_rl(StartRL())
    want = [_step(one, step, seed=3 + step) for step in range(4)]
    for step, (two, single) in enumerate(zip(got["figures"], want, strict=True)):
        print(f"step {step}: kl_k3 2 ranks {two['kl_k3']:.9g}, 1 rank {single['kl_k3']:.9g}")
        for k in ("loss", "kl", "kl_k1", "kl_k3"):
            assert abs(two[k] - single[k]) <= 1e-5 * max(1.0, abs(single[k])), (step, k)
    assert got["figures"][3]["kl_k3"] < 1e-9 < got["figures"][2]["kl_k3"]  # refreshed before step 3
    for went_on, resumed in zip(got["figures"][2:], got["resumed"], strict=True):
        for k in ("loss", "kl", "kl_k1", "kl_k3"):
            assert resumed[k] == went_on[k], k


@pytest.mark.parametrize("kind", ["checkpoint", "hf"])
def test_the_reference_loads_from_a_checkpoint_or_hf_path(tmp_path, kind):
    """trainer.rl.reference = one of our checkpoints or an HF directory: the reference holds its weights, not
    the policy's."""
    from trainer.checkpoint import TrainState
    from trainer.hf import export_hf

    other = _rank(_cfg(), seed=5)
    if kind == "checkpoint":
        path = other.core.save(tmp_path, TrainState(step=0))
    else:
        path = export_hf(other.core.model, tmp_path / "hf")
    rank = _rank(_cfg(kl_coef=0.1, reference=str(path)))
    rank.start_rl(StartRL())
    assert torch.equal(_weights(rank.reference.model), _weights(other.core.model))
    assert not torch.equal(_weights(rank.reference.model), _weights(rank.core.model))
    with pytest.raises(FileNotFoundError, match="trainer.rl.reference"):
        _rank(_cfg(kl_coef=0.1, reference=str(tmp_path / "nothing"))).start_rl(StartRL())


def test_the_kl_term_keeps_the_policy_nearer_its_reference():
    """The same fixed batches trained for several steps without (kl_coef = 0) and with a KL term, the KL
    logged in both (log_kl): with the term, the KL to the reference at each later step is lower."""
    runs = {}
    for coef in (0.0, 1.0):
        rank = _rank(_cfg(kl_coef=coef, log_kl=True, kl_estimator="k2"))
        rank.start_rl(StartRL())
        runs[coef] = [_step(rank, step, seed=3 + step % 2)["kl_k3"] for step in range(6)]
    for coef, kls in runs.items():
        print(f"kl_coef {coef}: KL (k3) to the reference per step", " ".join(f"{v:.4g}" for v in kls))
    assert runs[0.0][0] == runs[1.0][0] == 0.0
    assert all(with_kl < without for with_kl, without in zip(runs[1.0][2:], runs[0.0][2:], strict=True))


def test_grad_accum_cuts_each_update_into_more_micro_batches_and_gives_the_same_update():
    """grad_accum = 3 with micro_batch_samples large enough for one forward: 3 times the forwards of
    grad_accum = 1 (the first pass and the update each), the same weights after the step up to float order."""
    weights, forwards = [], [0, 0]
    for i, accum in enumerate((1, 3)):
        cfg = _cfg(kl_coef=0.1, micro_batch_samples=64)
        cfg.trainer.optim.grad_accum = accum
        rank = _rank(cfg)
        rank.start_rl(StartRL())
        rank.core.model.register_forward_hook(lambda *_, i=i: forwards.__setitem__(i, forwards[i] + 1))
        _step(rank, 0)
        weights.append(_weights(rank.core.model))
    start = _weights(build_model(Config().trainer.model, seed=0))
    assert forwards == [2, 6]
    assert float((weights[0] - weights[1]).norm() / (weights[0] - start).norm()) < 1e-4


@pytest.fixture
def rendezvous(tmp_path):
    from common.config import RendezvousConfig
    from common.rendezvous import Rendezvous

    rz = Rendezvous(tmp_path / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    yield rz
    rz.close()


@pytest.mark.timeout(180)
def test_the_rl_trainer_starts_the_reference_after_the_warm_start_and_keeps_it_over_a_resume(rendezvous, tmp_path):
    """The in-process RL trainer (against the fake router of test_gen_metrics) with log_kl: the reference is the
    policy after the warm start (step 0's KL is exactly 0; the warm start moved the weights, so a reference
    made from the initial weights would give more), it is checkpointed, and the trainer restarted after a
    crash at step 2 resumes with it and logs the KL of every step."""
    from common.metrics import step_series
    from rollout.flow.runtime import Group
    from tests.unit.test_gen_metrics import context, rl_config, trainer_world
    from trainer.rl.driver import RLTrainer

    class Crash(RuntimeError):
        pass

    class CrashingTrainer(RLTrainer):
        def train_step(self, step: int, groups: list[Group], dropped_groups: int) -> None:
            if step == 2:
                raise Crash
            super().train_step(step, groups, dropped_groups)

    cfg = rl_config(tmp_path)
    # The fake router's completions all score 0: keep their groups so that every step trains (and logs).
    for key, value in (("log_kl", True), ("filter_zero_variance", False), ("reward_clip", [-1.0, 1.0])):
        setattr(cfg.trainer.rl, key, value)
    cfg.trainer.warmup.steps, cfg.trainer.warmup.batch_size = 2, 4
    run_dir = tmp_path / "run"
    ctx = context(cfg, rendezvous, run_dir)
    with trainer_world(rendezvous) as (io_loop, router, _):
        rendezvous.connect().set(ctx.keys.router(cfg.router.name), router.url)
        lost = CrashingTrainer(ctx, io_loop, Ranks.single(torch.device("cpu")))
        start = _weights(lost.core.model)
        with pytest.raises(Crash):
            lost.run()
        assert lost.reference is not None
        assert not torch.equal(start, _weights(lost.reference.model))  # the warm start's weights, not the initial
        lost.metrics.close()
        asyncio.run_coroutine_threadsafe(lost.publisher.close(), io_loop).result(10)
        again = RLTrainer(ctx, io_loop, Ranks.single(torch.device("cpu")))
        assert again.run() == 0
    series = step_series(run_dir, ["loss/kl", "loss/kl_k1", "loss/kl_k3"], role="trainer")
    print("loss/kl_k3 per step:", series["loss/kl_k3"])
    assert sorted(series["loss/kl_k3"]) == [0, 1, 2]
    assert series["loss/kl_k3"][0] == 0.0 and series["loss/kl_k1"][0] == 0.0
