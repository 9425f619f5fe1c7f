"""Weight-sync benchmark: publish latency and pause window against checkpoint size, on CPU.

For each model size it starts one real worker role (vLLM CPU build) in a fresh run, then publishes
alternately perturbed and original weights several times through `WeightPublisher` (file
transport, keep-mode pause), and compares with the floor: writing the version's bytes once
(safetensors) plus reading them once. Overhead = (publish - (write + read)) / (write + read); the
target is <= 20%. Prints a markdown table; with --results appends it to bench/RESULTS.md.

    .venv/bin/python bench/weight_sync_bench.py [--sizes tiny,s,m,l] [--repeats 3] [--results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import RendezvousConfig, load_config  # noqa: E402
from common.keys import Keys  # noqa: E402
from common.rendezvous import Rendezvous  # noqa: E402
from rollout.weights import WeightPublisher, hf_tensors  # noqa: E402

# name -> trainer.model overrides (DeepSeek-V3 shape; experts dominate the bytes)
SIZES = {
    "tiny": {},
    "s": {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": 16},
    "m": {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 1024, "n_routed_experts": 16},
    "l": {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 1024, "n_routed_experts": 16,
          "num_layers": 4},
}  # fmt: skip


def floor_s(tensors: dict[str, torch.Tensor], scratch: Path) -> tuple[float, float]:
    """Seconds to write the tensors once as safetensors, and to read them back once."""
    path = scratch / "floor.safetensors"
    t0 = time.perf_counter()
    save_file(tensors, str(path))
    t1 = time.perf_counter()
    with safe_open(str(path), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118
            # get_tensor maps the file lazily; cloning makes every byte actually be read.
            fh.get_tensor(name).clone()
    t2 = time.perf_counter()
    path.unlink()
    return t1 - t0, t2 - t1


async def bench_size(name: str, overrides: dict, repeats: int, base: Path) -> dict:
    work = base / name
    work.mkdir(parents=True)
    sets = " ".join(f"--set trainer.model.{k}={v}" for k, v in overrides.items())
    config = work / "run.toml"
    config.write_text(
        f'[run]\nname = "wsb"\ndir = "{work / "run"}"\n[rollout]\ndtype = "float32"\nstartup_timeout_s = 500\n'
        "kv_cache_bytes = 67108864\n"
    )
    cfg = load_config(config, [f"trainer.model.{k}={v}" for k, v in overrides.items()])
    rz = Rendezvous(work / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    keys = Keys(f"wsb-{name}")
    env = os.environ | {"ROLE": "vllm", "SLIPSTREAM_MEET_DIR": str(rz.meet), "SLIPSTREAM_EXP": keys.exp,
                        "PYTHONPATH": str(ROOT)}  # fmt: skip
    cmd = [sys.executable, "-m", "common.cli", "run", str(config)] + sets.split()
    log = (work / "worker.log").open("ab")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    r = rz.async_client()
    try:
        deadline = time.monotonic() + 600
        while not await r.hlen(keys.workers):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker for size {name} did not start; see {work / 'worker.log'}")
            await asyncio.sleep(0.2)
        from transformers import AutoModelForCausalLM

        (model_dir,) = (work / "run" / "models").glob("*-*")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        original = {k: v.clone() for k, v in dict(hf_tensors(model.state_dict())).items()}
        perturbed = {k: v + 0.01 for k, v in original.items()}
        size = sum(t.numel() * t.element_size() for t in original.values())
        rows = []
        async with WeightPublisher(r, keys, cfg.rollout, work / "run") as pub:
            for i in range(repeats):
                tensors = perturbed if i % 2 == 0 else original
                w, rd = floor_s(tensors, work)
                res = await pub.publish(i + 1, tensors)
                assert not res.evicted, res.evicted
                rows.append((res.total_s, res.max_pause_s, res.write_s, res.export_s, w, rd))
        total, pause, write, export, w, rd = (statistics.median(col) for col in zip(*rows, strict=True))
        return {"size": name, "mb": size / 1e6, "publish_s": total, "pause_s": pause, "write_s": write,
                "floor_write_s": w, "floor_read_s": rd, "overhead": (total - (w + rd)) / (w + rd)}  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        await r.aclose()
        rz.close()


def table(results: list[dict]) -> str:
    lines = [
        "| size | tensors (MB) | publish (s) | pause window (s) | publisher write (s) | floor write (s) | "
        "floor read (s) | overhead vs write+read |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in results:
        lines.append(
            f"| {x['size']} | {x['mb']:.1f} | {x['publish_s']:.3f} | {x['pause_s']:.3f} | {x['write_s']:.3f} | "
            f"{x['floor_write_s']:.3f} | {x['floor_read_s']:.3f} | {x['overhead'] * 100:+.0f}% |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,s,m,l")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    (ROOT / "runs").mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="weight_sync_bench-", dir=ROOT / "runs"))
    try:
        results = [asyncio.run(bench_size(n, SIZES[n], args.repeats, base)) for n in args.sizes.split(",")]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = table(results)
    print(text)
    if args.results:
        section = (
            f"\n## Weight sync (file transport, keep-mode pause) — {time.strftime('%Y-%m-%d')}\n\n"
            f"Machine: {platform.node()}, {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}, vLLM CPU build. Command: `.venv/bin/python bench/weight_sync_bench.py "
            f"--sizes {args.sizes} --repeats {args.repeats} --results`. Median of {args.repeats} publishes per size "
            "to one worker. Publish = export + atomic write + pause/start/update/finish/reset/resume; floor = "
            "writing the bytes once plus reading them once.\n\n"
            f"{text}\n\nRatios (publish / (write + read)): "
            + ", ".join(f"{x['size']} {x['publish_s'] / (x['floor_write_s'] + x['floor_read_s']):.2f}" for x in results)
            + "\n"
        )
        path = ROOT / "bench" / "RESULTS.md"
        existing = path.read_text() if path.exists() else "# Benchmark results\n"
        path.write_text(existing.rstrip("\n") + "\n" + section)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
