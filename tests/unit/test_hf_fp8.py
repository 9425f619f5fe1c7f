"""FP8 block-quantized HF checkpoints (DeepSeek-V3's released layout): a transformers checkpoint quantized by
our exporter matches an independent per-block quantization; imported, its logits equal transformers' on the
dequantized weights (fp32, 1e-5); import -> export gives the same bytes; a bad scale is refused by name.
Shapes are not multiples of 128, so edge blocks are partial."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from common.config import ModelConfig
from tests.support.hf_dirs import randomize_hf
from trainer.experts.fp8 import quantize_blocks
from trainer.hf import export_hf, hf_config, import_hf
from trainer.hf_fp8 import FP8FormatError, dequantize, is_quantized, off_recipe_blocks
from trainer.model import build_model

transformers = pytest.importorskip("transformers")

TOL = 1e-5
# hidden 160, q_lora 144, intermediate 288, moe_intermediate 136: one full 128 block and a partial one.
HF_CONFIG = hf_config(
    ModelConfig(
        arch="deepseek_v3",
        vocab_size=128,
        hidden_size=160,
        num_layers=3,
        first_k_dense=1,
        intermediate_size=288,
        moe_intermediate_size=136,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_heads=2,
        q_lora_rank=144,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
    )
)


def _hf_model():
    hf = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(**HF_CONFIG), dtype=torch.float32
    )
    # Per-tensor magnitudes spread over decades, so block scales differ in exponent as well.
    return randomize_hf(hf, seed=5, std=lambda: 0.05 * 4 ** torch.randint(-3, 3, ()).item())


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    """(transformers' fp32 checkpoint dir, its released FP8 layout written by our exporter)."""
    root = tmp_path_factory.mktemp("fp8")
    _hf_model().save_pretrained(root / "fp32")
    export_hf(import_hf(root / "fp32"), root / "fp8", dtype="bfloat16", fp8_blocks=True)
    return root / "fp32", root / "fp8"


def _reference_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The released recipe block by block, written the plain way: scale = amax / 448, q = e4m3(w / scale)."""
    rows, cols = (-(-n // 128) for n in w.shape)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    scale = torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            block = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128].float()
            s = block.abs().max() / torch.tensor(448.0)
            scale[i, j] = s
            q[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128] = (block / s).to(torch.float8_e4m3fn)
    return q, scale


def _reference_dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    w = torch.empty(q.shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = (slice(i * 128, (i + 1) * 128), slice(j * 128, (j + 1) * 128))
            w[blk] = q[blk].float() * scale[i, j]
    return w


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def test_exporter_quantizes_what_transformers_quantizes_as_the_plain_recipe_does(released):
    fp32_dir, fp8_dir = released
    fp32, fp8 = load_file(str(fp32_dir / "model.safetensors")), load_file(str(fp8_dir / "model.safetensors"))
    # transformers' FineGrainedFP8 converts every plain nn.Linear but lm_head; its experts are stacked.
    hf = _hf_model()
    linear = {f"{n}.weight" for n, m in hf.named_modules() if type(m) is nn.Linear and n != "lm_head"}
    experts = {n for n in fp8 if ".mlp.experts." in n and n.endswith("proj.weight")}
    assert {n for n, t in fp8.items() if t.dtype == torch.float8_e4m3fn} == linear | experts
    assert all(is_quantized(n, 2) for n in linear | experts)
    assert not any(is_quantized(n, fp32[n].dim()) for n in fp32 if n not in linear | experts)
    for name in sorted(linear | experts):
        q, scale = _reference_quantize(fp32[name])
        assert _bytes(fp8[name]) == _bytes(q), name
        assert torch.equal(fp8[name + "_scale_inv"], scale), name
    assert fp8["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert fp8["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert fp8["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert fp8["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (1, 2)  # [80, 160]
    assert fp8["model.layers.0.mlp.gate_proj.weight_scale_inv"].shape == (3, 2)  # [288, 160]
    quant = json.loads((fp8_dir / "config.json").read_text())["quantization_config"]
    assert quant == {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [128, 128],
    }


def test_imported_logits_equal_transformers_on_the_dequantized_weights(released, tmp_path):
    _, fp8_dir = released
    fp8 = load_file(str(fp8_dir / "model.safetensors"))
    plain = {
        n: _reference_dequantize(t, fp8[n + "_scale_inv"]) if t.dtype == torch.float8_e4m3fn else t.float()
        for n, t in fp8.items()
        if not n.endswith("_scale_inv")
    }
    save_file(plain, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ours = import_hf(fp8_dir).eval()
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref, got = hf(tokens).logits, ours(tokens)
        diff = (got - ref).abs().max().item()
        unquantized = (import_hf(released[0]).eval()(tokens) - ref).abs().max().item()
    assert diff <= TOL
    assert unquantized > 100 * TOL  # quantization moved the logits: the comparison sees the dequantized weights


def test_a_sharded_checkpoint_with_scales_in_other_files_streams_to_the_same_model(released, tmp_path):
    """Released checkpoints are split over many files and a weight's weight_scale_inv may sit in another file
    than the weight: the streamed import (trainer/hf_stream.py) reads each scale with its weight wherever it is."""
    _, fp8_dir = released
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    scales = {n: t for n, t in tensors.items() if n.endswith("_scale_inv")}
    weights = sorted(n for n in tensors if n not in scales)
    save_file({n: tensors[n] for n in weights[::2]}, str(tmp_path / "model-00001-of-00003.safetensors"))
    save_file({n: tensors[n] for n in weights[1::2]}, str(tmp_path / "model-00002-of-00003.safetensors"))
    save_file(scales, str(tmp_path / "model-00003-of-00003.safetensors"))
    (tmp_path / "config.json").write_text((fp8_dir / "config.json").read_text())
    whole, split = import_hf(fp8_dir), import_hf(tmp_path)
    for (name, a), (_, b) in zip(whole.state_dict().items(), split.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_import_then_export_gives_the_same_bytes_and_scales(released, tmp_path):
    _, fp8_dir = released
    export_hf(import_hf(fp8_dir), tmp_path, dtype="bfloat16", fp8_blocks=True)
    assert (tmp_path / "model.safetensors").read_bytes() == (fp8_dir / "model.safetensors").read_bytes()
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((fp8_dir / "config.json").read_text())


def test_fp8_expert_copy_of_imported_masters_keeps_the_released_values(released):
    """trainer.experts.precision = "fp8" requantizes the masters every step (trainer/experts/fp8.py): on an
    imported checkpoint that gives back the released e4m3 bytes, with scales within 1 ulp (it multiplies by 1/448).
    down_proj only: the stacked gate_up's 128-row blocks straddle gate and up unless moe_intermediate_size is a
    multiple of 128 (it is in the released DeepSeek-V3, 2048; not here, 136)."""
    _, fp8_dir = released
    fp8 = load_file(str(fp8_dir / "model.safetensors"))
    down = import_hf(fp8_dir).model.layers[1].mlp.experts.down_proj.detach()
    q, scale = quantize_blocks(down)
    for e in range(down.shape[0]):
        name = f"model.layers.1.mlp.experts.{e}.down_proj.weight"
        assert _bytes(q[e]) == _bytes(fp8[name])
        ulps = (scale[e].view(torch.int32) - fp8[name + "_scale_inv"].view(torch.int32)).abs().max().item()
        assert ulps <= 1


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (
            lambda t: t.pop("model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"),
            r"experts\.3\.up_proj\.weight has no",
        ),
        (
            lambda t: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}),
            r"o_proj\.weight_scale_inv has shape \(1, 1\)",
        ),
        (
            lambda t: t.update({"model.layers.1.self_attn.q_a_proj.weight_scale_inv": torch.ones(2, 2).double()}),
            r"q_a_proj\.weight_scale_inv must be finite non-negative float32",
        ),
    ],
)
def test_a_missing_or_wrong_scale_is_refused_by_name(released, tmp_path, corrupt, message):
    _, fp8_dir = released
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    corrupt(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((fp8_dir / "config.json").read_text())
    with pytest.raises(FP8FormatError, match=message):
        import_hf(tmp_path)


def test_e4m3_tensors_without_quantization_config_are_refused(released, tmp_path):
    _, fp8_dir = released
    (tmp_path / "model.safetensors").write_bytes((fp8_dir / "model.safetensors").read_bytes())
    cfg = json.loads((fp8_dir / "config.json").read_text())
    del cfg["quantization_config"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FP8FormatError, match="no quantization_config"):
        import_hf(tmp_path)
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64], "activation_scheme": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FP8FormatError, match="weight_block_size"):
        import_hf(tmp_path)


def test_dequantize_uses_128_blocks_on_partial_edges():
    q = torch.full((130, 200), 2.0).to(torch.float8_e4m3fn)
    scale = torch.tensor([[1.0, 3.0], [5.0, 7.0]])
    w = dequantize(q, scale)
    assert (w[127, 127].item(), w[127, 128].item(), w[128, 127].item(), w[129, 199].item()) == (2.0, 6.0, 10.0, 14.0)


def test_transformers_fp8_loader_gives_our_logits_on_whole_blocks(tmp_path):
    """transformers' own FineGrainedFP8 loader (dequantize=True, CPU; needs accelerate) reads our export. Every
    dimension here is a multiple of 128: transformers 5.19 infers the block size as rows // scale rows, so on
    partial blocks it raises or dequantizes with the wrong block (0.29 logit error measured)."""
    pytest.importorskip("accelerate")
    cfg = ModelConfig(
        arch="deepseek_v3",
        vocab_size=128,
        hidden_size=256,
        num_layers=3,
        first_k_dense=1,
        intermediate_size=384,
        moe_intermediate_size=128,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        num_heads=2,
        q_lora_rank=128,
        kv_lora_rank=64,
        qk_nope_head_dim=64,
        qk_rope_head_dim=64,
        v_head_dim=64,
        n_group=4,
        topk_group=2,
    )
    export_hf(build_model(cfg, seed=3), tmp_path, dtype="bfloat16", fp8_blocks=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path, dtype=torch.float32, quantization_config=transformers.FineGrainedFP8Config(dequantize=True)
    ).eval()
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert (import_hf(tmp_path).eval()(tokens) - hf(tokens).logits).abs().max().item() <= TOL


def test_blocks_off_the_recipe_are_counted_and_rewritten_on_export(released, tmp_path, caplog):
    """A block whose maximum does not sit at 448 (here: q halved, scale doubled) cannot come back byte for byte
    from the dequantized weights: import says how many, export writes the recipe's quantization of them."""
    _, fp8_dir = released
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    q, scale = tensors[name], tensors[name + "_scale_inv"]
    assert off_recipe_blocks(q, scale) == 0
    half = q.float()
    half[:128, :128] /= 2
    tensors[name] = half.to(torch.float8_e4m3fn)
    tensors[name + "_scale_inv"] = scale.clone()
    tensors[name + "_scale_inv"][0, 0] *= 2
    assert off_recipe_blocks(tensors[name], tensors[name + "_scale_inv"]) == 1
    (tmp_path / "in").mkdir()
    save_file(tensors, str(tmp_path / "in" / "model.safetensors"))
    (tmp_path / "in" / "config.json").write_text((fp8_dir / "config.json").read_text())
    with caplog.at_level("INFO", logger="trainer.hf_stream"):
        model = import_hf(tmp_path / "in")
    assert "1 of " in caplog.text
    export_hf(model, tmp_path / "out", dtype="bfloat16", fp8_blocks=True)
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    want_q, want_scale = _reference_quantize(_reference_dequantize(tensors[name], tensors[name + "_scale_inv"]))
    assert _bytes(out[name]) == _bytes(want_q) and torch.equal(out[name + "_scale_inv"], want_scale)
    assert out[name + "_scale_inv"][0, 0] != tensors[name + "_scale_inv"][0, 0]


@pytest.mark.parametrize(
    ("cfg", "router"),
    [
        (ModelConfig(arch="qwen3_moe", n_shared_experts=0, num_layers=3, first_k_dense=1, hidden_size=160), "mlp"),
        (ModelConfig(arch="mixtral", n_shared_experts=0, num_layers=2, first_k_dense=0, hidden_size=160), None),
    ],
    ids=["qwen3_moe", "mixtral"],
)
def test_other_families_fp8_export_round_trips_and_keeps_their_routers_unquantized(cfg, router, tmp_path):
    router = router or "block_sparse_moe"  # Mixtral's released module name
    export_hf(build_model(cfg, seed=4), tmp_path / "a", dtype="bfloat16", fp8_blocks=True)
    export_hf(import_hf(tmp_path / "a"), tmp_path / "b", dtype="bfloat16", fp8_blocks=True)
    assert (tmp_path / "a" / "model.safetensors").read_bytes() == (tmp_path / "b" / "model.safetensors").read_bytes()
    tensors = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert tensors["model.layers.1.self_attn.k_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors[f"model.layers.1.{router}.gate.weight"].dtype == torch.bfloat16
    quant = json.loads((tmp_path / "a" / "config.json").read_text())["quantization_config"]
    moe_layers = range(cfg.first_k_dense, cfg.num_layers)
    assert quant["modules_to_not_convert"] == ["lm_head"] + [f"model.layers.{i}.{router}.gate" for i in moe_layers]
