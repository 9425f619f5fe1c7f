"""What returning routed experts costs a rollout worker: generation throughput with
rollout.return_routed_experts off and on (two servers of one tiny model, started one after the other
with the worker's own command line and environment), the same requests to both, and the response
bytes per generated token (routed_experts alone, and the whole JSON).

    .venv/bin/python bench/routing_payload.py                     # tiny-deepseek, 64 x 32 tokens at 16
    .venv/bin/python bench/routing_payload.py --model tiny-qwen3 --requests 128 --concurrency 32

Left out: prompts of realistic length (a 14-token prompt; routed-experts rows grow with prompt + completion
like the tokens themselves) and GPUs (no vLLM there).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root, for common/ and rollout/

from common.config import load_config  # noqa: E402
from common.net import free_port  # noqa: E402
from rollout.client import GENERATE_PATH  # noqa: E402
from rollout.worker import VllmProcess, vllm_command, vllm_env, wait_ready  # noqa: E402
from trainer.tinykit import resolve_model  # noqa: E402

# "<|user|>what is 12+7? solve\n<|assistant|>" in the tiny tokenizer
PROMPT = [5, 90, 80, 91, 80, 8, 9, 17, 14, 84, 80, 97, 81, 6]


@dataclass
class Measured:
    tokens_per_s: float
    response_bytes_per_token: float  # whole JSON body per generated token
    routing_bytes_per_row: float  # base64 routed_experts per row (position), 0 when off


async def workload(url: str, requests: int, concurrency: int, max_tokens: int) -> Measured:
    gate = asyncio.Semaphore(concurrency)
    body_bytes = routing_bytes = rows = tokens = 0

    async def one(session: aiohttp.ClientSession, i: int) -> None:
        nonlocal body_bytes, routing_bytes, rows, tokens
        params = {"max_tokens": max_tokens, "logprobs": 0, "ignore_eos": True, "seed": i}
        async with (
            gate,
            session.post(
                f"{url}{GENERATE_PATH}", json={"model": "policy", "token_ids": PROMPT, "sampling_params": params}
            ) as r,
        ):
            raw = await r.read()
            assert r.status == 200, raw[:300]
        (choice,) = json.loads(raw)["choices"]
        body_bytes += len(raw)
        tokens += len(choice["token_ids"])
        if choice.get("routed_experts"):
            routing_bytes += len(choice["routed_experts"])
            rows += len(PROMPT) + len(choice["token_ids"]) - 1
            base64.b64decode(choice["routed_experts"], validate=True)

    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(one(session, i) for i in range(concurrency)))  # warm-up, not timed
        body_bytes = routing_bytes = rows = tokens = 0
        start = time.perf_counter()
        await asyncio.gather(*(one(session, i) for i in range(requests)))
        took = time.perf_counter() - start
    return Measured(tokens / took, body_bytes / tokens, routing_bytes / rows if rows else 0.0)


async def serve_and_measure(run_dir: Path, config: Path, routing: bool, args: argparse.Namespace) -> Measured:
    cfg = load_config(config)
    cfg.rollout.return_routed_experts = routing
    model_dir = resolve_model(cfg, run_dir)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    cmd = vllm_command(cfg.rollout, model_dir, "127.0.0.1", port, cpu=True)
    assert ("--enable-return-routed-experts" in cmd) == routing
    name = "on" if routing else "off"
    vllm = VllmProcess(cmd, vllm_env(run_dir), url, run_dir / f"vllm-{name}.log", f"[vllm {name}]")
    await vllm.start()
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, vllm, cfg.rollout.served_model_name, timeout_s=300)
        return await workload(url, args.requests, args.concurrency, args.max_tokens)
    finally:
        await vllm.stop()


async def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-deepseek", choices=["tiny-deepseek", "tiny-qwen3"])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=1, help="off/on server pairs; the table shows each")
    args = ap.parse_args()
    run_dir = Path(tempfile.mkdtemp(prefix="ss-rp-"))
    arch = {"tiny-deepseek": "deepseek_v3", "tiny-qwen3": "qwen3_moe"}[args.model]
    config = run_dir / "run.toml"
    config.write_text(
        f'[run]\nname = "rp"\ndir = "{run_dir}"\n[rollout]\nmodel = "{args.model}"\ndtype = "float32"\n'
        f'[trainer.model]\narch = "{arch}"\n' + ("n_shared_experts = 0\n" if arch == "qwen3_moe" else "")
    )
    results = []
    try:
        for _ in range(args.repeats):
            results.append([await serve_and_measure(run_dir, config, routing, args) for routing in (False, True)])
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)
    print(
        f"\n{args.model}: {args.requests} requests x {args.max_tokens} tokens at {args.concurrency} concurrent, "
        f"{len(PROMPT)}-token prompt"
    )
    print("| tokens/s off | tokens/s on | on/off | routed_experts B/row | JSON B/token off | JSON B/token on |")
    print("|---|---|---|---|---|---|")
    for off, on in results:
        print(
            f"| {off.tokens_per_s:.0f} | {on.tokens_per_s:.0f} | {on.tokens_per_s / off.tokens_per_s:.2f} | "
            f"{on.routing_bytes_per_row:.1f} | {off.response_bytes_per_token:.0f} | {on.response_bytes_per_token:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
