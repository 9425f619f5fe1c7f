"""Where a pretraining step of the training core loses time against moe_bench's moonlet step: one
process, the same config and overrides as the ROLE=trainer run, the same process group (NCCL of one
rank plus the gloo control group, trainer.ranks.form_group), but no role around it (no Redis, no
asyncio loop, no training thread, no DuckDB). bench/h200_role_pretrain.sh runs it when the role path
misses the 5% target.

    python bench/h200_role_profile.py CONFIG --set ... [--warmup 3] [--steps 8] [--out DIR]

Prints, all on the same model and optimizer after the same warm-up:
  core      Pretrainer.train_step (TrainingCore.step: micro-batching, loss with its per-micro-batch
            float, backward, Optimizer.step with telemetry, gloo all_gather of the figures)
  bench     moe_bench's moonlet step (forward, mean cross-entropy, backward, Optimizer.step, float(loss))
  phases    TrainingCore.step's phases with a device sync between them
  extras    gloo all_gather_object of a figures dict; MetricsWriter.log of one step's points and a flush
  profile   torch.profiler over 2 core steps and 2 bench steps: device-kernel time vs wall, top host ops
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import load_config  # noqa: E402
from common.metrics import MetricsWriter  # noqa: E402
from trainer.core import cross_entropy_loss, reduce_figures  # noqa: E402
from trainer.optim import autocast  # noqa: E402
from trainer.pretrain import PretrainData, Pretrainer  # noqa: E402
from trainer.ranks import RankInfo, form_group  # noqa: E402
from trainer.setup import resolve_device  # noqa: E402


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, n: int) -> list[float]:
    out = []
    for _ in range(n):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def profile(fn, device, n: int, path: Path, label: str) -> dict:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    t0 = time.perf_counter()
    with torch_profile(activities=acts) as prof:
        for _ in range(n):
            fn()
        sync(device)
    wall = (time.perf_counter() - t0) / n
    avg = prof.key_averages()
    dev_us = sum(getattr(e, "self_device_time_total", 0.0) for e in avg) / n
    syncs = {
        e.key: (e.count // n, e.cpu_time_total / n / 1e3)
        for e in avg
        if any(s in e.key for s in ("Synchronize", "_local_scalar_dense", "cudaMemcpy", "item"))
    }
    key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    path.write_text(
        avg.table(sort_by=key, row_limit=40, max_name_column_width=80)
        + "\n\nby self CPU time:\n"
        + avg.table(sort_by="self_cpu_time_total", row_limit=40, max_name_column_width=80)
    )
    res = {
        "wall_ms": wall * 1e3,
        "device_kernel_ms": dev_us / 1e3,
        "idle_ms": wall * 1e3 - dev_us / 1e3,
        "sync_like_ops_per_step": syncs,
    }
    print(
        f"profile {label}: wall {res['wall_ms']:.1f} ms/step, device kernels {res['device_kernel_ms']:.1f} ms, "
        f"not covered by kernels {res['idle_ms']:.1f} ms; sync-like ops per step: "
        + ", ".join(f"{k} x{c} ({ms:.1f} ms)" for k, (c, ms) in syncs.items()),
        flush=True,
    )
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("config")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s profile %(message)s")
    cfg = load_config(args.config, args.overrides)
    tc = cfg.trainer
    device = resolve_device(tc.device)
    out_dir = Path(args.out)
    ranks = form_group(RankInfo(), device)  # as the role: NCCL group of one (gloo on CPUs) + gloo control
    run_dir = Path(tempfile.mkdtemp(prefix="role_profile_"))
    d = tc.data
    B, S = d.batch_size, d.seq_len
    pt = Pretrainer(cfg, PretrainData(d.path, S, B), run_dir, metrics=None, ranks=ranks)
    model, opt, core = pt.model, pt.optimizer, pt.core
    tokens_per_step = B * S * tc.optim.grad_accum
    res: dict = {}

    t0 = time.perf_counter()
    for _ in range(args.warmup):
        pt.train_step()
    sync(device)
    print(f"warm-up {args.warmup} core steps: {time.perf_counter() - t0:.1f} s", flush=True)

    core_s = timed(pt.train_step, device, args.steps)
    fixed = pt.sampler.next_batch(B).to(device)

    def bench_step() -> float:
        with autocast(device, tc.dtype):
            logits = model(fixed[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), fixed[:, 1:].flatten())
        loss.backward()
        opt.step(B * S)
        return float(loss.detach())

    for _ in range(2):
        bench_step()
    bench_s = timed(bench_step, device, args.steps)
    core_s2 = timed(pt.train_step, device, args.steps)  # again, after the bench steps: drift check
    for name, xs in (("core", core_s), ("bench", bench_s), ("core_again", core_s2)):
        med = statistics.median(xs)
        res[name] = {"median_ms": med * 1e3, "tokens_per_s": tokens_per_step / med, "all_ms": [x * 1e3 for x in xs]}
        print(
            f"{name:>10}: median {med * 1e3:.1f} ms/step = {tokens_per_step / med:,.0f} tokens/s "
            f"(min {min(xs) * 1e3:.1f}, max {max(xs) * 1e3:.1f})",
            flush=True,
        )

    # TrainingCore.step's phases, a sync between each (the same calls in the same order).
    phases: dict[str, list[float]] = {k: [] for k in ("batch", "forward+loss", "backward", "optimizer", "all_gather")}
    for _ in range(args.steps):
        sync(device)
        t = time.perf_counter()
        rows = torch.cat([pt.sampler.next_batch(B) for _ in range(tc.optim.grad_accum)])
        targets = rows[:, 1:]
        n_targets = int((targets >= 0).sum())
        batch = {"tokens": rows[:, :-1].clamp(min=0), "targets": targets}
        loss_fn = cross_entropy_loss(n_targets)
        micro = core.my_micro_batches(batch, -(-B // ranks.world))
        sync(device)
        phases["batch"].append(time.perf_counter() - t)
        model.train()
        parts = []
        for mb in micro:
            t = time.perf_counter()
            with autocast(device, tc.dtype):
                o = loss_fn(model, mb)
            sync(device)
            phases["forward+loss"].append(time.perf_counter() - t)
            t = time.perf_counter()
            o.loss.backward()
            sync(device)
            phases["backward"].append(time.perf_counter() - t)
            parts.append(o.stats)
        t = time.perf_counter()
        opt.step(n_targets)
        sync(device)
        phases["optimizer"].append(time.perf_counter() - t)
        t = time.perf_counter()
        reduce_figures(ranks.all_gather(reduce_figures(parts)))
        phases["all_gather"].append(time.perf_counter() - t)
    res["phases_ms"] = {k: statistics.median(v) * 1e3 for k, v in phases.items() if v}
    print(
        "phases (median ms, sync between): " + ", ".join(f"{k} {v:.2f}" for k, v in res["phases_ms"].items()),
        flush=True,
    )

    # Small per-step costs of the role path.
    figs = {"loss": 1.0, "aux_loss": 0.0}
    ag = timed(lambda: ranks.all_gather(figs), torch.device("cpu"), 200)
    with MetricsWriter(run_dir, "profile", "trainer") as mw:
        t = time.perf_counter()
        for step in range(100):
            for i in range(5 + 3 * 8):
                mw.log(f"tag{i}", step, float(i))
        log_ms = (time.perf_counter() - t) / 100 * 1e3
        t = time.perf_counter()
        mw.flush()
        flush_ms = (time.perf_counter() - t) * 1e3
    res["extras"] = {
        "gloo_all_gather_object_ms": statistics.median(ag) * 1e3,
        "metrics_log_per_step_ms": log_ms,
        "metrics_flush_2900_points_ms": flush_ms,
    }
    print("extras: " + ", ".join(f"{k} {v:.3f}" for k, v in res["extras"].items()), flush=True)

    res["profile_core"] = profile(pt.train_step, device, 2, out_dir / "profile_core.txt", "core")
    res["profile_bench"] = profile(bench_step, device, 2, out_dir / "profile_bench.txt", "bench")
    (out_dir / "role_profile.json").write_text(json.dumps(res, indent=2))
    ranks.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
