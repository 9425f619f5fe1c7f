"""Single-GPU self-test of the RDEP transports on CUDA: rank 0 of a one-process NCCL group talks to
itself, so the symmetric-memory transport's real code path runs (allocation and rendezvous, one-sided
index-copy puts through `get_buffer`, device barriers, the two alternating buffers, regrowth), without
a second GPU. Checks, each against the plain model on the same GPU, all bitwise: a transport round trip
on random counts (dispatch places rows at the plan's offsets, combine returns them to their slots);
an MoE layer forward and backward (output, input, router and expert gradients) with the reference
backend in fp32 and the grouped_mm backend in bf16; a skewed routing (every token to expert 0) that
grows the buffers to exactly the counts. Also times a dispatch + combine round trip (a local copy
here, not NVLink). Prints a table; writes ep_selftest.json under $OUT when set.

    TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 python bench/ep_selftest.py
"""

from __future__ import annotations

import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from common.config import Config, ModelConfig  # noqa: E402
from trainer.checkpoint import TrainState, load_checkpoint, save_checkpoint  # noqa: E402
from trainer.ep import (  # noqa: E402
    ProcessGroupTransport,
    SymmetricMemoryTransport,
    Transport,
    apply_expert_parallel,
    make_plan,
)
from trainer.experts import select_backend  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.optim import Optimizer, autocast  # noqa: E402

RESULTS: list[dict] = []


def record(name: str, ok: bool, detail: str = "") -> None:
    RESULTS.append({"check": name, "ok": ok, "detail": detail})
    print(f"{'PASS' if ok else 'FAIL'}  {name}  {detail}", flush=True)


def roundtrip(transport: Transport, device: torch.device, rows: int, width: int, experts: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    weights = torch.rand(experts, generator=gen)
    counts = torch.multinomial(weights, rows, replacement=True, generator=gen).bincount(minlength=experts)
    plan = make_plan(transport.exchange_counts(counts.to(device)), transport.rank, device)
    x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
    placed = transport.dispatch(x, plan)
    expected = torch.empty_like(placed).index_copy_(0, plan.recv_index, x)
    back = transport.combine(placed, plan)
    ok = torch.equal(placed, expected) and torch.equal(back, x)
    record(f"{type(transport).__name__} round trip {rows} rows", ok, f"allocated {transport.allocated_bytes} B")


def moe_layer_check(transport: Transport, device: torch.device, dtype: torch.dtype, backend: str) -> None:
    cfg = ModelConfig(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=4)
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
        local = [p.to_local() if hasattr(p, "to_local") else p for p in (ex.gate_up_proj.grad, ex.down_proj.grad)]
        grads.append([xi.grad, layer.gate.weight.grad, *local])
    ok_out = torch.equal(outs[0], outs[1])
    ok_grad = all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))
    name = f"{type(transport).__name__} MoE layer {backend} {str(dtype).removeprefix('torch.')}"
    record(name, ok_out and ok_grad, f"output bitwise {ok_out}, input/router/expert grads bitwise {ok_grad}")


def skew_check(transport: SymmetricMemoryTransport, device: torch.device) -> None:
    cfg = ModelConfig(hidden_size=256, moe_intermediate_size=128, n_routed_experts=16, num_experts_per_tok=1)
    ref = build_model(cfg, "reference", seed=0, device=device).moe_layers()[0]
    ref.gate.e_score_correction_bias[0] = 100.0
    ep_layer = copy.deepcopy(ref)
    apply_expert_parallel(ep_layer, transport)
    before = transport.allocated_bytes
    x = torch.randn(4, 8192, cfg.hidden_size, device=device)  # 32768 rows: more than any earlier check
    same = torch.equal(ref(x), ep_layer(x))
    plan = ep_layer.experts.last_plan
    expected = 2 * 32768 * cfg.hidden_size * 4 + transport.world * cfg.n_routed_experts * 8  # 2 data + counts
    ok = same and plan.rows_in == 32768 and transport.allocated_bytes == expected and expected > before
    record("skewed routing grows symmetric buffers to the counts", ok, f"{before} -> {transport.allocated_bytes} B")


