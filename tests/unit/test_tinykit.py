"""The tiny-model kit: an offline tokenizer with a chat template, content-addressed checkpoint
caching, and clear errors for shapes vLLM's CPU build cannot serve or mismatched architectures; the
worker's vLLM command line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from common.config import Config, ConfigError, ModelConfig, load_config
from rollout.worker import vllm_command, vllm_env
from trainer.tinykit import build_tokenizer, resolve_model, tiny_checkpoint, vocabulary


def test_tokenizer_loads_offline_round_trips_and_applies_its_chat_template(tmp_path: Path):
    from transformers import AutoTokenizer

    build_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "what is 12+7? Solve it."
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_ids_to_tokens(ids[:4]) == ["what", " ", "is", " "]
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2) and tok.unk_token == "<unk>"
    assert len(tok) == len(vocabulary())
    chat = tok.apply_chat_template([{"role": "user", "content": "1+1"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|user|>1+1\n<|assistant|>"


@pytest.mark.timeout(120)
def test_checkpoints_are_cached_by_content_and_regenerated_only_when_inputs_differ(tmp_path: Path):
    m = ModelConfig()
    first = tiny_checkpoint(m, 0, tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_checkpoint(m, 0, tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten
    other = tiny_checkpoint(m, 1, tmp_path)
    assert other != first and (other / "model.safetensors").read_bytes() != (first / "model.safetensors").read_bytes()
    assert {p.name for p in first.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}


def test_unservable_shapes_and_mismatched_architectures_are_rejected(tmp_path: Path):
    with pytest.raises(ConfigError, match="multiple of 32"):
        tiny_checkpoint(dataclasses.replace(ModelConfig(), hidden_size=48), 0, tmp_path)
    cfg = Config()
    cfg.rollout.model = "tiny-qwen3"
    with pytest.raises(ConfigError, match="trainer.model.arch=qwen3_moe"):
        resolve_model(cfg, tmp_path)
    cfg.rollout.model = str(tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="neither a tiny model"):
        resolve_model(cfg, tmp_path)


def test_vllm_command_enables_rl_serving_and_passes_engine_args_through(tmp_path: Path):
    cfg = Config()
    cfg.rollout.extra_args = ["--max-num-seqs", "64"]
    model = tiny_checkpoint(cfg.trainer.model, 0, tmp_path)
    cmd = vllm_command(cfg.rollout, model, "127.0.0.1", 8000, cpu=True)
    joined = " ".join(cmd)
    for flag in (
        '--weight-transfer-config {"backend": "file"}',
        "--logprobs-mode processed_logprobs",
        "--enable-scale-out",
        "--kv-cache-memory-bytes 134217728",
        '"-rotary_embedding"',
        "--attention-backend CPU_MLA",
        "--tensor-parallel-size 1",
        "--max-num-seqs 64",
    ):
        assert flag in joined
    cfg.rollout.weight_backend = "nccl"
    gpu = " ".join(vllm_command(cfg.rollout, model, "127.0.0.1", 8000, cpu=False))
    assert '{"backend": "nccl"}' in gpu and "--gpu-memory-utilization 0.9" in gpu and "kv-cache-memory" not in gpu


def test_vllm_returns_routed_experts_for_moe_checkpoints_unless_turned_off(tmp_path: Path):
    cfg = Config()
    moe = tiny_checkpoint(cfg.trainer.model, 0, tmp_path)
    assert "--enable-return-routed-experts" in vllm_command(cfg.rollout, moe, "127.0.0.1", 8000, cpu=True)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "num_experts": 0}))
    assert "--enable-return-routed-experts" not in vllm_command(cfg.rollout, dense, "127.0.0.1", 8000, cpu=True)
    cfg.rollout.return_routed_experts = False
    assert "--enable-return-routed-experts" not in vllm_command(cfg.rollout, moe, "127.0.0.1", 8000, cpu=True)


def test_tiny_mixtral_is_a_mixtral_checkpoint_served_with_routed_experts_and_no_deepseek_flags(tmp_path: Path):
    cfg = Config()
    cfg.rollout.model = "tiny-mixtral"
    with pytest.raises(ConfigError, match="trainer.model.arch=mixtral"):
        resolve_model(cfg, tmp_path)
    cfg.trainer.model = ModelConfig(arch="mixtral", first_k_dense=0, n_shared_experts=0)
    model = resolve_model(cfg, tmp_path)
    hf = json.loads((model / "config.json").read_text())
    assert (hf["architectures"], hf["num_local_experts"]) == (["MixtralForCausalLM"], 8)
    joined = " ".join(vllm_command(cfg.rollout, model, "127.0.0.1", 8000, cpu=True))
    assert "--enable-return-routed-experts" in joined
    assert "rotary_embedding" not in joined and "CPU_MLA" not in joined


def test_vllm_keeps_its_cache_under_the_run_dir_unless_runs_share_one(short_root: Path, monkeypatch):
    """vLLM's cache root is <run dir>/cache/vllm by default, else rollout.vllm_cache_dir (made absolute, created),
    and the config takes that directory from the environment as every role process does; the other caches and
    temporary files stay under the run dir either way."""
    run_dir = short_root / "run"
    env = vllm_env(run_dir, base={})
    assert env["VLLM_CACHE_ROOT"] == str(run_dir / "cache" / "vllm")
    monkeypatch.chdir(short_root)
    shared = vllm_env(run_dir, base={}, cache_dir="shared/vllm")
    assert (
        shared["VLLM_CACHE_ROOT"] == str(short_root / "shared" / "vllm") and (short_root / "shared" / "vllm").is_dir()
    )
    assert {k: v for k, v in shared.items() if k != "VLLM_CACHE_ROOT"} == {
        k: v for k, v in env.items() if k != "VLLM_CACHE_ROOT"
    }
    assert shared["TMPDIR"] == str(run_dir / "cache" / "tmp")
    monkeypatch.setenv("SLIPSTREAM__rollout__vllm_cache_dir", str(short_root / "elsewhere"))
    config = short_root / "run.toml"
    config.write_text('[rollout]\nmodel = "tiny-deepseek"\n')
    assert load_config(config).rollout.vllm_cache_dir == str(short_root / "elsewhere")
