"""A run whose model is an HF directory (trainer/hf_run.py): the trainer's model comes from its config.json,
trainer.init defaults to it, and a [trainer.model] field that disagrees is refused naming both values. The
directory is a tiny Qwen3-MoE written by transformers with the tiny kit's tokenizer and chat template."""

import json
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from tests.support.hf_dirs import tiny_qwen3_dir
from trainer.hf import model_config_from_hf
from trainer.hf_run import config_for_hf_model
from trainer.setup import initial_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    return tiny_qwen3_dir(tmp_path_factory.mktemp("qwen3"))


def test_model_and_init_come_from_the_directory(qwen3_dir):
    cfg = config_for_hf_model(load_config(None, [f"rollout.model={qwen3_dir}", "trainer.model.max_seq_len=256"]))
    expected = model_config_from_hf(json.loads((qwen3_dir / "config.json").read_text()), max_seq_len=256)
    assert cfg.trainer.model == expected
    assert cfg.trainer.model.arch == "qwen3_moe" and cfg.trainer.model.max_seq_len == 256
    assert cfg.trainer.init == str(qwen3_dir)
    model = initial_model(cfg, torch.device("cpu")).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert (model(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


def test_fields_that_agree_and_an_explicit_init_are_kept(qwen3_dir, tmp_path):
    overrides = [f"rollout.model={qwen3_dir}", "trainer.model.arch=qwen3_moe", "trainer.model.n_shared_experts=0"]
    cfg = config_for_hf_model(load_config(None, [*overrides, f"trainer.init={tmp_path}"]))
    assert cfg.trainer.init == str(tmp_path)
    assert cfg.trainer.model.num_kv_heads == 2


def test_a_conflicting_field_is_refused_naming_both_values(qwen3_dir):
    cfg = load_config(None, [f"rollout.model={qwen3_dir}", "trainer.model.hidden_size=96"])
    with pytest.raises(ConfigError, match=r"trainer\.model\.hidden_size = 96 but .*config\.json gives 64"):
        config_for_hf_model(cfg)


def test_a_tiny_kit_name_is_left_alone():
    cfg = load_config(None)
    assert config_for_hf_model(cfg) is cfg


def test_a_path_without_config_json_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="config.json"):
        config_for_hf_model(load_config(None, [f"rollout.model={tmp_path}"]))


def test_an_fp8_rollout_model_is_refused_naming_the_conversion(tmp_path):
    """The workers would build FP8 layers that the trainer's bf16/fp32 pushes cannot fill: refused at start with
    the two convert commands that make a servable copy; a plain directory passes."""
    from trainer.hf import export_hf, import_hf
    from trainer.hf_run import refuse_quantized_rollout_model

    plain = tiny_qwen3_dir(tmp_path / "plain")
    refuse_quantized_rollout_model(load_config(None, [f"rollout.model={plain}"]))
    fp8 = export_hf(import_hf(plain), tmp_path / "fp8", dtype="bfloat16", fp8_blocks=True)
    with pytest.raises(ConfigError, match=r"FP8 block-quantized.*slipstream convert .*--dtype bfloat16"):
        refuse_quantized_rollout_model(load_config(None, [f"rollout.model={fp8}"]))
