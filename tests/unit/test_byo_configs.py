"""configs/byo-*.toml, one per supported family: with rollout.model set to that family's HF directory (a tiny
one written by transformers, passed with --set as a user would) the trainer's model comes from its
config.json, starts from its weights with logits equal to transformers', and the placeholder path of the file
itself is refused with the fix."""

from pathlib import Path

import pytest
import torch

from common.config import ConfigError, load_config
from tests.support.hf_dirs import tiny_deepseek_v3_dir, tiny_mixtral_dir, tiny_qwen3_dir
from trainer.hf_run import config_for_hf_model
from trainer.setup import initial_model

transformers = pytest.importorskip("transformers")

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
FAMILIES = {
    "byo-qwen3-moe": ("qwen3_moe", tiny_qwen3_dir),
    "byo-deepseek-v3": ("deepseek_v3", tiny_deepseek_v3_dir),
    "byo-mixtral": ("mixtral", tiny_mixtral_dir),
}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_config_runs_the_directory_it_is_given(name, tmp_path):
    arch, write = FAMILIES[name]
    model_dir = write(tmp_path / "model")
    cfg = config_for_hf_model(load_config(CONFIGS / f"{name}.toml", [f"rollout.model={model_dir}"], environ={}))
    assert cfg.trainer.model.arch == arch and cfg.trainer.init == str(model_dir)
    assert cfg.rollout.chat_template == "auto"
    ours = initial_model(cfg, torch.device("cpu")).eval()
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = torch.randint(0, 128, (2, 19), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        assert (ours(tokens) - hf(tokens).logits).abs().max().item() <= 1e-5


@pytest.mark.parametrize("name", list(FAMILIES))
def test_the_placeholder_path_is_refused_with_the_fix(name):
    cfg = load_config(CONFIGS / f"{name}.toml", environ={})
    with pytest.raises(ConfigError, match="HF checkpoint directory with a config.json"):
        config_for_hf_model(cfg)
