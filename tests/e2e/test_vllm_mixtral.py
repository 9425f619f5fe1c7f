"""Mixtral (issue 34's softmax-routed family without shared experts) served by the real vLLM CPU build from
our export: its prompt log-probs equal transformers' on the exported checkpoint (fp32, within 1e-4); the
experts it routes every position to are our router's; a weight version written by our export and pushed
through the file engine (the RL publish path: Mixtral's released names into vLLM's loader, the CPU MoE
re-pack) is then served as transformers computes that version. One vLLM launch (tests/support/served_hf.py)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import numpy as np
import pytest
import torch
from support.served_hf import hf_prompt_logprobs, serve, served_prompt_logprobs
from test_routed_experts import mismatches, trainer_routing

from common.config import ModelConfig
from common.weights.workers import apply_version, label_version
from rollout.client import RolloutClient
from trainer.hf import export_hf, import_hf, vllm_cpu_problems
from trainer.model import Transformer, build_model
from trainer.model.moe import refresh_expert_weight_copies
from trainer.tinykit import build_tokenizer

pytestmark = [pytest.mark.slow]

transformers = pytest.importorskip("transformers")

LOGPROB_TOL = 1e-4
# GQA 4:2 with head size 32, 8 experts of 32 top-2, every layer MoE: shapes vLLM's CPU kernels run.
CFG = ModelConfig(arch="mixtral", first_k_dense=0, n_shared_experts=0, num_layers=3, rope_theta=1e6)
# User turns of arithmetic, chat-formatted by the tiny tokenizer's template.
QUESTIONS = ["what is 12+7? solve", "compute the sum of 9 plus 15, then 23*4. think step by step"]


def _model(seed: int) -> Transformer:
    """Our Mixtral with N(0, 0.08) weights: large enough that attention, routing and experts all shape the
    log-probs (the kit's 0.02 leaves them near uniform, where a wrong layer could hide)."""
    model = build_model(CFG, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.08)
    refresh_expert_weight_copies(model)
    return model.eval()


def _prompts(tokenizer_dir: Path) -> list[list[int]]:
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [
        list(tok.apply_chat_template(c, add_generation_prompt=True, tokenize=True, return_dict=False)) for c in chats
    ]


def _export(seed: int, out: Path, prompts: list[list[int]]) -> tuple[Path, list[list[float]]]:
    """Export our model of `seed` with the tiny tokenizer; (the directory, transformers' prompt log-probs)."""
    export_hf(_model(seed), out, extra={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    build_tokenizer(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    return out, [hf_prompt_logprobs(hf, p) for p in prompts]


def _worst(served: list[list[float]], expected: list[list[float]]) -> float:
    return max(abs(a - b) for s, e in zip(served, expected, strict=True) for a, b in zip(s, e, strict=True))


@pytest.mark.timeout(400)
async def test_vllm_serves_our_mixtral_export_and_a_pushed_version_as_transformers_computes_them(
    tmp_path, tmp_path_factory
):
    assert vllm_cpu_problems(CFG) == []
    # All torch work first: next to a busy vLLM engine on two cores it runs many times slower.
    build_tokenizer(tmp_path / "tokenizer")
    prompts = _prompts(tmp_path / "tokenizer")
    assert all(len(p) > 12 for p in prompts)
    first, first_hf = _export(11, tmp_path / "first", prompts)
    pushed, pushed_hf = _export(12, tmp_path / "pushed", prompts)
    ours = import_hf(first).eval()
    spread = max(lp for p in first_hf for lp in p) - min(lp for p in first_hf for lp in p)
    assert spread > 1.0, f"log-probs within {spread:.3f} nats: too uniform for the comparison to mean much"

    # The run dir under a short name: vLLM's IPC socket paths must stay below 108 bytes.
    async with serve(first, tmp_path_factory.mktemp("mx")) as url:
        served = [await served_prompt_logprobs(url, p) for p in prompts]
        worst_first = _worst(served, first_hf)
        async with aiohttp.ClientSession() as session:
            await label_version(session, url, 0)  # as a worker does at start: samples carry their version
        async with RolloutClient("policy", url=url) as client:
            samples = await client.generate(prompts[0], n=2, max_tokens=16, seed=3, ignore_eos=True)
        async with aiohttp.ClientSession() as session:
            await apply_version(session, url, 1, str(pushed), "wait")
        served_pushed = [await served_prompt_logprobs(url, p) for p in prompts]
    worst_pushed = _worst(served_pushed, pushed_hf)
    print(f"max |served - transformers| log-prob: first {worst_first:.3g}, pushed {worst_pushed:.3g}")
    assert worst_first <= LOGPROB_TOL
    assert worst_pushed <= LOGPROB_TOL
    assert _worst(served_pushed, first_hf) > 0.1, "the pushed version did not change what is served"

    reference = trainer_routing(ours, samples)
    for s in samples:
        assert s.routed_experts is not None and s.routed_experts.shape == (
            len(prompts[0]) + 16 - 1,
            CFG.num_layers,
            CFG.num_experts_per_tok,
        )
        assert len({tuple(np.sort(r, axis=-1).ravel()) for r in s.routed_experts}) > 1, "every position alike"
    bad = {i: mismatches(s, reference, i) for i, s in enumerate(samples)}
    assert not any(bad.values()), f"(position, layer) pairs where vLLM's experts differ from our router's: {bad}"
