"""Training-core scaling on the CPU: the optimizer-step time and the publish-write time of
`trainer.core.TrainingCore` at W = 1 and 2 ranks (gloo, one thread per rank), pure data parallel
(EP = 1) and expert parallel (EP = 2), on a small DeepSeek-V3-shaped MoE.

    python bench/trainer_scaling.py [--steps 10] [--repeats 5]

Every rank sees the same global batch of N rows and trains its N / W rows as one micro-batch, so the
rows differ only in how the step's work is split. A step is timed by the core itself (StepResult.seconds,
the slowest rank), after two warm-up steps. A publish write is what the trainer's ranks do in a publish:
`hf_part`, announce shard counts, rank 0 makes the directory, every rank writes its `VersionPart`, barrier
(timed from before `hf_part` to after the barrier, slowest rank). Left out: the index, the rename into
place and the workers' load of the version (bench/weight_sync_bench.py measures those).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import Config, ModelConfig  # noqa: E402
from common.weights.writer import VersionPart, count_shards  # noqa: E402
from trainer.core import TrainingCore, cross_entropy_loss  # noqa: E402
from trainer.model import build_model  # noqa: E402
from trainer.ranks import RankInfo, Ranks  # noqa: E402

ROWS, SEQ = 16, 64
SHARD_BYTES = 8 << 20
WARMUP = 2
CONFIGS = [(1, 1), (2, 1), (2, 2)]  # (W, EP)
MODEL = ModelConfig(
    vocab_size=512,
    hidden_size=128,
    num_layers=4,
    first_k_dense=1,
    intermediate_size=256,
    moe_intermediate_size=64,
    n_routed_experts=16,
    num_experts_per_tok=2,
    num_heads=4,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=32,
    v_head_dim=32,
    max_seq_len=128,
)
_ROUTED = re.compile(r"\.mlp\.experts\.\d+\.")


@dataclass
class Row:
    """One configuration's medians (seconds are the slowest rank's)."""

    world: int
    ep: int
    step_s: float
    step_min_s: float
    publish_s: float
    rank_bytes: list[int]
    """Tensor bytes each rank wrote in a publish, in rank order."""
    rank_expert_bytes: list[int]
    """Of those, the routed experts' bytes."""


