"""RDEP scaling on two GPUs: moonlet's training step through trainer/core.py (compiled, bf16 autocast over fp32
masters, the trainer's own optimizer) at EP = 1 on one GPU and EP = 2 on two, with both transports, then a
128-expert MoE layer alone at EP = 2, in one command, one table.

    python bench/ep_scaling.py [--rows 4] [--seq 4096] [--steps 10]          # on nvidia-h200-x2
    python bench/ep_scaling.py --device cpu --tiny --steps 2                  # the plumbing, here (figures mean nothing)

Rows (each configuration in its own processes, one per GPU, NCCL; gloo on the CPU):
- EP = 1, one GPU, `rows` rows: the weak-scaling baseline (same rows per GPU as EP = 2).
- EP = 1, one GPU, 2 x `rows` rows: the strong-scaling baseline (the same global batch as EP = 2).
- EP = 2, two GPUs, `rows` rows each, transport p2p (NCCL point-to-point) and symm_mem (NVLink symmetric memory).
Per row: step time (median of the measured steps, the slowest rank, CUDA-synchronised), tokens/s over all GPUs,
MFU of 989 TFLOP/s per GPU (6 x active parameters + causal attention per token, as bench/moe_bench.py counts),
weak-scaling efficiency (tokens/s / (GPUs x the one-GPU rows' tokens/s)) and strong-scaling speedup, and the
step's exchange: the bytes this rank sent to the other GPU in dispatches and combines (forward and backward),
the time spent inside the transport's dispatch/combine calls (CUDA events around each call), and their rate
against the 350 GB/s point-to-point figure measured on this machine (issue 31). Time inside a call includes
waiting for the slower peer, so the rate is a lower bound on the link's.
The layer row: one MoE layer H2048 I768 E128 top-8, 16,384 tokens per GPU, fwd+bwd, EP = 2, both transports;
its dispatch + combine bytes and rate the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import Config, ModelConfig, load_config  # noqa: E402
from trainer.core import TrainingCore, cross_entropy_loss  # noqa: E402
from trainer.ep.transport import Transport  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.model.transformer import attention_flops_per_token, count_params  # noqa: E402
from trainer.ranks import RankInfo, Ranks  # noqa: E402

H200_PEAK = 989e12
NVLINK_P2P_GBS = 350.0  # issue 31: torch.distributed point-to-point, 1 GB, two H200s of nvidia-h200-x2
WARMUP = 3
LAYER_SHAPE = (2048, 768, 128, 8, 16384)  # hidden, expert intermediate, experts, top-k, tokens per GPU
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_layers": 2,
    "first_k_dense": 1,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "num_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 16,
    "v_head_dim": 16,
    "max_seq_len": 512,
}
TINY_LAYER = (64, 32, 8, 2, 256)


@dataclass
class Exchange:
    """What one rank's transport moved and how long it spent doing so."""

    calls: int = 0
    bytes_sent: int = 0
    seconds: float = 0.0
    _events: list = field(default_factory=list)

    def watch(self, transport: Transport, rank: int, device: torch.device) -> None:
        """Wrap the transport's dispatch and combine: count the bytes sent to other ranks, time each call."""
        for name in ("dispatch", "combine"):
            inner = getattr(transport, name)

            def timed(rows, plan, inner=inner, name=name):
                sent = plan.send_splits if name == "dispatch" else plan.recv_splits
                self.bytes_sent += (sum(sent) - sent[rank]) * rows[0].numel() * rows.element_size()
                self.calls += 1
                if device.type != "cuda":
                    t0 = time.perf_counter()
                    out = inner(rows, plan)
                    self.seconds += time.perf_counter() - t0
                    return out
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                out = inner(rows, plan)
                end.record()
                self._events.append((start, end))
                return out

            setattr(transport, name, timed)

    def reset(self) -> None:
        self.calls, self.bytes_sent, self.seconds, self._events = 0, 0, 0.0, []

    def settle(self) -> None:
        """Add the recorded CUDA events' times (after a synchronize)."""
        self.seconds += sum(s.elapsed_time(e) for s, e in self._events) / 1e3
        self._events = []


@dataclass
class Row:
    name: str
    gpus: int
    rows_per_gpu: int
    transport: str
    step_s: float
    tokens_per_s: float
    mfu: float
    exchange_mb: float = 0.0
    """Bytes rank 0 sent to the other GPU per step (dispatch + combine, forward + backward)."""
    exchange_s: float = 0.0
    """Seconds rank 0 spent inside dispatch/combine per step."""
    peak_gib: float = math.nan
    loss: float = math.nan


def model_config(args: argparse.Namespace) -> ModelConfig:
    if args.tiny:
        return ModelConfig(**TINY)
    return replace(load_config(args.config).trainer.model, max_seq_len=args.seq)


