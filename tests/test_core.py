"""The training core's pure parts and its one-rank behaviour: how a global batch is split over ranks and
micro-batches, how statistics are reduced, how ranks are read from the environment, which ranks count
as dead, and config refusals (kl_coef without a reference, an EP size that does not divide)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from common.config import Config, ConfigError, ModelConfig, load_config
from trainer.core import TrainingCore, cross_entropy_loss, rank_rows, reduce_figures, split_rows
from trainer.model import build_model
from trainer.ranks import RankError, RankInfo, Ranks, dead_ranks, rank_info


def test_rank_rows_cover_every_row_once_in_order_with_the_extra_rows_first():
    for n in range(1, 30):
        for world in range(1, 6):
            parts = [rank_rows(n, world, r) for r in range(world)]
            assert [i for p in parts for i in range(n)[p]] == list(range(n))
            sizes = [p.stop - p.start for p in parts]
            assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert split_rows(2, 3)[2] == slice(2, 2)


def test_figures_sum_except_max_and_min():
    got = reduce_figures([{"loss": 1.0, "ratio_max": 2.0, "ratio_min": 0.5}, {"loss": 2.0, "ratio_max": 3.0,
                                                                               "ratio_min": 0.7}])  # fmt: skip
    assert got == {"loss": 3.0, "ratio_max": 3.0, "ratio_min": 0.5}


class _Fake(Ranks):
    """A rank of a W-rank group for the batch split only (no process group: the split needs none)."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), None)


def _core(cfg: Config) -> TrainingCore:
    return TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))


def test_every_rank_gets_the_same_number_of_non_empty_micro_batches_and_all_rows_once():
    core = _core(Config())
    batch = {"x": torch.arange(15)}
    for world in (1, 2, 3, 4):
        seen = []
        counts = set()
        for rank in range(world):
            core.ranks = _Fake(rank, world)
            micro = core.my_micro_batches(batch, rows_per_forward=2)
            counts.add(len(micro))
            assert all(len(mb["x"]) > 0 for mb in micro)
            seen += [int(v) for mb in micro for v in mb["x"]]
        assert len(counts) == 1 and seen == list(range(15))
    core.ranks = _Fake(0, 4)
    with pytest.raises(ValueError, match="at least 4 rows"):
        core.my_micro_batches({"x": torch.arange(3)}, 1)


def test_micro_batching_does_not_change_the_step():
    """Gradient accumulation over micro-batches gives the one-forward update (global normalisation)."""
    tokens = torch.randint(0, 128, (8, 17), generator=torch.Generator().manual_seed(0))
    batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
    weights = []
    for per_forward in (8, 3):
        core = _core(Config())
        result = core.step(batch, cross_entropy_loss(8 * 16), per_forward, tokens=8 * 16)
        assert result.optim.step == 1
        weights.append(torch.cat([p.detach().flatten() for p in core.model.parameters()]))
    # Adam's first step is about lr * sign(g): summation order can only move elements whose gradient is ~0.
    assert float((weights[0] - weights[1]).norm() / weights[0].norm()) < 1e-6


def test_torchrun_variables_win_and_incomplete_ones_are_refused():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1",
           "SLIPSTREAM_REPLICAS": "4", "SLIPSTREAM_REPLICA": "3"}  # fmt: skip
    assert rank_info(env) == RankInfo(1, 2, 1, "torchrun")
    assert rank_info({"SLIPSTREAM_REPLICAS": "4", "SLIPSTREAM_REPLICA": "3"}) == RankInfo(3, 4, 3, "launcher")
    assert rank_info({}) == RankInfo()
    with pytest.raises(RankError, match="MASTER_ADDR"):
        rank_info({"RANK": "0", "WORLD_SIZE": "2"})
    with pytest.raises(RankError, match="outside a world"):
        rank_info({"SLIPSTREAM_REPLICAS": "2", "SLIPSTREAM_REPLICA": "2"})


def test_a_rank_is_dead_when_its_process_is_gone_on_this_host_or_its_heartbeat_elsewhere():
    import socket

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    here = socket.gethostname()
    records = {
        0: {"host": here, "pid": os.getpid()},
        1: {"host": here, "pid": gone.pid},
        2: {"host": "elsewhere", "pid": 1},
        3: {"host": "elsewhere", "pid": 1},
        4: {"host": here, "pid": gone.pid, "state": "done"},
    }
    alive = {0: False, 1: True, 2: False, 3: True}
    assert [r for r, _ in dead_ranks(records, alive, me=0)] == [1, 2]


def test_kl_without_a_reference_policy_and_an_ep_that_does_not_divide_are_refused():
    with pytest.raises(ConfigError, match="kl_coef"):
        load_config(None, ["trainer.rl.kl_coef=0.1"])
    with pytest.raises(ConfigError, match="trainer.parallel.ep = 3"):
        load_config(None, ["trainer.parallel.ep=3"])


def test_an_ep_size_that_does_not_divide_the_ranks_is_refused_naming_both():
    from trainer.core import build_plan

    model = build_model(ModelConfig(), seed=0)
    with pytest.raises(ValueError, match="does not divide the trainer's 3 ranks"):
        build_plan(model, _Fake(0, 3), ep=2, transport="auto")


def test_the_rl_step_on_the_core_is_the_decoupled_ppo_update_of_the_whole_batch():
    """Proximal log-probs of every micro-batch first (no grad, eval mode), then the PPO loss of each
    micro-batch normalised by the batch's token count, one optimizer step: written out by hand here."""
    import copy

    from trainer.loop import rl_loss_fns
    from trainer.optim import Optimizer
    from trainer.rl.loss import ppo_loss

    cfg = Config()
    by_hand = build_model(cfg.trainer.model, seed=0)
    on_core = copy.deepcopy(by_hand)
    g = torch.Generator().manual_seed(1)
    N, L = 40, 12
    tokens, targets = torch.randint(0, 128, (N, L), generator=g), torch.randint(0, 128, (N, L), generator=g)
    targets[:, :5] = -1
    mask = (targets >= 0).float()
    behaviour, adv = -torch.rand(N, L, generator=g) * 3 * mask, torch.randn(N, generator=g)
    rl, total, mb = cfg.trainer.rl, float(mask.sum()), cfg.trainer.rl.micro_batch_samples
    chunks = [slice(i, i + mb) for i in range(0, N, mb)]
    with torch.no_grad():
        by_hand.eval()
        proximal = torch.cat([by_hand.token_logprobs(tokens[c], targets[c]) for c in chunks])
    by_hand.train()
    for c in chunks:
        logp = by_hand.token_logprobs(tokens[c], targets[c])
        ppo_loss(logp, proximal[c], behaviour[c], adv[c], mask[c], rl, total=total).loss.backward()
    Optimizer(by_hand, cfg.trainer.optim).step(int(total))

    core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), on_core)
    prepare, loss_fn = rl_loss_fns(rl, total)
    batch = {"tokens": tokens, "targets": targets, "behaviour": behaviour, "mask": mask, "advantages": adv,
             "fresh": torch.zeros(N), "step_tokens": torch.full((N,), total)}  # fmt: skip
    core.step(batch, loss_fn, mb, tokens=int(total), prepare=prepare)
    a = torch.cat([p.detach().flatten() for p in by_hand.parameters()])
    b = torch.cat([p.detach().flatten() for p in on_core.parameters()])
    start = torch.cat([p.detach().flatten() for p in build_model(cfg.trainer.model, seed=0).parameters()])
    assert float((a - start).norm()) > 0.1  # it moved
    assert float((a - b).norm() / (a - start).norm()) < 1e-3
