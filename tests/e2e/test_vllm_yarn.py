"""vLLM (CPU build) serves an exported tiny YaRN DeepSeek-V3 checkpoint as transformers computes it: prompt
log-probs over 200 tokens, far past the 32-token original context, equal within 1e-4 (fp32). The mscale terms
are unequal (1 and 0.5), so both YaRN magnitudes, on cos/sin and on MLA's softmax scale, are in play. One vLLM
launch."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.config import ModelConfig
from tests.support.served_hf import hf_prompt_logprobs, serve, served_prompt_logprobs
from trainer.hf import export_hf
from trainer.model import build_model
from trainer.tinykit import build_tokenizer, check_cpu_servable, vocabulary

pytestmark = [pytest.mark.slow]

LOGPROB_TOL = 1e-4
# vLLM serves no further than factor * original positions: 256.
CFG = ModelConfig(
    arch="deepseek_v3",
    rope_scaling="yarn",
    rope_factor=8.0,
    rope_original_max_len=32,
    rope_mscale=1.0,
    rope_mscale_all_dim=0.5,
    max_seq_len=256,
)


def _export(cfg: ModelConfig, out, noise_seed: int = 1):
    """Seeded init plus noise (attention far from uniform, so positions matter), exported with the tiny tokenizer."""
    model = build_model(cfg, seed=7)
    g = torch.Generator().manual_seed(noise_seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)
    export_hf(model, out, extra={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    build_tokenizer(out)
    return out


async def test_vllm_serves_an_exported_yarn_deepseek_with_transformers_prompt_logprobs(tmp_path, short_root):
    from transformers import AutoModelForCausalLM

    check_cpu_servable(CFG)
    model_dir = _export(CFG, tmp_path / "yarn-deepseek")
    tokens = torch.randint(0, len(vocabulary()), (200,), generator=torch.Generator().manual_seed(3)).tolist()
    # torch work before vLLM starts: next to a busy engine on two cores it is many times slower.
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf_prompt_logprobs(hf, tokens)
    # The same weights without YaRN give other log-probs: the comparison below can tell.
    no_yarn = replace(CFG, rope_scaling="none", rope_factor=1.0, rope_original_max_len=0, rope_mscale_all_dim=0.0)
    plain = AutoModelForCausalLM.from_pretrained(_export(no_yarn, tmp_path / "plain"), dtype=torch.float32).eval()
    without_yarn = hf_prompt_logprobs(plain, tokens)
    assert max(abs(a - b) for a, b in zip(expected, without_yarn, strict=True)) > 100 * LOGPROB_TOL

    async with serve(model_dir, short_root / "run", max_model_len=CFG.max_seq_len) as url:
        served = await served_prompt_logprobs(url, tokens)

    diffs = [abs(a - b) for a, b in zip(served, expected, strict=True)]
    print(f"max |log-prob diff| vLLM vs transformers over {len(diffs)} positions: {max(diffs):.3g}")
    assert max(diffs) <= LOGPROB_TOL, [round(d, 6) for d in diffs]