def flops_per_token(mc: ModelConfig, seq: int) -> float:
    return 6 * count_params(mc)[1] + attention_flops_per_token(mc, seq)


def _ranks(rank: int, world: int, device: torch.device, store: str) -> Ranks:
    if device.type == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    if world == 1:
        return Ranks.single(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, device_id=None)
    return Ranks(RankInfo(rank, world, rank, "bench"), device, dist.group.WORLD)


def _leave(ranks: Ranks) -> None:
    """Every rank done before any tears its group down; gloo peers then leave without their destructors, which
    abort a rank now and then when the other side is already gone (tests/unit/test_ep_dist.py says the same)."""
    ranks.barrier()
    if ranks.world > 1 and ranks.device.type == "cpu":
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _model_rows(rank: int, world: int, args: argparse.Namespace, rows: int, transport: str, out: str) -> None:
    """One configuration of the trainer's step on this rank; rank 0 writes the Row to `out`."""
    device = torch.device(args.device)
    torch.manual_seed(0)
    ranks = _ranks(rank, world, device, out + ".store")
    try:
        mc = model_config(args)
        cfg = Config()
        cfg.trainer.model = mc
        cfg.trainer.parallel.ep = world
        cfg.trainer.parallel.transport = transport
        cfg.trainer.compile = ranks.device.type == "cuda"
        cfg.trainer.dtype = "bfloat16" if ranks.device.type == "cuda" else "float32"
        backend = "grouped_mm" if ranks.device.type == "cuda" else "reference"
        model = build_model(mc, backend, seed=0, device=ranks.device)
        core = TrainingCore(cfg, ranks, model)
        exchange = Exchange()
        if core.plan is not None and core.plan.transport is not None:
            exchange.watch(core.plan.transport, rank, ranks.device)
        seq = args.seq if not args.tiny else 64
        n_global = rows * world
        gen = torch.Generator().manual_seed(1)
        batch = torch.randint(0, mc.vocab_size, (n_global, seq + 1), generator=gen)
        step_batch = {"tokens": batch[:, :-1], "targets": batch[:, 1:]}
        loss_fn = cross_entropy_loss(n_global * seq)
        times, losses = [], []
        for i in range(WARMUP + args.steps):
            if i == WARMUP:
                exchange.reset()
                if ranks.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
            _sync(ranks.device)
            t0 = time.perf_counter()
            result = core.step(step_batch, loss_fn, rows, tokens=n_global * seq)
            _sync(ranks.device)
            if i >= WARMUP:
                times.append(max(ranks.all_gather(time.perf_counter() - t0)))
                losses.append(result.figures["loss"])
        exchange.settle()
        step_s = statistics.median(times)
        tps = n_global * seq / step_s
        peak = torch.cuda.max_memory_allocated() / 2**30 if ranks.device.type == "cuda" else math.nan
        row = Row(
            f"moonlet EP={world}" if not args.tiny else f"tiny EP={world}",
            world,
            rows,
            transport if world > 1 else "-",
            step_s,
            tps,
            flops_per_token(mc, seq) * tps / (H200_PEAK * world),
            exchange.bytes_sent / args.steps / 1e6,
            exchange.seconds / args.steps,
            peak,
            losses[-1],
        )
        if ranks.is_main:
            Path(out).write_text(json.dumps(asdict(row)))
        _leave(ranks)
    finally:
        ranks.close()


def _layer_rows(rank: int, world: int, args: argparse.Namespace, transport: str, out: str) -> None:
    """One MoE layer (LAYER_SHAPE) fwd+bwd at EP = world through the trainer's expert-parallel layer."""
    from trainer.ep import apply_expert_parallel, make_transport
    from trainer.model.moe import MoE

    device = torch.device(args.device)
    ranks = _ranks(rank, world, device, out + ".store")
    try:
        H, inter, E, k, tokens = TINY_LAYER if args.tiny else LAYER_SHAPE
        shape = {"hidden_size": H, "moe_intermediate_size": inter, "n_routed_experts": E, "num_experts_per_tok": k}
        mc = ModelConfig(**(TINY | shape))
        backend = "grouped_mm" if device.type == "cuda" else "reference"
        model = build_model(replace(mc, num_layers=2, first_k_dense=1), backend, seed=0, device=ranks.device)
        layer = next(m for m in model.modules() if isinstance(m, MoE))
        transport_obj = make_transport(transport, dist.group.WORLD)
        apply_expert_parallel(model, transport_obj)
        exchange = Exchange()
        exchange.watch(transport_obj, rank, ranks.device)
        gen = torch.Generator().manual_seed(2 + rank)
        x = torch.randn(tokens, H, generator=gen).to(ranks.device).requires_grad_()
        dtype = torch.bfloat16 if ranks.device.type == "cuda" else torch.float32
        times = []
        for i in range(WARMUP + args.steps):
            if i == WARMUP:
                exchange.reset()
            _sync(ranks.device)
            t0 = time.perf_counter()
            with torch.autocast(ranks.device.type, dtype=dtype, enabled=ranks.device.type == "cuda"):
                y = layer(x.unsqueeze(0))
            y.float().square().mean().backward()
            _sync(ranks.device)
            if i >= WARMUP:
                times.append(max(ranks.all_gather(time.perf_counter() - t0)))
        exchange.settle()
        step_s = statistics.median(times)
        flops = 6 * tokens * k * 3 * H * inter  # fwd + bwd of the three expert matrices per routed row
        row = Row(
            f"MoE layer H{H} I{inter} E{E} top-{k}",
            world,
            tokens,
            transport,
            step_s,
            tokens * world / step_s,
            flops * world / step_s / (H200_PEAK * world),
            exchange.bytes_sent / args.steps / 1e6,
            exchange.seconds / args.steps,
        )
        if ranks.is_main:
            Path(out).write_text(json.dumps(asdict(row)))
        _leave(ranks)
    finally:
        ranks.close()


