"""`slipstream convert` (trainer/convert.py), both directions, through the command line: an HF directory
written by transformers -> our checkpoint -> HF gives transformers the same logits (and the same tensors, with
the tokenizer and chat template carried); a training checkpoint -> HF -> our checkpoint gives our model the
same logits; bfloat16 output, --fp8 passed through, and the refusals."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from common.config import Config, ModelConfig, to_toml
from common.runs.cli import main as slipstream
from tests.support.hf_dirs import tiny_qwen3_dir
from trainer import convert as convert_module
from trainer.checkpoint import TrainState, load_model_weights, save_checkpoint
from trainer.model import build_model
from trainer.optim import Optimizer
from trainer.tinykit import CHAT_TEMPLATE

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 128, (2, 13), generator=torch.Generator().manual_seed(6))


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            out |= {n: st.get_tensor(n) for n in st.keys()}
    return out


def _hf_logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()(TOKENS).logits


def test_hf_to_checkpoint_and_back(tmp_path):
    src = tiny_qwen3_dir(tmp_path / "src")
    assert slipstream(["convert", str(src), str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / ".metadata").is_file()
    assert slipstream(["convert", str(tmp_path / "ckpt"), str(tmp_path / "back")]) == 0
    back = tmp_path / "back"
    assert torch.equal(_hf_logits(src), _hf_logits(back))
    original, again = _tensors(src), _tensors(back)
    assert sorted(original) == sorted(again)
    assert all(torch.equal(original[n], again[n]) for n in original)
    assert transformers.AutoTokenizer.from_pretrained(back).chat_template == CHAT_TEMPLATE
    assert json.loads((back / "config.json").read_text())["eos_token_id"] == 2


def test_training_checkpoint_to_hf_and_back(tmp_path):
    cfg = Config()
    cfg.trainer.model = replace(ModelConfig(), num_layers=3, q_lora_rank=32)
    model = build_model(cfg.trainer.model, seed=11).eval()
    step = save_checkpoint(tmp_path / "run", model, Optimizer(model, cfg.trainer.optim), TrainState(step=5), cfg)
    config = tmp_path / "run.toml"
    config.write_text(to_toml(cfg))
    assert slipstream(["convert", str(step), str(tmp_path / "hf"), "--config", str(config)]) == 0
    assert slipstream(["convert", str(tmp_path / "hf"), str(tmp_path / "ckpt")]) == 0
    again = build_model(cfg.trainer.model, seed=None).eval()
    load_model_weights(tmp_path / "ckpt", again)
    with torch.no_grad():
        assert torch.equal(model(TOKENS), again(TOKENS))
        assert (model(TOKENS) - _hf_logits(tmp_path / "hf")).abs().max().item() <= 1e-5
    # The checkpoint's own recorded config shapes the model when --config is left out; bfloat16 weights.
    assert slipstream(["convert", str(step), str(tmp_path / "bf16"), "--dtype", "bfloat16"]) == 0
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert _tensors(tmp_path / "bf16")["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert (tmp_path / "bf16" / "tokenizer.json").is_file()  # the tiny kit's: rollout.model is a tiny-model name


def test_fp8_is_passed_to_export_hf(tmp_path, monkeypatch):
    cfg = Config()
    model = build_model(cfg.trainer.model, seed=1)
    step = save_checkpoint(tmp_path / "run", model, Optimizer(model, cfg.trainer.optim), TrainState(step=1), cfg)
    seen = {}

    def fake_export(model, out, dtype, extra, **kwargs):
        seen.update(kwargs, dtype=dtype)
        Path(out).mkdir(parents=True)

    monkeypatch.setattr(convert_module, "export_hf", fake_export)
    assert slipstream(["convert", str(step), str(tmp_path / "fp8"), "--fp8", "--dtype", "bfloat16"]) == 0
    assert seen == {"fp8_blocks": True, "dtype": "bfloat16"}


def test_refusals(tmp_path, capsys):
    src = tiny_qwen3_dir(tmp_path / "src")
    assert slipstream(["convert", str(src), str(tmp_path / "x"), "--fp8"]) == 2
    assert "--fp8: apply to DCP -> HF only" in capsys.readouterr().err
    assert slipstream(["convert", str(src), str(src)]) == 2
    assert "exists" in capsys.readouterr().err
    assert slipstream(["convert", str(tmp_path), str(tmp_path / "y")]) == 2
    assert "neither an HF directory" in capsys.readouterr().err
