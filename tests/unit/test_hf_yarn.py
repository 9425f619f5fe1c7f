"""YaRN RoPE against transformers: tiny DeepSeek-V3 and Qwen3-MoE models whose original context (32) is far
shorter than the 160 tokens they read, so the interpolated frequencies and the magnitude corrections decide the
logits. Ours equal transformers' within 1e-5 (fp32) exporting and importing, both spellings of the HF config
are read, import then export gives the checkpoint's tensors back, and the configs transformers and vLLM would
read differently are refused by name."""

import json
from dataclasses import replace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from common.config import ConfigError, ModelConfig
from tests.support.hf_dirs import randomize_hf
from trainer.hf import HFFormatError, export_hf, hf_config, import_hf, model_config_from_hf
from trainer.model import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-5
YARN = dict(rope_scaling="yarn", rope_factor=8.0, rope_original_max_len=32, max_seq_len=256)
CONFIGS = {
    # The released DeepSeek-V3 / Kimi-K2 magnitudes: cos/sin unscaled, all of it in MLA's softmax scale.
    "deepseek_v3": ModelConfig(
        arch="deepseek_v3",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        q_lora_rank=32,
        num_layers=3,
        rope_mscale=1.0,
        rope_mscale_all_dim=1.0,
        **YARN,
    ),
    # Unequal mscale terms: cos/sin scaled by m(1) / m(0.5) and the softmax by m(0.5)^2, both in play.
    "deepseek_v3_mscale": ModelConfig(arch="deepseek_v3", rope_mscale=1.0, rope_mscale_all_dim=0.5, **YARN),
    # Qwen3's YaRN: cos/sin scaled by 1 + 0.1 ln(factor), the softmax untouched.
    "qwen3_moe": ModelConfig(arch="qwen3_moe", n_shared_experts=0, **YARN),
    # Mixtral's YaRN is Qwen3's (cos/sin scaled), on GQA without q/k norm.
    "mixtral": ModelConfig(arch="mixtral", n_shared_experts=0, first_k_dense=0, **YARN),
}
# The DeepSeek-V3 release's config.json spelling (transformers 4): rope_scaling with "type", no rope_parameters.
RELEASED_ROPE_SCALING = {
    "beta_fast": 32,
    "beta_slow": 1,
    "factor": 8.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 32,
    "type": "yarn",
}


def _tokens():
    return torch.randint(0, 128, (2, 160), generator=torch.Generator().manual_seed(2))


def _ours(name: str):
    model = build_model(CONFIGS[name], seed=7)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)  # attention far from uniform: positions matter
    return model.eval()


def _hf_random(name: str, tmp_path, rope_spelling: str = "rope_parameters"):
    """A transformers model of CONFIGS[name], randomly initialised, saved to tmp_path with the given spelling."""
    hf_cfg = transformers.AutoConfig.for_model(**hf_config(CONFIGS[name]))
    hf = randomize_hf(transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32), seed=5)
    hf.save_pretrained(tmp_path)
    if rope_spelling == "rope_scaling":
        raw = json.loads((tmp_path / "config.json").read_text())
        raw.pop("rope_parameters", None)
        raw["rope_scaling"] = RELEASED_ROPE_SCALING
        raw["rope_theta"] = CONFIGS[name].rope_theta
        (tmp_path / "config.json").write_text(json.dumps(raw))
    return hf


