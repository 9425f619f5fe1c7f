"""The memory planner (trainer/plan.py, `slipstream plan`): its parameter, gradient and optimizer bytes are the
real tensors' of a training core after a step; its activation bytes per AC mode are what a real forward keeps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.config import Config, ModelConfig
from common.runs.cli import main
from trainer.core import TrainingCore, cross_entropy_loss
from trainer.model import build_model
from trainer.plan import PlanError, plan, state_bytes
from trainer.ranks import Ranks

ROWS, SEQ = 4, 24


def _config(model: ModelConfig, mode: str = "none", ep: int = 1) -> Config:
    cfg = Config()
    cfg.trainer.model = replace(model, max_seq_len=SEQ)
    cfg.trainer.activation_checkpoint = mode  # type: ignore[assignment]
    cfg.trainer.parallel.ep = ep
    return cfg


def _tensor_bytes(ts) -> int:  # type: ignore[no-untyped-def]
    seen: dict[int, int] = {}
    for t in ts:
        t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_state_bytes_are_the_training_cores_tensors_after_a_step(tiny_model):
    cfg = _config(tiny_model)
    core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, seed=0))
    x = torch.randint(0, tiny_model.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    core.step({"tokens": x[:, :-1], "targets": x[:, 1:]}, cross_entropy_loss(ROWS * SEQ), 1, tokens=ROWS * SEQ)
    params = _tensor_bytes([*core.model.parameters(), *core.model.buffers()])
    # the step freed its gradients (zero_grad to None): a backward of the next micro-batch makes them again
    cross_entropy_loss(ROWS * SEQ)(core.model, {"tokens": x[:, 1:], "targets": x[:, :-1]}).loss.backward()
    grads = _tensor_bytes([p.grad for p in core.model.parameters() if p.grad is not None])
    states = [
        v
        for opt in core.optimizer.optimizers
        for st in opt.state.values()
        for v in st.values()
        if isinstance(v, torch.Tensor) and v.numel() > 1
    ]
    moments = _tensor_bytes(states)
    dense, experts, planned_grads, planned_opt = state_bytes(cfg)
    print(f"params {params} vs {dense + experts}, grads {grads} vs {planned_grads}, optim {moments} vs {planned_opt}")
    assert abs(dense + experts - params) <= 0.05 * params
    assert abs(planned_grads - grads) <= 0.05 * grads
    assert abs(planned_opt - moments) <= 0.05 * moments


def _kept_bytes(model: torch.nn.Module, tokens: torch.Tensor) -> int:
    """tests/unit/test_recompute.py's measure: the net of the forward's allocations and frees, the loss included."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        # as trainer/core.py's loss: the logits are not held past the loss
        loss = torch.nn.functional.cross_entropy(model(tokens).float().flatten(0, 1), tokens.reshape(-1))
    loss.backward()
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_planned_activations_are_what_a_forward_keeps(tiny_model, mode):
    mc = replace(tiny_model, max_seq_len=SEQ)
    model = build_model(mc, seed=0)
    model.activation_checkpoint = mode
    tokens = torch.randint(0, mc.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    measured = _kept_bytes(model, tokens)
    planned = plan(_config(tiny_model, mode), 1, rows=ROWS).activations
    print(f"{mode}: planned {planned:.0f} measured {measured}")
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)


def test_bad_requests_name_the_input_and_the_fix(tiny_model, capsys):
    cfg = _config(tiny_model, ep=3)
    with pytest.raises(PlanError, match="--gpus 4"):
        plan(cfg, 4)
    with pytest.raises(PlanError, match="--gpus 0"):
        plan(cfg, 0)
    assert main(["plan", "configs/moonlet.toml", "--gpus", "1", "--gpu-memory", "-1"]) == 2
    assert "--gpu-memory" in capsys.readouterr().err
    assert main(["plan", "/nonexistent.toml", "--gpus", "1"]) == 2
    assert "nonexistent" in capsys.readouterr().err


def _ep_worker(rank: int, world: int, store: str, out: str, tiny: ModelConfig) -> None:
    import os
    import sys

    import torch.distributed as dist

    from trainer.ranks import RankInfo

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        ranks = Ranks(RankInfo(rank, world, rank, "test"), torch.device("cpu"), dist.group.WORLD)
        cfg = _config(tiny, ep=world)
        core = TrainingCore(cfg, ranks, build_model(cfg.trainer.model, seed=0))
        x = torch.randint(0, tiny.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
        core.step({"tokens": x[:, :-1], "targets": x[:, 1:]}, cross_entropy_loss(ROWS * SEQ), 1, tokens=ROWS * SEQ)
        params = _tensor_bytes([*core.model.parameters(), *core.model.buffers()])
        moments = _tensor_bytes(
            [
                v
                for opt in core.optimizer.optimizers
                for st in opt.state.values()
                for v in st.values()
                if isinstance(v, torch.Tensor) and v.numel() > 1
            ]
        )
        torch.save({"params": params, "moments": moments}, f"{out}/{rank}.pt")
        dist.barrier()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        os._exit(0)  # tests/unit/test_ep_dist.py: gloo's destructors abort a rank now and then


@pytest.mark.timeout(120)
def test_state_bytes_under_expert_parallelism(tmp_path, tiny_model):
    """EP = 2 over gloo (real processes): each rank's weights and moments are what the plan gives one rank."""
    import torch.multiprocessing as mp

    mp.spawn(_ep_worker, args=(2, str(tmp_path / "store"), str(tmp_path), tiny_model), nprocs=2, join=True)
    dense, experts, _, opt = state_bytes(_config(tiny_model, ep=2), ep=2)
    for r in range(2):
        got = torch.load(tmp_path / f"{r}.pt")
        print(f"rank {r}: params {got['params']} vs {dense + experts}, optim {got['moments']} vs {opt}")
        assert abs(dense + experts - got["params"]) <= 0.05 * got["params"]
        assert abs(opt - got["moments"]) <= 0.05 * got["moments"]
