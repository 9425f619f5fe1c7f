"""Expert parallelism over real processes (gloo, spawn, world sizes 2 and 4) against the single-rank run.

Every rank builds the same model from one seed, runs the single-rank reference on the whole batch
in-process, and runs its shard of the batch through the expert-parallel copy. What is bitwise and why:
the owners' grouped GEMMs see exactly the single-rank matrices (same rows, same order), so expert
outputs, the combine and the expert weight gradients are bitwise. Dense (replicated) gradients are sums
over tokens that EP splits into per-rank partial sums plus an all-reduce, a different floating-point
summation order: they agree within 1e-6, not bitwise. On a GPU one more test runs the CUDA transports
(symmetric memory, NCCL point-to-point) in an NCCL group of one."""

import os
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from common.config import Config, ModelConfig
from trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint
from trainer.ep import ProcessGroupTransport, ShardedExperts, apply_expert_parallel
from trainer.experts import BACKENDS
from trainer.model import build_model
from trainer.optim import Optimizer

BATCH, SEQ = 4, 12


def _config(model: ModelConfig) -> Config:
    """The run config of these tests: the tiny model, with a bias update the steps can see."""
    cfg = Config()
    cfg.trainer.model = model
    cfg.trainer.optim.bias_update_rate = 0.01
    return cfg


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))


def _entry(rank: int, world: int, store: str, fn, args: tuple) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        fn(rank, world, *args)
        # Every rank finishes before any tears its connections down: a gloo peer that vanishes while
        # the other still holds the pair can abort it ("terminate called without an active exception").
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Even after the barrier, destroying the group aborted one rank of four once in CI (2026-12-04, the EP=4
    # resume): a rank that passed its checks leaves without running gloo's destructors at all.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _spawn(tmp_path: Path, world: int, fn, *args) -> None:
    mp.spawn(_entry, args=(world, str(tmp_path / f"store{world}"), fn, args), nprocs=world, join=True)


def _loss(model: torch.nn.Module, batch: torch.Tensor, n_global: int) -> torch.Tensor:
    """Summed next-token loss over `batch`, normalised by the global target count (sum over ranks = mean)."""
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum") / n_global


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _capture_expert_outputs(model: torch.nn.Module, store: list[torch.Tensor]) -> None:
    """Record each expert backend's output (the owner's expert-major rows) by wrapping the backend."""
    for m in model.modules():
        if isinstance(m, ShardedExperts) or type(m).__name__ == "Experts":
            inner = BACKENDS[m.backend]
            name = f"capture_{id(store)}_{m.backend}"

            def capturing(x, offsets, gate_up, down, inner=inner):
                y = inner(x, offsets, gate_up, down)
                store.append(y.detach().clone())
                return y

            BACKENDS[name] = capturing
            m.backend = name


def _train_step_worker(rank: int, world: int, out_dir: str, tiny: ModelConfig) -> None:
    cfg = _config(tiny)
    mc = cfg.trainer.model
    ref = build_model(mc, seed=0)
    model = build_model(mc, seed=0)
    ep = apply_expert_parallel(model, ProcessGroupTransport())
    ref_experts: list[torch.Tensor] = []
    ep_experts: list[torch.Tensor] = []
    _capture_expert_outputs(ref, ref_experts)
    _capture_expert_outputs(model, ep_experts)
    ref_moe_out: list[torch.Tensor] = []
    ep_moe_out: list[torch.Tensor] = []
    for m, store in ((ref, ref_moe_out), (model, ep_moe_out)):
        for layer in m.moe_layers():
            layer.register_forward_hook(lambda mod, inp, out, store=store: store.append(out.detach().clone()))
    ref_opt, opt = Optimizer(ref, cfg.trainer.optim), Optimizer(model, cfg.trainer.optim, ep)

    batch = _batch(0)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    n_global = batch[:, 1:].numel()
    ref_loss = _loss(ref, batch, n_global)
    loss = _loss(model, batch[mine], n_global)
    # Forward: the MoE outputs (expert results combined per token) of this rank's tokens are bitwise.
    for a, b in zip(ref_moe_out, ep_moe_out, strict=True):
        assert torch.equal(a[mine], b)
    # Expert outputs: the owner's rows are exactly the single-rank rows of its experts, in the same order.
    El = mc.n_routed_experts // world
    for layer, (ref_y, y) in enumerate(zip(ref_experts, ep_experts, strict=True)):
        plan = model.moe_layers()[layer].experts.last_plan
        counts = plan.counts.sum(0)
        start = int(counts[: rank * El].sum())
        assert y.shape[0] == plan.rows_in
        assert torch.equal(ref_y[start : start + plan.rows_in], y)
    ref_loss.backward()
    loss.backward()
    # Backward: expert weight gradients stay on their owner and are bitwise; dense ones are partial
    # sums here, whose all-reduce (done by the optimizer step below) gives the single-rank gradient.
    dense_diff = 0.0
    named = dict(model.named_parameters())
    for name, p in ref.named_parameters():
        q = named[name]
        if isinstance(q, DTensor):
            assert torch.equal(p.grad[rank * El : (rank + 1) * El], q.grad.to_local()), name
        else:
            summed = q.grad.clone()
            dist.all_reduce(summed)
            dense_diff = max(dense_diff, float((p.grad - summed).abs().max()))
    assert dense_diff <= 1e-6, dense_diff
    ref_stats, stats = ref_opt.step(n_global), opt.step(n_global)
    assert abs(ref_stats.grad_norm - stats.grad_norm) <= 1e-6 * ref_stats.grad_norm
    step_diff = 0.0
    for name, p in ref.named_parameters():
        step_diff = max(step_diff, float((p.detach() - _full(named[name].detach())).abs().max()))
    assert step_diff <= 1e-6, step_diff
    for a, b in zip(ref.moe_layers(), model.moe_layers(), strict=True):
        assert torch.equal(a.gate.e_score_correction_bias, b.gate.e_score_correction_bias)
        assert a.gate.e_score_correction_bias.abs().sum() > 0
    if rank == 0:
        Path(out_dir, f"world{world}.txt").write_text(
            f"world {world}: loss {float(ref_loss.detach()):.9g}, dense grad max diff {dense_diff:.3g}, grad norm "
            f"{ref_stats.grad_norm:.9g} vs {stats.grad_norm:.9g}, param max diff after one step {step_diff:.3g}\n"
        )


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 4])
def test_forward_backward_and_step_match_the_single_rank_run(tmp_path, world, tiny_model):
    _spawn(tmp_path, world, _train_step_worker, str(tmp_path), tiny_model)
    print((tmp_path / f"world{world}.txt").read_text())


