"""The memory planner (trainer/plan.py, `slipstream plan`): its parameter, gradient and optimizer bytes are the
real tensors' of a training core after a step; its activation bytes per AC mode are what a real forward keeps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.config import Config, ModelConfig
from common.runs.cli import main
from trainer.core import TrainingCore, cross_entropy_loss
from trainer.model import build_model, compile_blocks
from trainer.model.attention import fused_kernel_saves
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


def _kept_bytes(model: torch.nn.Module, tokens: torch.Tensor, dtype: torch.dtype = torch.float32) -> int:
    """tests/unit/test_recompute.py's measure: the net of the forward's allocations and frees, the loss included.
    Attention keeps what CUDA's fused kernels keep (`fused_kernel_saves`), as the planner counts it."""
    with fused_kernel_saves():
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
            with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                logits = model(tokens)
            # as trainer/core.py's loss: the logits are not held past the loss
            loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.reshape(-1))
            del logits
        loss.backward()
    return sum(e.self_cpu_memory_usage for e in prof.events())


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_planned_activations_are_what_a_forward_keeps(tiny_model, mode):
    mc = replace(tiny_model, max_seq_len=SEQ)
    model = build_model(mc, seed=0)  # fp32: the reference experts, as on a GPU (trainer/plan.py probe_backend)
    model.activation_checkpoint = mode
    tokens = torch.randint(0, mc.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    measured = _kept_bytes(model, tokens)
    planned = plan(_config(tiny_model, mode), 1, rows=ROWS).activations
    print(f"{mode}: planned {planned:.0f} measured {measured}")
    assert abs(planned - measured) <= 0.10 * measured, (planned, measured)


@pytest.mark.slow  # inductor compiles the probe's and the model's blocks on the CPU: about 2.5 minutes cold
@pytest.mark.timeout(600)
def test_planned_activations_of_compiled_blocks_are_what_a_compiled_forward_keeps(tiny_model):
    """trainer.compile: the probe's blocks are compiled as the trainer compiles them (inductor, here on the CPU);
    they keep less than eager ones (under selective, the policy sees no fused kernel), and the plan follows them."""
    mc = replace(tiny_model, max_seq_len=SEQ)
    model = compile_blocks(build_model(mc, "grouped_mm", seed=0))
    for m in model.moe_layers():  # the per-step copy a training step makes
        m.experts.weight_copy(torch.bfloat16)
    tokens = torch.randint(0, mc.vocab_size, (ROWS, SEQ), generator=torch.Generator().manual_seed(1))
    for mode in ("selective",):  # its plan runs the none probe too (the backward's recomputed block)
        model.activation_checkpoint = mode
        _kept_bytes(model, tokens, torch.bfloat16)  # compiles
        measured = _kept_bytes(model, tokens, torch.bfloat16)
        cfg = _config(tiny_model, mode)
        cfg.trainer.dtype = "bfloat16"
        eager = plan(cfg, 1, rows=ROWS).activations
        cfg.trainer.compile = True
        planned = plan(cfg, 1, rows=ROWS).activations
        print(f"{mode}: planned {planned:.0f} measured {measured} eager plan {eager}")
        assert planned < 0.8 * eager
        assert abs(planned - measured) <= 0.05 * measured, (mode, planned, measured)


def test_planned_weight_copy_is_the_copy_a_bf16_step_makes(tiny_model):
    """Under bf16 the grouped GEMMs read a per-step bf16 copy of the expert masters (trainer/model/moe.py): the
    plan's row is its bytes after a training step on the CPU (the copy is made on the CPU as on a GPU)."""
    cfg = _config(tiny_model)
    cfg.trainer.dtype = "bfloat16"
    core = TrainingCore(cfg, Ranks.single(torch.device("cpu")), build_model(cfg.trainer.model, "grouped_mm", seed=0))
    x = torch.randint(0, tiny_model.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(0))
    core.step({"tokens": x[:, :-1], "targets": x[:, 1:]}, cross_entropy_loss(ROWS * SEQ), 1, tokens=ROWS * SEQ)
    copies = [t for m in core.model.moe_layers() for t in m.experts.weight_copy(torch.bfloat16)]
    assert all(t.dtype == torch.bfloat16 for t in copies)
    measured = _tensor_bytes(copies)
    assert plan(cfg, 1, rows=ROWS).weight_copy == measured > 0
    cfg.trainer.experts.backend = "reference"  # casts per call: no copy, the casts are activations
    assert plan(cfg, 1, rows=ROWS).weight_copy == 0


def _attention_operands(seq: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(2)
    q, k = (torch.randn(2, 4, seq, 24, generator=g, requires_grad=True) for _ in range(2))
    return q, k, torch.randn(2, 4, seq, 16, generator=g, requires_grad=True)


def _saved_bytes(fn) -> int:  # type: ignore[no-untyped-def]
    """Bytes of the distinct storages autograd saves while fn runs."""
    storages: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(storages.values())


@pytest.mark.parametrize("mode", ["none", "selective"])
def test_fused_kernel_saves_is_sdpa_keeping_o_of_tokens(mode):
    """The planner's stand-in for CUDA's fused attention: SDPA's results and gradients, keeping q, k, v, the output
    and fp32 statistics (O(tokens)) where the CPU's math path keeps the S x S probabilities."""
    from trainer.model.attention import attend
    from trainer.model.recompute import run_block

    class Attend(torch.nn.Module):
        def forward(self, q, k, v):  # type: ignore[no-untyped-def]
            return attend(q, k, v, None, 0.2) * 1.5

    seq = 64
    ref = _attention_operands(seq)
    out = run_block(Attend(), mode, *ref)
    out.square().sum().backward()
    ops = _attention_operands(seq)
    with fused_kernel_saves():
        got = run_block(Attend(), mode, *ops)
        got.square().sum().backward()
    torch.testing.assert_close(got, out, rtol=1e-6, atol=1e-6)
    for a, b in zip(ops, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    if mode == "none":
        q, k, v = _attention_operands(seq)
        with fused_kernel_saves():
            fused = _saved_bytes(lambda: attend(q, k, v, None, 0.2))
        # q, k, v (the operands themselves), the output [2, 4, S, 16] and one fp32 per query and head
        assert fused == 4 * (q.numel() + k.numel() + v.numel() + v.numel() + 2 * 4 * seq)
        assert _saved_bytes(lambda: attend(q, k, v, None, 0.2)) > 4 * 2 * 4 * seq * seq  # the math path's probabilities


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
