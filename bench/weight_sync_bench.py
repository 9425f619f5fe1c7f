"""Weight-sync benchmark: publish latency and pause window against checkpoint size, on CPU.

For each model size it starts one real worker role (vLLM CPU build) in a fresh run, then, for
several rounds, measures the floor (writing the version's bytes once as one safetensors file plus
reading them once into existing memory) and publishes alternately perturbed and original weights
through `WeightPublisher` (file transport, keep-mode pause) both ways: streamed (workers load each
shard as it is written) and whole (write, then pause and load). Overhead = publish / floor - 1;
the target is <= 20%. Prints a markdown table; with --results appends it to bench/RESULTS.md.

    .venv/bin/python bench/weight_sync_bench.py [--sizes tiny,s,m,l] [--repeats 5] [--shard-mb 32] [--results]

With --delta it compares, per size in the same run and for each transport of --backends (file: the worker reads
the version's files; collective: the trainer broadcasts the shards to it through a gloo group, common/weights/
collective.py), every version sent whole against sent as a delta (rollout.weight_delta; common/weights/delta.py),
all streamed, on the same sequence of versions that drift as optimizer steps do (every float moves by --lr: sign
steps, as Adam's first steps are): bytes per version, publish time and pause window (medians; the delta
publisher's first version is its snapshot and is left out). With --demo-steps N it also launches the demo
(configs/demo.toml, 2 expert-parallel trainer ranks, deltas on, no snapshot after the first, the transport
--demo-backend) for N RL steps and reads from the trainer's log the bytes of every version it published, so the
delta ratio is that of real RL steps.

    .venv/bin/python bench/weight_sync_bench.py --delta --sizes tiny,l --repeats 8 --demo-steps 20 \
        [--backends file,collective] [--demo-backend collective] [--results]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
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
    async with started_worker(name, overrides, vllm_args, work) as (r, keys, cfg, original):
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


def drift(tensors: dict[str, torch.Tensor], seed: int, lr: float) -> dict[str, torch.Tensor]:
    """The next version: every float moved by `lr` up or down (seeded), in its own dtype."""
    gen = torch.Generator().manual_seed(seed)
    return {
        k: (v.double() + lr * torch.randint(0, 2, v.shape, generator=gen).double().mul(2).sub(1)).to(v.dtype)
        for k, v in tensors.items()
    }


async def bench_delta_size(
    name: str,
    overrides: dict,
    repeats: int,
    shard_mb: int,
    lrs: list[float],
    vllm_args: list[str],
    base: Path,
    backends: list[str],
) -> list[dict]:
    """Whole against delta publishing of the same drifting versions to one real worker, per learning rate (see the
    module docstring)."""
    work = base / f"delta-{name}"
    work.mkdir(parents=True)
    async with started_worker(name, overrides, vllm_args, work) as (r, keys, cfg, original):
        version = 0
        rows = []
        for lr in lrs:
            row, version = await _delta_rows(
                r, keys, cfg, original, name, lr, repeats, shard_mb, version, work, backends
            )
            rows.append(row)
        return rows


async def _delta_rows(
    r,
    keys: Keys,
    cfg,
    original: dict,
    name: str,
    lr: float,
    repeats: int,
    shard_mb: int,
    version: int,
    work: Path,
    backends: list[str],
) -> tuple[dict, int]:
    """One learning rate: per transport, `repeats` drifting versions whole, then the same as deltas; (row, last
    version used)."""
    size = sum(t.numel() * t.element_size() for t in original.values())
    out: dict = {"size": name, "mb": size / 1e6, "lr": lr, "backends": backends}
    for backend, mode, delta in ((b, m, d) for b in backends for m, d in (("whole", False), ("delta", True))):
        ro = replace(
            cfg.rollout,
            weight_backend=backend,
            weight_shard_mb=shard_mb,
            weight_delta=delta,
            weight_snapshot_every=repeats + 2,
        )
        rows = []
        state = original
        async with WeightPublisher(r, keys, ro, work / "run") as pub:
            for i in range(repeats + 1):
                state = drift(state, i, lr)
                version += 1
                await asyncio.sleep(SETTLE_S)
                res = await pub.publish(version, state)
                assert not res.evicted, res.evicted
                assert (res.delta_base is not None) == (delta and i > 0), (mode, i, res.delta_base)
                print(
                    f"{name} {backend} {mode:5s} v{version}: {res.bytes / 1e6:.2f} MB publish {res.total_s:.3f} "
                    f"write {res.write_s:.3f} pause {res.max_pause_s:.3f}",
                    flush=True,
                )
                if i > 0:  # the delta publisher's first version is its snapshot
                    rows.append((res.bytes, res.total_s, res.max_pause_s, res.write_s))
        nbytes, total, pause, write = (statistics.median(col) for col in zip(*rows, strict=True))
        out[f"{backend} {mode}"] = {"bytes": nbytes, "publish_s": total, "pause_s": pause, "write_s": write}
    return out, version


@contextlib.asynccontextmanager
async def started_worker(name: str, overrides: dict, vllm_args: list[str], work: Path):
    """One real worker role (vLLM CPU build) of a fresh run in `work`: (redis, keys, config, the model's
    HF tensors, one name per expert)."""
    sets = [f"trainer.model.{k}={v}" for k, v in overrides.items()]
    config = work / "run.toml"
    config.write_text(
        f'[run]\nname = "wsb"\ndir = "{work / "run"}"\n[rollout]\ndtype = "float32"\nstartup_timeout_s = 500\n'
        f"kv_cache_bytes = 67108864\nextra_args = {json.dumps(vllm_args)}\n"
    )
    cfg = load_config(config, sets)
    rz = Rendezvous(work / "meet", RendezvousConfig())
    rz.connect(timeout_s=10)
    keys = Keys(f"wsb-{name}")
    env = os.environ | {"ROLE": "vllm", "SLIPSTREAM_MEET_DIR": str(rz.meet), "SLIPSTREAM_EXP": keys.exp}
    env["PYTHONPATH"] = str(ROOT)
    cmd = [sys.executable, "-m", "common.runs.cli", "run", str(config)] + [a for s in sets for a in ("--set", s)]
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
        yield r, keys, cfg, {k: v.clone() for k, v in dict(per_expert_tensors(model.state_dict())).items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        await r.aclose()
        rz.close()


PUBLISHED = re.compile(
    r"published weight version (\d+)(?: \(a delta of version (\d+)\))? \(([\d.]+) MB\) to \d+ worker\(s\) in "
    r"([\d.]+)s \(write ([\d.]+)s, max pause ([\d.]+)s\)"
)


def demo_deltas(steps: int, base: Path, backend: str = "file") -> dict:
    """Launch the demo with delta publishing through `backend` for `steps` RL steps (2 EP ranks); per published
    version its MB, whether a delta, publish and pause seconds, read from the trainer's log."""
    # A short root: vLLM's IPC socket paths under the run dir must stay below 107 bytes.
    root = Path(tempfile.mkdtemp(prefix="wsb-"))
    sets = [
        f"run.root={root / 'runs'}",
        f"trainer.steps={steps}",
        "launch.roles.trainer.replicas=2",
        "trainer.parallel.ep=2",
        "rollout.weight_delta=true",
        f"rollout.weight_backend={backend}",
        f"rollout.weight_snapshot_every={steps + 10}",
        "evaluator.every_n_versions=1000",
    ]
    cmd = [sys.executable, "-m", "common.runs.cli", "launch", "configs/demo.toml"]
    for item in sets:
        cmd += ["--set", item]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": "wsb-demo"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    logs = "\n".join(p.read_text() for p in sorted((root / "runs" / "wsb-demo" / "logs").glob("trainer-0*.log")))
    versions = [
        {
            "version": int(m[1]),
            "delta": m[2] is not None,
            "mb": float(m[3]),
            "publish_s": float(m[4]),
            "pause_s": float(m[6]),
        }
        for m in PUBLISHED.finditer(logs)
    ]
    shutil.rmtree(root, ignore_errors=True)
    if out.returncode != 0 or not versions:
        raise RuntimeError(f"the demo run failed (exit {out.returncode}): {out.stdout[-3000:]}{out.stderr[-3000:]}")
    return {"steps": steps, "versions": versions, "backend": backend}


