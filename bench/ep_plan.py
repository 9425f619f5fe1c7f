"""What building an RDEP dispatch plan costs per MoE call: the per-row indices built on the host and copied to
the GPU (what trainer/ep/plan.py did before issue 31) against built on the GPU from the small host tables
(what it does now), side by side in one process, for the shapes of moonlet and of a 128-expert layer at
EP = 2 and 4 (counts drawn as a router would, seeded). Both give the same indices (checked here).

Usage: python bench/ep_plan.py [--repeats 50]    (on a machine with a GPU; --device cpu to try it here)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.ep.plan import DispatchPlan, make_plan  # noqa: E402

# name -> (tokens per rank, routed experts, top-k)
SHAPES = {
    "moonlet 4x4096": (4 * 4096, 64, 6),
    "E128 top-8 16k": (16384, 128, 8),
}


def counts_of(world: int, tokens: int, experts: int, top_k: int, seed: int) -> torch.Tensor:
    """[W, E] rows each rank routes to each expert: top-k of random scores per token, per rank."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(world):
        chosen = torch.rand(tokens, experts, generator=g).topk(top_k, dim=1).indices.flatten()
        rows.append(torch.bincount(chosen, minlength=experts))
    return torch.stack(rows)


def on_host_then_copied(counts: torch.Tensor, rank: int, device: torch.device) -> DispatchPlan:
    plan = make_plan(counts, rank, "cpu")
    plan.recv_index = plan.recv_index.to(device)
    plan.put_index = [p.to(device) for p in plan.put_index]
    plan.expert_offsets = plan.expert_offsets.to(device)
    return plan


def timed(fn, repeats: int, device: torch.device) -> float:
    """Median seconds of fn() until its results are on the device."""
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    device = torch.device(args.device)
    print(f"dispatch plan of rank 0 per MoE call, median of {args.repeats}; device {device}")
    print("| shape | EP | rows in | host-built + copy ms | device-built ms | ratio |")
    print("|---|---|---|---|---|---|")
    for name, (tokens, experts, top_k) in SHAPES.items():
        for world in (2, 4):
            counts = counts_of(world, tokens, experts, top_k, seed=world)
            old, new = on_host_then_copied(counts, 0, device), make_plan(counts, 0, device)
            assert torch.equal(old.recv_index, new.recv_index)
            assert all(torch.equal(a, b) for a, b in zip(old.put_index, new.put_index, strict=True))
            t_old = timed(lambda c=counts: on_host_then_copied(c, 0, device), args.repeats, device)
            t_new = timed(lambda c=counts: make_plan(c, 0, device), args.repeats, device)
            print(
                f"| {name} | {world} | {new.rows_in} | {t_old * 1e3:.3f} | {t_new * 1e3:.3f} | {t_old / t_new:.1f}x |"
            )


if __name__ == "__main__":
    main()