def _skewed_routing_worker(rank: int, world: int, tiny: ModelConfig) -> None:
    mc = replace(tiny, num_experts_per_tok=1)
    H = mc.hidden_size
    ref, model = build_model(mc, seed=0), build_model(mc, seed=0)
    for m in ref.moe_layers() + model.moe_layers():
        m.gate.e_score_correction_bias[0] = 100.0  # every token picks expert 0, owned by rank 0
    transport = ProcessGroupTransport()
    apply_expert_parallel(model, transport)
    assert transport.allocated_bytes == 0
    batch = _batch(0)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    tokens_total, tokens_here = BATCH * SEQ, BATCH * SEQ // world
    ref_out = ref.hidden_states(batch[:, :-1])
    out = model.hidden_states(batch[mine, :-1])
    assert torch.equal(ref_out[mine], out)  # nothing dropped: every token got its expert's output
    for layer in model.moe_layers():
        plan = layer.experts.last_plan
        assert plan.rows_in == (tokens_total if rank == 0 else 0)
        assert plan.rows_out == tokens_here
    # Staging follows the counts: the owner of expert 0 holds exactly all rows, the others nothing.
    assert transport.allocated_bytes == (tokens_total * H * 4 if rank == 0 else 0)
    ref_out.square().sum().backward()
    out.square().sum().backward()
    expert0 = ref.moe_layers()[0].experts.gate_up_proj.grad
    if rank == 0:
        assert torch.equal(model.moe_layers()[0].experts.gate_up_proj.grad.to_local()[0], expert0[0])
    # Balanced routing afterwards: rank 0 reuses its high-water buffer, the others grow to their need.
    for m in model.moe_layers():
        m.gate.e_score_correction_bias.zero_()
    with torch.no_grad():
        model.hidden_states(batch[mine, :-1])
    need = max(layer.experts.last_plan.rows_in for layer in model.moe_layers())
    assert need < tokens_total
    assert transport.allocated_bytes == (tokens_total if rank == 0 else need) * H * 4


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_skewed_routing_drops_nothing_and_buffers_follow_the_counts(tmp_path, tiny_model):
    _spawn(tmp_path, 4, _skewed_routing_worker, tiny_model)


