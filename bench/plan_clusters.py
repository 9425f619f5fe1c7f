"""The memory planner's answers (trainer/plan.py) for Qwen3-30B-A3B and DeepSeek-V3 on 8, 64 and 256 H200s,
one table, with the planner's choice that fits where the config's does not; and moonlet's planned peaks beside the
measured ones of bench/RESULTS.md ("Activation checkpointing on moonlet": compiled blocks, one micro-batch per step,
one H200). Planned, not measured: `python bench/plan_clusters.py`."""

from __future__ import annotations

import argparse

from common.config import load_config
from trainer.plan import H200_USABLE_GIB, GiB, plan, suggest

MOONLET_MEASURED = [  # (rows, seq, mode, GiB measured)
    (16, 4096, "none", 83.0),
    (16, 4096, "selective", 53.7),
    (16, 4096, "full", 39.4),
    (32, 4096, "selective", 94.9),
    (32, 4096, "full", 66.3),
    (16, 8192, "selective", 94.9),
    (16, 8192, "full", 66.3),
]


def moonlet() -> None:
    print("moonlet, one H200: measured (compiled) vs planned")
    for rows, seq, mode, measured in MOONLET_MEASURED:
        cfg = load_config("configs/moonlet.toml", [f"trainer.model.max_seq_len={seq}", "trainer.compile=true"])
        p = plan(cfg, 1, mode=mode, rows=rows, accumulating=False)
        print(
            f"  {rows}x{seq} {mode:<9} measured {measured:6.1f} planned {p.total / GiB:6.1f} GiB  ratio {measured / (p.total / GiB):.2f}"
        )


CLUSTER_MODELS = {"qwen3-30b-a3b": "configs/qwen3-30b-a3b.toml", "deepseek-v3": "configs/deepseek-v3.toml"}


def clusters(models: tuple[str, ...] = tuple(CLUSTER_MODELS)) -> None:
    print(
        f"planned, not measured: per-rank GiB on H200s ({H200_USABLE_GIB:g} GiB usable), 1 row x 4096 per micro-batch"
    )
    print(
        f"  {'model':<15} {'gpus':>5} {'ep':>4} {'AC':<9} {'params':>7} {'grads':>7} {'optim':>7} {'act':>6} {'total':>7}  fits"
    )
    for name in models:
        cfg = load_config(CLUSTER_MODELS[name])
        experts = cfg.trainer.model.n_routed_experts
        for gpus in (8, 64, 256):
            ep = max(e for e in range(1, gpus + 1) if gpus % e == 0 and experts % e == 0)
            for mode in ("selective", "full"):
                p = plan(cfg, gpus, ep=ep, mode=mode, rows=1)
                fits = p.total <= H200_USABLE_GIB * GiB
                print(
                    f"  {name:<15} {gpus:>5} {ep:>4} {mode:<9} {(p.dense_params + p.expert_params) / GiB:7.1f} "
                    f"{p.grads / GiB:7.1f} {p.optimizer / GiB:7.1f} {p.activations / GiB:6.1f} {p.total / GiB:7.1f}  "
                    f"{'yes' if fits else 'no: ' + suggest(cfg, gpus, H200_USABLE_GIB)}"
                )


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default=",".join(CLUSTER_MODELS), help="cluster rows of these (comma-separated)")
    ap.add_argument("--no-moonlet", action="store_true", help="skip moonlet's planned-vs-measured rows")
    args = ap.parse_args()
    if not args.no_moonlet:
        moonlet()
    clusters(tuple(args.models.split(",")))