def measure(fn, world: int, *args) -> Row:
    with tempfile.TemporaryDirectory(prefix="ep-scaling-") as d:
        out = str(Path(d) / "row.json")
        mp.spawn(fn, args=(world, *args, out), nprocs=world, join=True)
        return Row(**json.loads(Path(out).read_text()))


def _or_dash(x: float, spec: str) -> str:
    return "-" if math.isnan(x) else format(x, spec)


def table(rows: list[Row], weak: Row, strong: Row) -> str:
    lines = [
        "| configuration | GPUs | rows/GPU | transport | step ms | tokens/s | MFU | weak eff. | strong x "
        "| exchange MB/step | exchange ms/step | rate GB/s (of 350) | peak GiB | loss |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        weak_eff = r.tokens_per_s / (r.gpus * weak.tokens_per_s) if r.gpus > 1 and "layer" not in r.name else math.nan
        strong_x = strong.step_s / r.step_s if r.gpus > 1 and "layer" not in r.name else math.nan
        rate = r.exchange_mb / 1e3 / r.exchange_s if r.exchange_s > 0 else math.nan
        lines.append(
            f"| {r.name} | {r.gpus} | {r.rows_per_gpu} | {r.transport} | {r.step_s * 1e3:.1f} | {r.tokens_per_s:,.0f} "
            f"| {r.mfu:.1%} | {_or_dash(weak_eff, '.1%')} | {_or_dash(strong_x, '.2f')} | {r.exchange_mb:.1f} "
            f"| {r.exchange_s * 1e3:.2f} | {_or_dash(rate, '.0f')} ({_or_dash(rate / NVLINK_P2P_GBS, '.0%')}) "
            f"| {_or_dash(r.peak_gib, '.1f')} | {_or_dash(r.loss, '.4f')} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/moonlet.toml")
    p.add_argument("--rows", type=int, default=4, help="rows per GPU (EP = 2 and the weak baseline)")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=10, help="measured steps after 3 warm-up steps")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model and layer (the plumbing on the CPU)")
    args = p.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    transports = ["p2p", "symm_mem"] if args.device == "cuda" else ["p2p"]
    if args.device == "cuda" and torch.cuda.device_count() < 2:
        sys.exit(f"bench/ep_scaling.py needs two GPUs (found {torch.cuda.device_count()}): run it on nvidia-h200-x2")
    t0 = time.perf_counter()
    weak = measure(_model_rows, 1, args, args.rows, "auto")
    strong = measure(_model_rows, 1, args, 2 * args.rows, "auto")
    rows = [weak, strong] + [measure(_model_rows, 2, args, args.rows, t) for t in transports]
    rows += [measure(_layer_rows, 2, args, t) for t in transports]
    mc = model_config(args)
    total, active = count_params(mc)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if args.device == 'cuda' else 'cpu'}; model "
        f"{total / 1e9:.2f}B parameters ({active / 1e9:.2f}B active), seq {args.seq if not args.tiny else 64}, "
        f"{WARMUP} warm-up + {args.steps} steps; {time.perf_counter() - t0:.0f} s in all\n"
    )
    print(table(rows, weak, strong))
    eps = [r for r in rows if r.gpus == 2 and "layer" not in r.name]
    print(
        "\nweak-scaling efficiency (target >= 90%): "
        + ", ".join(f"{r.transport} {r.tokens_per_s / (2 * weak.tokens_per_s):.1%}" for r in eps)
    )


if __name__ == "__main__":
    main()