def _params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: _full(p.detach()).clone() for name, p in model.named_parameters()}


def _ep_train(world: int, rank: int, cfg: Config, seed: int):
    model = build_model(cfg.trainer.model, seed=seed)
    ep = apply_expert_parallel(model, ProcessGroupTransport())
    return model, Optimizer(model, cfg.trainer.optim, ep)


def _step(model, opt, batch: torch.Tensor, rows: slice) -> None:
    _loss(model, batch[rows], batch[:, 1:].numel()).backward()
    opt.step(batch[:, 1:].numel())


def _save_at_ep2_worker(rank: int, world: int, root: str, tiny: ModelConfig) -> None:
    cfg = _config(tiny)
    model, opt = _ep_train(world, rank, cfg, seed=0)
    mine = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    _step(model, opt, _batch(0), mine)
    save_checkpoint(root, model, opt, TrainState(step=1, tokens=BATCH * SEQ), cfg)
    at_save = _params(model)
    _step(model, opt, _batch(1), mine)
    after = _params(model)  # full_tensor() is a collective: every rank gathers
    if rank == 0:
        torch.save({"at_save": at_save, "after": after}, Path(root) / "ep2.pt")


def _resume_worker(rank: int, world: int, root: str, tiny: ModelConfig) -> None:
    cfg = _config(tiny)
    model, opt = _ep_train(world, rank, cfg, seed=1)  # other weights: the load must replace them all
    state = load_checkpoint(Path(root) / "step_00000001", model, opt, cfg)
    assert state.step == 1
    saved = torch.load(Path(root) / "ep2.pt")
    for name, p in _params(model).items():
        assert torch.equal(p, saved["at_save"][name]), name
    _step(model, opt, _batch(1), slice(rank * BATCH // world, (rank + 1) * BATCH // world))
    diff = max(float((p - saved["after"][name]).abs().max()) for name, p in _params(model).items())
    assert diff <= 1e-6, diff
    if rank == 0:
        Path(root, f"resume{world}.txt").write_text(
            f"resumed at EP={world}: max param diff after one step {diff:.3g}\n"
        )


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_checkpoint_saved_at_ep2_resumes_at_ep1_and_ep4(tmp_path, tiny_model):
    root = tmp_path / "ckpt"
    _spawn(tmp_path, 2, _save_at_ep2_worker, str(root), tiny_model)
    saved = torch.load(root / "ep2.pt")
    # EP=1: the plain single-rank model and optimizer, no process group.
    cfg = _config(tiny_model)
    model = build_model(cfg.trainer.model, seed=1)
    opt = Optimizer(model, cfg.trainer.optim)
    load_checkpoint(root / "step_00000001", model, opt, cfg)
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), saved["at_save"][name]), name
    _step(model, opt, _batch(1), slice(None))
    diff1 = max(float((p.detach() - saved["after"][name]).abs().max()) for name, p in model.named_parameters())
    assert diff1 <= 1e-6, diff1
    print(f"resumed at EP=1: max param diff after one step {diff1:.3g}")
    # EP=4: every rank reads its quarter of the experts and of their AdamW moments.
    _spawn(tmp_path, 4, _resume_worker, str(root), tiny_model)
    print((root / "resume4.txt").read_text())


# One GPU, an NCCL group of one: rank 0 puts into its own symmetric buffers, so the symmetric-memory transport's
# real code path runs (allocation and rendezvous, one-sided puts through `get_buffer`, device barriers, the two
# alternating buffers, regrowth) without a second GPU. The gloo tests above cover the same checks for the
# point-to-point transport on CPU; this one is for the CUDA transports (run with `pytest --noconftest
# tests/unit/test_ep_dist.py -k one_gpu` on a GPU machine; it is skipped elsewhere).
GPU_CFG = {"hidden_size": 256, "moe_intermediate_size": 128, "n_routed_experts": 16}


