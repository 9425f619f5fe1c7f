"""Weight-sync benchmark: publish latency and pause window against checkpoint size, on CPU.

For each model size it starts one real worker role (vLLM CPU build) in a fresh run, then, for
several rounds, measures the floor (writing the version's bytes once as one safetensors file plus
reading them once into existing memory) and publishes alternately perturbed and original weights
through `WeightPublisher` (file transport, keep-mode pause) both ways: streamed (workers load each
shard as it is written) and whole (write, then pause and load). Overhead = publish / floor - 1;
the target is <= 20%. Prints a markdown table; with --results appends it to bench/RESULTS.md.

    .venv/bin/python bench/weight_sync_bench.py [--sizes tiny,s,m,l] [--repeats 5] [--shard-mb 32] [--results]
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
from dataclasses import replace
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.config import RendezvousConfig, load_config  # noqa: E402
from common.keys import Keys  # noqa: E402
from common.rendezvous import Rendezvous  # noqa: E402
from common.run_secrets import apply_secrets, read_secrets  # noqa: E402
from common.weights.export import per_expert_tensors  # noqa: E402
from common.weights.publisher import WeightPublisher  # noqa: E402

# Pause before each measured step: vLLM's OpenMP threads spin for a while after an update and would
# slow whatever runs next on this 2-core machine (floor reads varied 0.09-0.52 s without it).
SETTLE_S = 1.0
# name -> trainer.model overrides (DeepSeek-V3 shape; experts dominate the bytes)
SIZES = {
    "tiny": {},
    "s": {"hidden_size": 512, "intermediate_size": 1024, "moe_intermediate_size": 512, "n_routed_experts": 16},
    "m": {"hidden_size": 1024, "intermediate_size": 2048, "moe_intermediate_size": 1024, "n_routed_experts": 16},
    "l": {
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "moe_intermediate_size": 1024,
        "n_routed_experts": 16,
        "num_layers": 4,
    },
}


def floor_s(tensors: dict[str, torch.Tensor], into: dict[str, torch.Tensor], scratch: Path) -> tuple[float, float]:
    """Seconds to write the tensors once as one safetensors file, and to read them back once into `into`.

    The read copies every tensor from the file into existing memory, as a worker copies a version into
    its model's parameters.
    """
    path = scratch / "floor.safetensors"
    t0 = time.perf_counter()
    save_file(tensors, str(path))
    t1 = time.perf_counter()
    with safe_open(str(path), framework="pt") as fh:
        for name in fh.keys():  # noqa: SIM118
            into[name].copy_(fh.get_tensor(name))
    t2 = time.perf_counter()
    path.unlink()
    return t1 - t0, t2 - t1


async def bench_size(name: str, overrides: dict, repeats: int, shard_mb: int, vllm_args: list[str], base: Path) -> dict:
    work = base / name
    work.mkdir(parents=True)
    sets = " ".join(f"--set trainer.model.{k}={v}" for k, v in overrides.items())
    config = work / "run.toml"
    config.write_text(
        f'[run]\nname = "wsb"\ndir = "{work / "run"}"\n[rollout]\ndtype = "float32"\nstartup_timeout_s = 500\n'
        f"kv_cache_bytes = 67108864\nextra_args = {json.dumps(vllm_args)}\n"
    )
    cfg = load_config(config, [f"trainer.model.{k}={v}" for k, v in overrides.items()])
    rz = Rendezvous(work / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    keys = Keys(f"wsb-{name}")
    env = os.environ | {
        "ROLE": "vllm",
        "SLIPSTREAM_MEET_DIR": str(rz.meet),
        "SLIPSTREAM_EXP": keys.exp,
        "PYTHONPATH": str(ROOT),
    }
    cmd = [sys.executable, "-m", "common.runs.cli", "run", str(config)] + sets.split()
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

        generated = read_secrets(rz.meet)  # the worker's vLLM asks for the run's generated key
        assert generated is not None, f"no secrets in {rz.meet}"
        apply_secrets(cfg, generated)
        (model_dir,) = (work / "run" / "models").glob("*-*")
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        original = {k: v.clone() for k, v in dict(per_expert_tensors(model.state_dict())).items()}
        perturbed = {k: v + 0.01 for k, v in original.items()}
        size = sum(t.numel() * t.element_size() for t in original.values())
        modes = {"streamed": True, "whole": False}
        rows: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
        floors = []
        into = {k: torch.empty_like(v) for k, v in original.items()}
        pubs = {
            m: WeightPublisher(r, keys, replace(cfg.rollout, stream_weights=on, weight_shard_mb=shard_mb), work / "run")
            for m, on in modes.items()
        }
        version = 0
        for _ in range(repeats):
            await asyncio.sleep(SETTLE_S)
            floors.append(floor_s(original, into, work))
            for m, pub in pubs.items():
                version += 1
                await asyncio.sleep(SETTLE_S)
                res = await pub.publish(version, perturbed if version % 2 else original)
                assert not res.evicted, res.evicted
                assert res.streamed == modes[m]
                rows[m].append((res.total_s, res.max_pause_s, res.write_s, res.max_load_s))
                print(
                    f"{name} {m:8s} floor {floors[-1][0]:.3f}+{floors[-1][1]:.3f}  publish {res.total_s:.3f} "
                    f"write {res.write_s:.3f} drive {res.drive_s:.3f} pause {res.max_pause_s:.3f} "
                    f"load {res.max_load_s:.3f}",
                    flush=True,
                )
        for pub in pubs.values():
            await pub.close()
        w, rd = (statistics.median(col) for col in zip(*floors, strict=True))
        out = {"size": name, "mb": size / 1e6, "floor_write_s": w, "floor_read_s": rd}
        for m, got in rows.items():
            total, pause, write, load = (statistics.median(col) for col in zip(*got, strict=True))
            out[m] = {
                "publish_s": total,
                "pause_s": pause,
                "write_s": write,
                "load_s": load,
                "overhead": (total - (w + rd)) / (w + rd),
            }
        return out
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        await r.aclose()
        rz.close()


def table(results: list[dict]) -> str:
    lines = [
        "| size | tensors (MB) | floor write (s) | floor read (s) | streamed publish (s) | pause (s) | overhead | "
        "whole publish (s) | pause (s) | of which vLLM load (s) | overhead |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in results:
        st, wh = x["streamed"], x["whole"]
        lines.append(
            f"| {x['size']} | {x['mb']:.1f} | {x['floor_write_s']:.3f} | {x['floor_read_s']:.3f} | "
            f"{st['publish_s']:.3f} | {st['pause_s']:.3f} | {st['overhead'] * 100:+.0f}% | "
            f"{wh['publish_s']:.3f} | {wh['pause_s']:.3f} | {wh['load_s']:.3f} | {wh['overhead'] * 100:+.0f}% |"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny,s,m,l")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shard-mb", type=int, default=32, help="rollout.weight_shard_mb")
    ap.add_argument("--vllm-args", default="", help="extra vLLM arguments (rollout.extra_args), space-separated")
    ap.add_argument("--results", action="store_true", help="append the table to bench/RESULTS.md")
    args = ap.parse_args()
    (ROOT / "runs").mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="weight_sync_bench-", dir=ROOT / "runs"))
    try:
        results = [
            asyncio.run(bench_size(n, SIZES[n], args.repeats, args.shard_mb, args.vllm_args.split(), base))
            for n in args.sizes.split(",")
        ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = table(results)
    print(text)
    if args.results:
        ratios = "; ".join(
            f"{x['size']} streamed {x['streamed']['overhead'] + 1:.2f}, whole {x['whole']['overhead'] + 1:.2f}"
            for x in results
        )
        section = (
            f"\n## Weight sync (file transport, keep-mode pause) — {time.strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: {platform.node()}, {os.cpu_count()} CPU cores, {platform.processor() or platform.machine()}, "
            f"torch {torch.__version__}, vLLM CPU build. Command: `.venv/bin/python bench/weight_sync_bench.py "
            f"--sizes {args.sizes} --repeats {args.repeats} --shard-mb {args.shard_mb}"
            + (f" --vllm-args '{args.vllm_args}'" if args.vllm_args else "")
            + " --results`. One worker; per size, "
            f"{args.repeats} rounds of: floor, streamed publish, whole publish (medians). Floor = writing the bytes "
            "once as one safetensors file plus reading them once into existing memory. Streamed = workers load "
            "shard i while shard i+1 is written (rollout.stream_weights = true); whole = write everything, then "
            "pause and load; vLLM load = its /update_weights call (reading the shards into the model, including "
            "vLLM's CPU expert pre-packing). Overhead = publish / floor - 1 (target <= +20%).\n\n"
            f"{text}\n\nRatios (publish / floor): {ratios}\n"
        )
        path = ROOT / "bench" / "RESULTS.md"
        existing = path.read_text() if path.exists() else "# Benchmark results\n"
        path.write_text(existing.rstrip("\n") + "\n" + section)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