def _batch(step: int) -> torch.Tensor:
    """The step's global batch [ROWS, SEQ + 1], the same on every rank."""
    return torch.randint(0, MODEL.vocab_size, (ROWS, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _publish(core: TrainingCore, ranks: Ranks, version: int) -> tuple[float, int, int]:
    """One publish write of every rank; (seconds of the slowest rank, this rank's bytes, its expert bytes)."""
    t0 = time.perf_counter()
    part = core.hf_part()
    counts = ranks.all_gather(count_shards(part, SHARD_BYTES))
    first, total = sum(counts[: ranks.rank]), sum(counts)
    tmp = Path(ranks.broadcast(tempfile.mkdtemp(prefix="trainer-scaling-") if ranks.is_main else None))
    written = VersionPart(tmp, version, part, SHARD_BYTES, first, total)
    written.write()
    ranks.barrier()
    seconds = max(ranks.all_gather(time.perf_counter() - t0))
    if ranks.is_main:
        shutil.rmtree(tmp)
    expert_bytes = sum(t.numel() * t.element_size() for name, t in part.items() if _ROUTED.search(name))
    return seconds, written.bytes, expert_bytes


def _run(ranks: Ranks, ep: int, steps: int, repeats: int) -> Row:
    cfg = Config()
    cfg.trainer.model = MODEL
    cfg.trainer.parallel.ep = ep
    core = TrainingCore(cfg, ranks, build_model(MODEL, "reference", seed=0))
    n_targets = ROWS * SEQ
    loss_fn = cross_entropy_loss(n_targets)
    step_s = []
    for i in range(WARMUP + steps):
        x = _batch(i)
        result = core.step({"tokens": x[:, :-1], "targets": x[:, 1:]}, loss_fn, ROWS // ranks.world, tokens=n_targets)
        if i >= WARMUP:
            step_s.append(max(ranks.all_gather(result.seconds)))
    publishes = [_publish(core, ranks, version) for version in range(1, repeats + 1)]
    _, rank_bytes, expert_bytes = publishes[-1]
    return Row(
        ranks.world,
        ep,
        statistics.median(step_s),
        min(step_s),
        statistics.median(p[0] for p in publishes),
        ranks.all_gather(rank_bytes),
        ranks.all_gather(expert_bytes),
    )


def _rank(rank: int, world: int, ep: int, steps: int, repeats: int, out: str) -> None:
    torch.set_num_threads(1)
    if world == 1:
        ranks = Ranks.single(torch.device("cpu"))
    else:
        dist.init_process_group("gloo", init_method=f"file://{out}.store", rank=rank, world_size=world)
        ranks = Ranks(RankInfo(rank, world, rank, "launcher"), torch.device("cpu"), dist.group.WORLD)
    try:
        row = _run(ranks, ep, steps, repeats)
        if ranks.is_main:
            Path(out).write_text(json.dumps(asdict(row)))
        ranks.barrier()  # no rank tears its gloo pairs down while another still uses them
    finally:
        ranks.close()


def measure(world: int, ep: int, steps: int, repeats: int) -> Row:
    with tempfile.TemporaryDirectory(prefix="trainer-scaling-") as d:
        out = str(Path(d) / "row.json")
        mp.spawn(_rank, args=(world, ep, steps, repeats, out), nprocs=world, join=True)
        return Row(**json.loads(Path(out).read_text()))


def table(rows: list[Row]) -> str:
    base = rows[0].step_s
    lines = [
        "| config | step s (median) | step s (min) | tokens/s | ratio vs W=1 | publish write s "
        "| bytes written by the largest rank (MB) | per-rank MB (routed experts) |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        name = f"W={r.world}/EP={r.ep}" + (" (pure data parallel)" if r.world > 1 and r.ep == 1 else "")
        mb = zip(r.rank_bytes, r.rank_expert_bytes, strict=True)
        per_rank = ", ".join(f"{b / 1e6:.2f} ({e / 1e6:.2f})" for b, e in mb)
        lines.append(
            f"| {name} | {r.step_s:.3f} | {r.step_min_s:.3f} | {ROWS * SEQ / r.step_s:,.0f} | "
            f"{base / r.step_s:.2f} | {r.publish_s:.4f} | {max(r.rank_bytes) / 1e6:.2f} | {per_rank} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10, help="measured optimizer steps per configuration")
    parser.add_argument("--repeats", type=int, default=5, help="measured publish writes per configuration")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    rows = []
    for world, ep in CONFIGS:
        t0 = time.perf_counter()
        rows.append(measure(world, ep, args.steps, args.repeats))
        print(f"W={world}/EP={ep}: done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    print(
        f"model: {MODEL.num_layers} layers ({MODEL.num_layers - MODEL.first_k_dense} MoE), hidden "
        f"{MODEL.hidden_size}, {MODEL.n_routed_experts} routed experts top-{MODEL.num_experts_per_tok}; batch "
        f"{ROWS} x {SEQ} tokens, one micro-batch per rank; {WARMUP} warm-up + {args.steps} steps, "
        f"{args.repeats} publishes, shards of {SHARD_BYTES >> 20} MiB; torch {torch.__version__}, one thread per "
        "rank (W=2 uses both cores of a 2-core machine); 1-min load average "
        f"{load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
    )
    print(table(rows))
    print(
        "\nRatios (W=1 step / step): "
        + ", ".join(f"W={r.world}/EP={r.ep} {rows[0].step_s / r.step_s:.2f}" for r in rows)
    )


if __name__ == "__main__":
    main()
