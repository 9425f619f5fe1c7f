"""Serve an HF checkpoint directory with the real vLLM CPU build, as a rollout worker would start it, and
compare its prompt log-probs with transformers' on the same tokens. For the tests that check that an
exported or imported family is served as transformers computes it (issue 34); each call is one vLLM
launch (about 45 s here), so a test module serves each checkpoint once."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import torch

from common.config import RolloutConfig
from common.config.coerce import ENV_PREFIX
from common.net import free_port
from rollout.worker import VllmProcess, vllm_command, vllm_env, wait_ready


@contextlib.asynccontextmanager
async def serve(model_dir: Path, run_dir: Path, max_model_len: int = 512, **rollout: object) -> AsyncIterator[str]:
    """vLLM serving `model_dir` (fp32 unless `dtype` is given) under `run_dir`; yields its URL, stops it after.
    Extra keyword arguments set RolloutConfig fields (e.g. extra_args=[...])."""
    ro = RolloutConfig(dtype=str(rollout.pop("dtype", "float32")), max_model_len=max_model_len, **rollout)  # type: ignore[arg-type]
    run_dir.mkdir(parents=True, exist_ok=True)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    cmd = vllm_command(ro, model_dir, "127.0.0.1", port, cpu=True)
    # The session's shared vLLM cache where the tests set one (tests/conftest.py), as a worker's config would.
    env = vllm_env(run_dir, cache_dir=os.environ.get(f"{ENV_PREFIX}rollout__vllm_cache_dir", ""))
    vllm = VllmProcess(cmd, env, url, run_dir / "vllm.log", f"[vllm {model_dir.name}]")
    await vllm.start()
    try:
        async with aiohttp.ClientSession() as session:
            await wait_ready(session, vllm, ro.served_model_name, timeout_s=300)
        yield url
    finally:
        await vllm.stop()


async def served_prompt_logprobs(url: str, tokens: Sequence[int], model: str = "policy") -> list[float]:
    """vLLM's log-prob of each prompt token after the first, given the ones before it."""
    body = {
        "model": model,
        "prompt": list(tokens),
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
    }
    async with aiohttp.ClientSession() as session, session.post(f"{url}/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        data = await r.json()
    entries = data["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(tokens)
    return [entry[str(tok)]["logprob"] for tok, entry in zip(tokens[1:], entries[1:], strict=True)]


def hf_prompt_logprobs(hf_model: torch.nn.Module, tokens: Sequence[int]) -> list[float]:
    """transformers' log-prob of each prompt token after the first (fp64 softmax over its logits)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([list(tokens)])).logits[0].double()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i, t].item() for i, t in enumerate(tokens[1:])]