def _gpu_roundtrip(transport, device: torch.device, rows: int) -> None:
    from trainer.ep import make_plan

    gen = torch.Generator().manual_seed(rows)
    counts = torch.multinomial(torch.rand(8, generator=gen), rows, replacement=True, generator=gen).bincount(
        minlength=8
    )
    plan = make_plan(transport.exchange_counts(counts.to(device)), transport.rank, device)
    x = torch.randn(rows, 64, device=device, dtype=torch.bfloat16)
    placed = transport.dispatch(x, plan)
    assert torch.equal(placed, torch.empty_like(placed).index_copy_(0, plan.recv_index, x)), rows
    assert torch.equal(transport.combine(placed, plan), x), rows


def _gpu_layer(transport, device: torch.device, dtype: torch.dtype, backend: str) -> None:
    import copy

    cfg = ModelConfig(**GPU_CFG, num_experts_per_tok=4)
    ref = build_model(cfg, backend, seed=0, device=device).moe_layers()[0]
    ep_layer = copy.deepcopy(ref)
    apply_expert_parallel(ep_layer, transport)
    gen = torch.Generator(device=device).manual_seed(1)
    x = torch.randn(8, 512, cfg.hidden_size, device=device, generator=gen).to(dtype)
    g = torch.randn(8, 512, cfg.hidden_size, device=device, generator=gen)
    outs, grads = [], []
    for layer in (ref, ep_layer):
        xi = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
            out = layer(xi)
        (out.float() * g).sum().backward()
        outs.append(out.detach())
        ex = layer.experts
        grads.append([xi.grad, layer.gate.weight.grad, _local(ex.gate_up_proj.grad), _local(ex.down_proj.grad)])
    assert torch.equal(outs[0], outs[1]), (type(transport).__name__, backend)
    for a, b in zip(grads[0], grads[1], strict=True):
        assert torch.equal(a, b), (type(transport).__name__, backend)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _gpu_skew(transport, device: torch.device) -> None:
    import copy

    cfg = ModelConfig(**GPU_CFG, num_experts_per_tok=1)
    ref = build_model(cfg, "reference", seed=0, device=device).moe_layers()[0]
    ref.gate.e_score_correction_bias[0] = 100.0  # every token to expert 0
    ep_layer = copy.deepcopy(ref)
    apply_expert_parallel(ep_layer, transport)
    before = transport.allocated_bytes
    x = torch.randn(4, 8192, cfg.hidden_size, device=device)  # 32768 rows: more than any earlier check
    assert torch.equal(ref(x), ep_layer(x))  # nothing dropped
    assert ep_layer.experts.last_plan.rows_in == 32768
    # Two data buffers of exactly the rows, plus the counts: grown to the need, no more.
    expected = 2 * 32768 * cfg.hidden_size * 4 + transport.world * cfg.n_routed_experts * 8
    assert transport.allocated_bytes == expected > before


