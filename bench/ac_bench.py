"""Activation checkpointing on moonlet (`trainer.activation_checkpoint`): peak memory, tokens/s and MFU of the
trainer's own step (trainer/core.py: compiled blocks, bf16 autocast over fp32 masters, AdamW) with none /
selective / full, at a batch that fits without checkpointing and at one that does not, in one process, one table.

    python bench/ac_bench.py [--shapes 16x4096,32x4096] [--steps 6]      # one H200
    python bench/ac_bench.py --shapes 8x4096 --compile both               # compiled and eager rows, one table
    python bench/ac_bench.py --device cpu --tiny --steps 2                 # the plumbing, here (figures mean nothing)

Each row: 3 warm-up steps (compilation), then the median of the measured steps (CUDA-synchronised); peak = the
allocator's max allocated over the measured steps; a row that runs out of memory says so. MFU counts 6 x active
parameters + causal attention per token over 989 TFLOP/s (bench/moe_bench.py's count; recomputation not counted).
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import Config, ModelConfig, load_config  # noqa: E402
from trainer.core import TrainingCore, cross_entropy_loss  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.model.transformer import attention_flops_per_token, count_params  # noqa: E402
from trainer.plan import plan  # noqa: E402
from trainer.ranks import Ranks  # noqa: E402

H200_PEAK = 989e12
WARMUP = 3
MODES = ("none", "selective", "full")
TINY = ModelConfig(
    vocab_size=256,
    hidden_size=64,
    num_layers=3,
    first_k_dense=1,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    num_heads=4,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=16,
    v_head_dim=16,
    max_seq_len=512,
)


@dataclass
class Row:
    mode: str
    rows: int
    seq: int
    compiled: bool
    step_s: float = math.nan
    tokens_per_s: float = math.nan
    mfu: float = math.nan
    peak_gib: float = math.nan
    planned_gib: float = math.nan
    loss: float = math.nan
    error: str = ""


def measure(mc: ModelConfig, mode: str, rows: int, seq: int, steps: int, device: torch.device, compiled: bool) -> Row:
    row = Row(mode, rows, seq, compiled)
    cfg = Config()
    cfg.trainer.model = replace(mc, max_seq_len=max(mc.max_seq_len, seq))
    cfg.trainer.activation_checkpoint = mode  # type: ignore[assignment]
    cfg.trainer.compile = compiled
    cfg.trainer.dtype = "bfloat16" if device.type == "cuda" else "float32"
    core = None
    try:
        torch._dynamo.reset()
        backend = "grouped_mm" if device.type == "cuda" else "reference"
        core = TrainingCore(cfg, Ranks.single(device), build_model(cfg.trainer.model, backend, seed=0, device=device))
        x = torch.randint(0, mc.vocab_size, (rows, seq + 1), generator=torch.Generator().manual_seed(0))
        batch, loss_fn = {"tokens": x[:, :-1], "targets": x[:, 1:]}, cross_entropy_loss(rows * seq)
        times = []
        for i in range(WARMUP + steps):
            if i == WARMUP and device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            result = core.step(batch, loss_fn, rows, tokens=rows * seq)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= WARMUP:
                times.append(time.perf_counter() - t0)
        row.step_s = statistics.median(times)
        row.tokens_per_s = rows * seq / row.step_s
        per_token = 6 * count_params(mc)[1] + attention_flops_per_token(mc, seq)
        row.mfu = per_token * row.tokens_per_s / H200_PEAK
        row.loss = result.figures["loss"]
        if device.type == "cuda":
            row.peak_gib = torch.cuda.max_memory_allocated() / 2**30
    except torch.OutOfMemoryError as exc:
        row.error = "out of memory: " + str(exc).split("\n")[0][:120]
    finally:
        del core
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return row


def planned_gib(mc: ModelConfig, row: Row) -> float:
    """trainer/plan.py's peak for the row's config: one micro-batch per step, as measured here."""
    cfg = Config()
    cfg.trainer.model = replace(mc, max_seq_len=max(mc.max_seq_len, row.seq))
    cfg.trainer.activation_checkpoint = row.mode  # type: ignore[assignment]
    cfg.trainer.compile = row.compiled
    cfg.trainer.dtype = "bfloat16"
    return plan(cfg, 1, rows=row.rows, seq=row.seq, accumulating=False).total / 2**30


def table(rows: list[Row]) -> str:
    lines = [
        "| mode | blocks | rows x seq | step ms | tokens/s | MFU | peak GiB | planned GiB | measured/planned | loss |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        blocks = "compiled" if r.compiled else "eager"
        if r.error:
            lines.append(f"| {r.mode} | {blocks} | {r.rows} x {r.seq} | {r.error} | | | | {r.planned_gib:.1f} | | |")
        else:
            lines.append(
                f"| {r.mode} | {blocks} | {r.rows} x {r.seq} | {r.step_s * 1e3:.1f} | {r.tokens_per_s:,.0f} | {r.mfu:.1%} "
                f"| {r.peak_gib:.1f} | {r.planned_gib:.1f} | {r.peak_gib / r.planned_gib:.2f} | {r.loss:.4f} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/moonlet.toml")
    p.add_argument("--shapes", default="16x4096,32x4096", help="rows x seq per step, comma-separated")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (the plumbing on the CPU)")
    p.add_argument(
        "--compile",
        choices=("on", "off", "both"),
        default="on",
        help="compiled blocks (trainer.compile), eager ones, or a row of each (default on; the CPU runs eager)",
    )
    args = p.parse_args()
    device = torch.device(args.device)
    mc = TINY if args.tiny else load_config(args.config).trainer.model
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    t0 = time.perf_counter()
    rows = []
    compiled = {"on": [True], "off": [False], "both": [True, False]}[args.compile]
    if device.type != "cuda":
        compiled = [False]
    for n, seq in shapes:
        for mode in args.modes.split(","):
            for c in compiled:
                rows.append(measure(mc, mode, n, seq, args.steps, device, c))
                print(f"{mode} {n}x{seq}: {rows[-1]} (+{time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    for r in rows:  # after the measurements (the planner's compiled probes take minutes on the host's CPUs)
        r.planned_gib = planned_gib(mc, r)
        print(f"planned {r.mode} {r.rows}x{r.seq} compiled={r.compiled}: {r.planned_gib:.2f} GiB", file=sys.stderr)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    total, active = count_params(mc)
    print(
        f"torch {torch.__version__}, {name}; {total / 1e9:.2f}B parameters ({active / 1e9:.3f}B active); "
        f"{WARMUP} warm-up + {args.steps} steps per row; {time.perf_counter() - t0:.0f} s in all\n"
    )
    print(table(rows))


if __name__ == "__main__":
    main()