def codec_table(lrs: list[float]) -> str:
    """The encodings delta publishing could use, on one 64 MB (fp32) matrix of N(0, 0.02) weights moved by sign steps
    of `lr`: bytes against the whole tensor, and the encoder's speed (this process, one call each)."""
    import numpy as np
    import zstandard

    from common.weights.delta import _bytes, _shuffle, encode

    lines = [
        "| dtype | lr | elements changed | xor + zstd | byte-shuffled xor + zstd (ours) | sparse (int32 index, value) | "
        "ours, encode MB/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    weights = torch.randn(4096, 4096, generator=torch.Generator().manual_seed(0)) * 0.02
    for dtype in (torch.bfloat16, torch.float32):
        for lr in lrs:
            old = weights.to(dtype)
            new = drift({"w": weights}, 1, lr)["w"].to(dtype)
            xor = np.bitwise_xor(_bytes(new).numpy(), _bytes(old).numpy())
            width = old.element_size()
            changed = float((xor.reshape(-1, width) != 0).any(axis=1).mean())
            plain = len(zstandard.ZstdCompressor(level=1).compress(xor.data))
            t0 = time.perf_counter()
            ours = len(encode(new, old))
            took = time.perf_counter() - t0
            assert len(zstandard.ZstdCompressor(level=1).compress(_shuffle(xor, width).data)) == ours
            size = old.numel() * width
            lines.append(
                f"| {str(dtype).removeprefix('torch.')} | {lr:g} | {changed:.3f} | {plain / size:.3f} | "
                f"{ours / size:.3f} | {changed * (4 + width) / width:.3f} | {size / took / 1e6:.0f} |"
            )
    return "\n".join(lines)


def delta_table(results: list[dict], demo: dict | None) -> str:
    """One row per size, lr, transport and way of sending; the ratios are against the first transport sending
    whole versions (the file transport's, by default) in the same run."""
    lines = [
        "| size | tensors (MB) | lr | transport | sent | MB / version | publish (s) | pause (s) | bytes / whole | "
        "publish / file whole | pause / file whole |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for x in results:
        ref = x[f"{x['backends'][0]} whole"]
        for backend in x["backends"]:
            for mode in ("whole", "delta"):
                m = x[f"{backend} {mode}"]
                lines.append(
                    f"| {x['size']} | {x['mb']:.1f} | {x['lr']:g} | {backend} | {mode} | {m['bytes'] / 1e6:.2f} | "
                    f"{m['publish_s']:.3f} | {m['pause_s']:.3f} | {m['bytes'] / ref['bytes']:.3f} | "
                    f"{m['publish_s'] / ref['publish_s']:.2f} | {m['pause_s'] / ref['pause_s']:.2f} |"
                )
    if demo:
        vs = demo["versions"]
        full = [v["mb"] for v in vs if not v["delta"]]
        ratios = [v["mb"] / full[0] for v in vs if v["delta"]] if full else []
        if ratios:
            lines += [
                "",
                f"The demo, {demo['steps']} RL steps (its config, 2 EP ranks, the {demo['backend']} transport): "
                f"{len(vs)} versions published, "
                f"{len(full)} whole ({full[0]:.2f} MB), {len(ratios)} deltas; delta / whole bytes (the log's MB, one "
                f"decimal): median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, max {max(ratios):.3f}; "
                f"publish median {statistics.median(v['publish_s'] for v in vs if v['delta']):.3f} s, pause median "
                f"{statistics.median(v['pause_s'] for v in vs if v['delta']):.3f} s.",
                "",
                "Per version (MB): "
                + ", ".join(f"v{v['version']} {v['mb']:.2f}{'' if v['delta'] else ' (whole)'}" for v in vs),
            ]
    return "\n".join(lines)


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
    ap.add_argument("--delta", action="store_true", help="compare whole and delta publishing (module docstring)")
    ap.add_argument("--lr", default="1e-4,1e-6", help="with --delta: how far each float moves per version (a list)")
    ap.add_argument("--demo-steps", type=int, default=0, help="with --delta: also launch the demo for this many steps")
    ap.add_argument(
        "--backends", default="file,collective", help="with --delta: the transports (rollout.weight_backend)"
    )
    ap.add_argument("--demo-backend", default="collective", help="with --delta: the demo run's rollout.weight_backend")
    args = ap.parse_args()
    (ROOT / "runs").mkdir(exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="weight_sync_bench-", dir=ROOT / "runs"))
    if args.delta:
        return delta_main(args, base)
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


def delta_main(args: argparse.Namespace, base: Path) -> int:
    lrs = [float(x) for x in args.lr.split(",")]
    codecs = codec_table(sorted({1e-4, 1e-5, 1e-6, *lrs}, reverse=True))
    print(codecs, flush=True)
    try:
        results = [
            row
            for n in filter(None, args.sizes.split(","))
            for row in asyncio.run(
                bench_delta_size(
                    n,
                    SIZES[n],
                    args.repeats,
                    args.shard_mb,
                    lrs,
                    args.vllm_args.split(),
                    base,
                    args.backends.split(","),
                )
            )
        ]
        print(delta_table(results, None), flush=True)  # kept in the output should the demo fail
        demo = demo_deltas(args.demo_steps, base, args.demo_backend) if args.demo_steps else None
    finally:
        shutil.rmtree(base, ignore_errors=True)
    text = delta_table(results, demo)
    print(codecs)
    print(text)
    if args.results:
        section = (
            f"\n## Delta publishing against whole versions, transports {args.backends} — {time.strftime('%Y-%m-%d %H:%M')}\n\n"
            f"Machine: {platform.node()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, vLLM CPU build. "
            f"Command: `.venv/bin/python bench/weight_sync_bench.py --delta --sizes {args.sizes} --repeats "
            f"{args.repeats} --lr {args.lr} --demo-steps {args.demo_steps} --backends {args.backends} --demo-backend "
            f"{args.demo_backend} --results`. One worker; per size "
            f"{args.repeats} versions each way (medians), fp32 tensors as the demo publishes them.\n\n{codecs}\n\n{text}\n"
        )
        path = ROOT / "bench" / "RESULTS.md"
        path.write_text(path.read_text().rstrip("\n") + "\n" + section)
    print(json.dumps({"sizes": results, "demo": demo}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