def _gpu_model_step_and_checkpoint(transport, device: torch.device, backend: str, root: Path) -> None:
    from trainer.optim import autocast

    cfg = Config()
    cfg.trainer.dtype = "bfloat16"
    cfg.trainer.model = ModelConfig(
        **GPU_CFG, num_layers=3, intermediate_size=512, num_experts_per_tok=4, kv_lora_rank=64, max_seq_len=256
    )
    mc, oc = cfg.trainer.model, cfg.trainer.optim
    ref, model = build_model(mc, backend, seed=0, device=device), build_model(mc, backend, seed=0, device=device)
    ep = apply_expert_parallel(model, transport)
    ref_opt, opt = Optimizer(ref, oc), Optimizer(model, oc, ep)
    tokens = torch.randint(0, mc.vocab_size, (4, 257), device=device, generator=torch.Generator(device).manual_seed(0))
    logits, norms = [], []
    for m, o in ((ref, ref_opt), (model, opt)):
        with autocast(device, "bfloat16"):
            out = m(tokens[:, :-1])
        F.cross_entropy(out.float().reshape(-1, mc.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        logits.append(out.detach())
        norms.append(o.step(tokens[:, 1:].numel()).grad_norm)
    assert torch.equal(logits[0], logits[1])
    assert abs(norms[0] - norms[1]) <= 1e-5 * norms[0]
    full = {n: _full(p.detach()) for n, p in model.named_parameters()}
    assert max(float((p.detach() - full[n]).abs().max()) for n, p in ref.named_parameters()) <= 1e-4
    # The EP model's DCP checkpoint (DTensor experts) loads into a plain model: weights and AdamW moments bitwise.
    path = save_checkpoint(root, model, opt, TrainState(step=1), cfg)
    fresh = build_model(mc, backend, seed=1, device=device)
    fresh_opt = Optimizer(fresh, oc)
    load_checkpoint(path, fresh, fresh_opt, cfg)
    named = dict(model.named_parameters())
    for n, p in fresh.named_parameters():
        assert torch.equal(p.detach(), full[n]), n
        assert torch.equal(fresh_opt.adamw.state[p]["exp_avg_sq"], _full(opt.adamw.state[named[n]]["exp_avg_sq"])), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CUDA transports need a GPU")
@pytest.mark.timeout(300)
def test_cuda_transports_on_one_gpu_give_the_plain_model_bitwise(tmp_path, monkeypatch):
    """Symmetric-memory and NCCL point-to-point transports on one GPU: round trips on random counts place rows at
    the plan's offsets and give them back (the symmetric buffers grow, then are reused); an MoE layer's output and
    input, router and expert gradients equal the plain layer's bit for bit (reference fp32, grouped_mm bf16); a
    skewed routing drops nothing and grows the buffers to exactly the counts; a whole model's logits and optimizer
    step match the plain model, and its checkpoint loads into the plain model."""
    from trainer.ep import SymmetricMemoryTransport
    from trainer.experts import select_backend

    for key in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")  # NVLink multicast stays off
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, device_id=device)
    try:
        symm, p2p = SymmetricMemoryTransport(), ProcessGroupTransport()
        for transport in (symm, p2p):
            for rows in (1000, 5000, 300):  # growth, then reuse
                _gpu_roundtrip(transport, device, rows)
        grouped = select_backend("grouped_mm", device, torch.bfloat16)
        _gpu_layer(symm, device, torch.float32, "reference")
        _gpu_layer(symm, device, torch.bfloat16, grouped)
        _gpu_layer(p2p, device, torch.bfloat16, grouped)
        _gpu_skew(symm, device)
        for name, transport in (("symm", symm), ("p2p", p2p)):
            _gpu_model_step_and_checkpoint(transport, device, grouped, tmp_path / name)
    finally:
        dist.destroy_process_group()


# The two-GPU step (issue 31, item 4). bf16 autocast on a GPU sums in other orders than fp32 on the CPU, so the
# CPU tests' bound (test_core.py EP_STEP_BOUND, 20x above fp32 order noise) cannot be carried over as a number;
# its derivation can: the noise is measured in the same run as one GPU against itself in an equivalent order
# (the step's rows in two micro-batches instead of one), and two GPUs must stay within 20x of it, as on the CPU.
ORDER_NOISE_FACTOR = 20


def _two_gpu_step_worker(rank: int, world: int, transport: str, out_dir: str, device_type: str) -> None:
    """Rank `rank` of 2: the same 2 training steps through trainer/core.py at EP = 2 and, on this rank's device,
    at W = 1 twice (rows in one and in two micro-batches); rank 0 writes each run's losses, grad norms and
    final weights (the EP run's gathered from both ranks)."""
    from tests.unit.test_core import worst_relative_difference
    from trainer.core import TrainingCore, cross_entropy_loss
    from trainer.experts import select_backend
    from trainer.hf import hf_tensors
    from trainer.ranks import RankInfo, Ranks

    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    cfg = Config()
    cfg.trainer.dtype = "bfloat16" if device_type == "cuda" else "float32"
    cfg.trainer.model = ModelConfig(
        **GPU_CFG, num_layers=3, intermediate_size=512, num_experts_per_tok=4, kv_lora_rank=64, max_seq_len=256
    )
    cfg.trainer.parallel.ep, cfg.trainer.parallel.transport = 2, transport
    one = replace(cfg, trainer=replace(cfg.trainer, parallel=replace(cfg.trainer.parallel, ep=1)))
    mc = cfg.trainer.model
    backend = select_backend("grouped_mm" if device_type == "cuda" else "auto", device, torch.bfloat16)
    group = Ranks(RankInfo(rank, world, rank, "test"), device, dist.group.WORLD)
    ep = TrainingCore(cfg, group, build_model(mc, backend, seed=0, device=device))
    whole = TrainingCore(one, Ranks.single(device), build_model(mc, backend, seed=0, device=device))
    halves = TrainingCore(one, Ranks.single(device), build_model(mc, backend, seed=0, device=device))
    start = {n: t.detach().cpu().clone() for n, t in hf_tensors(whole.model)}
    rows, seq = 8, 128
    runs: dict[str, list[tuple[float, float]]] = {"ep": [], "whole": [], "halves": []}
    for step in range(2):
        x = torch.randint(0, mc.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(step))
        batch, loss = {"tokens": x[:, :-1], "targets": x[:, 1:]}, cross_entropy_loss(rows * seq)
        for name, core, per_forward in (("ep", ep, rows), ("whole", whole, rows), ("halves", halves, rows // 2)):
            r = core.step(batch, loss, per_forward, tokens=rows * seq)
            runs[name].append((r.figures["loss"], r.optim.grad_norm))
    two: dict[str, torch.Tensor] = {}
    for part in group.all_gather(ep.hf_part()):
        two |= part
    if rank == 0:
        weights = {
            name: {n: t.detach().cpu() for n, t in hf_tensors(c.model)}
            for name, c in (("whole", whole), ("halves", halves))
        }
        _, noise = worst_relative_difference(weights["halves"], weights["whole"], start)
        worst, difference = worst_relative_difference(two, weights["whole"], start)
        Path(out_dir, f"{transport}.txt").write_text(
            f"{transport}: weights {difference:.3g} ({worst}) against order noise {noise:.3g} (bound "
            f"{ORDER_NOISE_FACTOR}x); per step (loss, grad norm) EP=2 {runs['ep']}, one GPU {runs['whole']}, "
            f"one GPU in halves {runs['halves']}\n"
        )
        assert 0 < noise and difference <= ORDER_NOISE_FACTOR * noise, (difference, noise, worst)
        for (l2, g2), (l1, g1), (lh, gh) in zip(runs["ep"], runs["whole"], runs["halves"], strict=True):
            assert abs(l2 - l1) <= ORDER_NOISE_FACTOR * max(abs(lh - l1), 1e-7 * abs(l1)), (l2, l1, lh)
            assert abs(g2 - g1) <= ORDER_NOISE_FACTOR * max(abs(gh - g1), 1e-7 * g1), (g2, g1, gh)


def _two_gpu_entry(rank: int, world: int, store: str, transport: str, out_dir: str, device_type: str) -> None:
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device_type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        _two_gpu_step_worker(rank, world, transport, out_dir, device_type)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (nvidia-h200-x2)")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("transport", ["p2p", "symm_mem"])
def test_two_gpus_at_ep2_make_the_one_gpu_steps(tmp_path, monkeypatch, transport):
    """Two training steps through trainer/core.py on two GPUs (EP = 2, NCCL, bf16 autocast, grouped_mm experts)
    against the same steps on one GPU: losses, gradient norms and the weights after the optimizer steps agree
    within 20x of one GPU's own summation-order noise, measured in the same run (ORDER_NOISE_FACTOR)."""
    for key in ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "NCCL_NVLS_ENABLE", "NVSHMEM_DISABLE_NVLS"):
        monkeypatch.setenv(key, "0" if key == "NCCL_NVLS_ENABLE" else "1")  # NVLink multicast stays off
    mp.spawn(_two_gpu_entry, args=(2, str(tmp_path / "store"), transport, str(tmp_path), "cuda"), nprocs=2, join=True)
    print((tmp_path / f"{transport}.txt").read_text())