def _max_diff(ours, hf) -> float:
    with torch.no_grad():
        return (ours(_tokens()) - hf(_tokens()).logits).abs().max().item()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_exported_yarn_model_has_transformers_logits(name, tmp_path):
    ours = _ours(name)
    export_hf(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf.config.rope_parameters["rope_type"] == "yarn"
    assert _max_diff(ours, hf) <= TOL


@pytest.mark.parametrize(
    "name, spelling",
    [("deepseek_v3", "rope_parameters"), ("deepseek_v3", "rope_scaling"), ("deepseek_v3_mscale", "rope_parameters")]
    + [("qwen3_moe", "rope_parameters"), ("mixtral", "rope_parameters")],
)
def test_transformers_yarn_checkpoint_imports_with_its_logits_and_exports_its_tensors(name, spelling, tmp_path):
    hf = _hf_random(name, tmp_path / "hf", spelling)
    ours = import_hf(tmp_path / "hf").eval()
    rope = [f for f in vars(CONFIGS[name]) if f.startswith("rope_")]
    assert {f: getattr(ours.cfg, f) for f in rope} == {f: getattr(CONFIGS[name], f) for f in rope}
    assert _max_diff(ours, hf) <= TOL
    export_hf(ours, tmp_path / "ours")
    theirs = load_file(str(tmp_path / "hf" / "model.safetensors"))
    with safe_open(str(tmp_path / "ours" / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == set(theirs)
        for key, t in theirs.items():
            assert torch.equal(f.get_tensor(key), t), key


def test_yarn_magnitude_and_frequencies_both_change_the_logits(tmp_path):
    """The equality above is not vacuous: without YaRN, or with YaRN's frequencies but the plain softmax
    scale (mscale ignored), the same weights give logits far from transformers'."""
    ours = _ours("deepseek_v3")
    export_hf(ours, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    no_yarn = replace(
        CONFIGS["deepseek_v3"], rope_scaling="none", rope_factor=1.0, rope_original_max_len=0, rope_mscale_all_dim=0.0
    )
    plain = build_model(no_yarn, seed=None)
    plain.load_state_dict(ours.state_dict())
    assert _max_diff(plain.eval(), hf) > 100 * TOL
    qk_dim = CONFIGS["deepseek_v3"].qk_nope_head_dim + CONFIGS["deepseek_v3"].qk_rope_head_dim
    for block in ours.model.layers:
        assert block.self_attn.scale > qk_dim**-0.5 * 1.4  # m(1)^2 = (1 + 0.1 ln 8)^2 = 1.46
        block.self_attn.scale = qk_dim**-0.5
    assert _max_diff(ours, hf) > 100 * TOL


def test_multi_token_prediction_layers_are_skipped_with_a_note(tmp_path, caplog):
    ours = _ours("deepseek_v3")
    export_hf(ours, tmp_path, extra={"num_nextn_predict_layers": 1})
    tensors = load_file(str(tmp_path / "model.safetensors"))
    last = CONFIGS["deepseek_v3"].num_layers - 1
    mtp = {k.replace(f"layers.{last}.", "layers.3."): v.clone() for k, v in tensors.items() if f"layers.{last}." in k}
    mtp["model.layers.3.eh_proj.weight"] = torch.zeros(64, 128)
    save_file(tensors | mtp, str(tmp_path / "model.safetensors"))
    with caplog.at_level("INFO", logger="trainer.hf_stream"):
        imported = import_hf(tmp_path).eval()
    assert f"skipped {len(mtp)} tensors of layers [3] beyond the decoder's 3" in caplog.text
    with torch.no_grad():
        assert torch.equal(imported(_tokens()), ours(_tokens()))


@pytest.mark.parametrize("kind", ["linear", "dynamic", "llama3", "longrope"])
def test_other_rope_types_are_refused_by_name(kind):
    hf = hf_config(ModelConfig())
    hf["rope_scaling"] = {"type": kind, "factor": 2.0}
    with pytest.raises(HFFormatError, match=f"rope type '{kind}'"):
        model_config_from_hf(hf)


@pytest.mark.parametrize(
    "change, field",
    [
        ({"mscale": 1.0, "mscale_all_dim": None}, None),  # mscale 1 alone: both readers agree
        ({"mscale": 0.707, "mscale_all_dim": None}, "mscale = 0.707 without mscale_all_dim"),
        ({"mscale": None, "mscale_all_dim": 1.0}, "mscale_all_dim = 1.0 without mscale"),
        ({"attention_factor": 1.2}, "attention_factor"),
        ({"truncate": False}, "truncate"),
        ({"factor": 1.0}, "rope_factor = 1.0"),
    ],
)
def test_yarn_parameters_that_transformers_and_vllm_read_differently_are_refused(change, field):
    hf = hf_config(CONFIGS["deepseek_v3"])
    hf["rope_scaling"] = {k: v for k, v in {**RELEASED_ROPE_SCALING, **change}.items() if v is not None}
    if field is None:
        assert model_config_from_hf(hf).rope_mscale == 1.0
        return
    with pytest.raises(HFFormatError, match=field):
        model_config_from_hf(hf)


def test_yarn_factor_defaults_to_the_context_ratio_as_in_transformers():
    hf = hf_config(CONFIGS["deepseek_v3"])
    hf["rope_scaling"] = {k: v for k, v in RELEASED_ROPE_SCALING.items() if k != "factor"}
    assert model_config_from_hf(hf).rope_factor == 256 / 32


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"rope_scaling": "yarn", "rope_original_max_len": 32, "max_seq_len": 32}, "rope_factor"),
        ({"rope_scaling": "yarn", "rope_factor": 4.0, "max_seq_len": 32}, "rope_original_max_len"),
        ({**YARN, "max_seq_len": 512}, "max_seq_len = 512 exceeds"),
        ({**YARN, "rope_beta_fast": 0.5}, "rope_beta_slow"),
        ({**YARN, "rope_mscale": 0.707}, "rope_mscale = 0.707 with rope_mscale_all_dim = 0"),
        ({**YARN, "arch": "qwen3_moe", "rope_mscale_all_dim": 1.0}, "rope_mscale_all_dim"),
        ({"rope_factor": 4.0}, "rope_factor = 4.0 has no effect with rope_scaling = 'none'"),
    ],
)
def test_model_config_refuses_inconsistent_rope_fields_naming_them(fields, named):
    with pytest.raises(ConfigError, match=named):
        ModelConfig(**fields).check()