def train_step_check(transport: Transport, device: torch.device, dtype_name: str, backend: str, root: Path) -> None:
    """A whole model: forward logits, one Optimizer step over the parallel plan (fused AdamW on DTensor experts on
    the GPU) against the plain Optimizer, then a DCP checkpoint of the EP model loaded into a plain model."""
    cfg = Config()
    cfg.trainer.dtype = dtype_name
    cfg.trainer.model = ModelConfig(
        hidden_size=256,
        num_layers=3,
        intermediate_size=512,
        moe_intermediate_size=128,
        n_routed_experts=16,
        num_experts_per_tok=4,
        kv_lora_rank=64,
        max_seq_len=256,
    )
    mc, oc = cfg.trainer.model, cfg.trainer.optim
    ref, model = build_model(mc, backend, seed=0, device=device), build_model(mc, backend, seed=0, device=device)
    ep = apply_expert_parallel(model, transport)
    ref_opt, opt = Optimizer(ref, oc), Optimizer(model, oc, ep)
    tokens = torch.randint(0, mc.vocab_size, (4, 257), device=device, generator=torch.Generator(device).manual_seed(0))
    logits, norms = [], []
    for m, o in ((ref, ref_opt), (model, opt)):
        with autocast(device, dtype_name):
            out = m(tokens[:, :-1])
        F.cross_entropy(out.float().reshape(-1, mc.vocab_size), tokens[:, 1:].reshape(-1)).backward()
        logits.append(out.detach())
        norms.append(o.step(tokens[:, 1:].numel()).grad_norm)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach() for n, p in model.named_parameters()}
    diff = max(float((p.detach() - full[n]).abs().max()) for n, p in ref.named_parameters())
    same_logits = torch.equal(logits[0], logits[1])
    ok = same_logits and abs(norms[0] - norms[1]) <= 1e-5 * norms[0] and diff <= 1e-4
    record(
        f"{type(transport).__name__} model step {backend} {dtype_name}",
        ok,
        f"logits bitwise {same_logits}, grad norm {norms[0]:.7g} vs {norms[1]:.7g}, param max diff {diff:.3g}",
    )
    path = save_checkpoint(root, model, opt, TrainState(step=1), cfg)
    fresh = build_model(mc, backend, seed=1, device=device)
    fresh_opt = Optimizer(fresh, oc)
    load_checkpoint(path, fresh, fresh_opt, cfg)
    same_weights = all(torch.equal(p.detach(), full[n]) for n, p in fresh.named_parameters())
    moments = {n: fresh_opt.adamw.state[p]["exp_avg_sq"] for n, p in fresh.named_parameters()}
    ep_moments = {}
    for n, p in model.named_parameters():
        v = opt.adamw.state[p]["exp_avg_sq"]
        ep_moments[n] = v.full_tensor() if hasattr(v, "full_tensor") else v
    same_moments = all(torch.equal(moments[n], ep_moments[n]) for n in moments)
    record(
        f"{type(transport).__name__} DCP checkpoint of the EP model loads into the plain model",
        same_weights and same_moments,
        f"weights bitwise {same_weights}, AdamW moments bitwise {same_moments}",
    )


def time_roundtrip(transport: Transport, device: torch.device, rows: int, width: int, experts: int) -> dict:
    counts = torch.full((experts,), rows // experts, dtype=torch.int64)
    plan = make_plan(transport.exchange_counts(counts.to(device)), transport.rank, device)
    x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        transport.combine(transport.dispatch(x, plan), plan)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(20):
        start.record()
        transport.combine(transport.dispatch(x, plan), plan)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    ms = sorted(times)[len(times) // 2]
    moved = 2 * rows * width * 2  # bytes of rows out and back
    result = {
        "transport": type(transport).__name__,
        "rows": rows,
        "width": width,
        "median_ms": ms,
        "GB_per_s": moved / ms / 1e6,
    }
    print(f"time  {result}", flush=True)
    return result


def main() -> int:
    for key, value in (
        ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
        ("NCCL_NVLS_ENABLE", "0"),
        ("NVSHMEM_DISABLE_NVLS", "1"),
    ):
        if os.environ.get(key) != value:
            print(f"set {key}={value} before running (NVLink multicast must stay off)", file=sys.stderr)
            return 2
    import torch.distributed._symmetric_memory as symm_mem

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, python {sys.version.split()[0]}")
    print("symmetric memory API:", [n for n in dir(symm_mem) if not n.startswith("_")])
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29517", rank=0, world_size=1, device_id=device)
    timings = []
    try:
        symm = SymmetricMemoryTransport()
        p2p = ProcessGroupTransport()
        for transport in (symm, p2p):
            roundtrip(transport, device, 1000, 64, 8)
            roundtrip(transport, device, 5000, 64, 8)  # regrowth of the symmetric buffers
            roundtrip(transport, device, 300, 64, 8)  # reuse: no growth
        moe_layer_check(symm, device, torch.float32, "reference")
        moe_layer_check(symm, device, torch.bfloat16, select_backend("grouped_mm", device, torch.bfloat16))
        moe_layer_check(p2p, device, torch.bfloat16, select_backend("grouped_mm", device, torch.bfloat16))
        skew_check(symm, device)
        grouped = select_backend("grouped_mm", device, torch.bfloat16)
        train_step_check(symm, device, "bfloat16", grouped, Path(tempfile.mkdtemp()) / "ckpt")
        train_step_check(p2p, device, "bfloat16", grouped, Path(tempfile.mkdtemp()) / "ckpt")
        timings.append(time_roundtrip(symm, device, 65536, 2048, 64))
        timings.append(time_roundtrip(p2p, device, 65536, 2048, 64))
    except Exception as exc:  # report, then fail the run
        record("self-test raised", False, f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
    out = os.environ.get("OUT")
    if out:
        Path(out, "ep_selftest.json").write_text(
            json.dumps({"torch": torch.__version__, "time": time.time(), "results": RESULTS, "timings": timings})
        )
    failed = [r for r in RESULTS if not r["ok"]]
    print(f"{len(RESULTS) - len(failed)}/{len(RESULTS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