# Released rope settings at their real sizes: DeepSeek-V3 / R1, Kimi-K2 (beta_fast = beta_slow = 1, a step
# instead of a ramp) and Qwen3's suggested long context (mscale fields absent).
RELEASED = {
    "deepseek_v3": (
        "deepseek_v3",
        64,
        163840,
        {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}
        | {"mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 10000.0},
    ),
    "kimi_k2": (
        "deepseek_v3",
        64,
        131072,
        {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096, "beta_fast": 1.0, "beta_slow": 1.0}
        | {"mscale": 1.0, "mscale_all_dim": 1.0, "rope_theta": 50000.0},
    ),
    "qwen3_moe": (
        "qwen3_moe",
        128,
        131072,
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768, "rope_theta": 1000000.0},
    ),
}


@pytest.mark.parametrize("name", list(RELEASED))
def test_released_yarn_settings_give_transformers_frequencies_and_magnitudes(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    from trainer.model.rope import rope_tables, yarn_of

    arch, rope_dim, max_pos, rope = RELEASED[name]
    shape = dict(qk_rope_head_dim=rope_dim, head_dim=rope_dim, max_seq_len=max_pos)
    ours_cfg = ModelConfig(arch=arch, n_shared_experts=int(arch == "deepseek_v3"), **shape)
    hf = hf_config(ours_cfg) | {"rope_scaling": rope, "rope_parameters": None, "rope_theta": rope["rope_theta"]}
    cfg = model_config_from_hf(hf)
    theirs = transformers.AutoConfig.for_model(**hf)
    inv_freq, cos_sin_scale = ROPE_INIT_FUNCTIONS["yarn"](theirs, "cpu")
    yarn = yarn_of(cfg)
    assert yarn is not None
    assert torch.equal(rope_tables(rope_dim, 2, cfg.rope_theta, yarn=yarn)[1], inv_freq)
    assert yarn.cos_sin_scale == pytest.approx(cos_sin_scale, rel=1e-12)
    if arch == "deepseek_v3":
        assert yarn.softmax_scale == pytest.approx(yarn_apply_mscale(theirs.rope_parameters, 1.0), rel=1e-12)


def test_kimi_k2_model_type_with_deepseek_v3_architecture_imports_as_deepseek_v3():
    """Kimi-K2's config.json says model_type "kimi_k2" and architectures ["DeepseekV3ForCausalLM"]: the
    DeepSeek-V3 architecture, YaRN included; another architecture under that model_type stays refused."""
    hf = {**hf_config(CONFIGS["deepseek_v3"]), "model_type": "kimi_k2"}
    assert model_config_from_hf(hf) == model_config_from_hf(hf_config(CONFIGS["deepseek_v3"]))
    with pytest.raises(HFFormatError, match="kimi_k2"):
        model_config_from_hf({**hf, "architectures": ["KimiK2ForCausalLM"]})
