"""HF checkpoint interop: our model to and from a directory that transformers and vLLM load
(config.json + safetensors with one name per expert), for DeepseekV3ForCausalLM, Qwen3MoeForCausalLM
and MixtralForCausalLM (its config and released names: trainer/hf_mixtral.py). Our state dict already
uses HF's names; the only translation is between our stacked expert tensors (gate_up_proj [E, 2I, H],
down_proj [E, H, I]) and the per-expert `model.layers.L.mlp.experts.N.{gate,up,down}_proj.weight` of
released checkpoints (Mixtral's: `block_sparse_moe.experts.N.{w1,w3,w2}`). Import also takes
transformers' own stacked layout, and DeepSeek-V3's FP8 block-quantized layout (trainer/hf_fp8.py:
dequantized on import, written on request). `export_fresh_hf` writes a deterministic freshly initialised model
from a ModelConfig and a seed (tiny test checkpoints for vLLM)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from common.config import ConfigError, ModelConfig
from trainer import hf_mixtral
from trainer.hf_errors import HFFormatError
from trainer.hf_fp8 import quantization_config, quantize_tensors
from trainer.hf_rope import hf_rope_parameters, rope_fields_from_hf
from trainer.hf_stream import stream_hf_state
from trainer.model import Transformer, build_model

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# vLLM's CPU kernels (docs/vllm-cpu.md): these shapes run, others fail at the first request.
VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def hf_config(cfg: ModelConfig, dtype: str = "float32", extra: dict | None = None) -> dict:
    """The config.json of `cfg` for transformers/vLLM; `extra` overrides or adds fields (e.g. eos_token_id)."""
    if dtype not in _DTYPES:
        raise HFFormatError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    common = {
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "norm_topk_prob": cfg.norm_topk_prob,
        "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len,
        "initializer_range": 0.02,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_parameters": hf_rope_parameters(cfg),
        "rope_scaling": None if cfg.rope_scaling == "none" else hf_rope_parameters(cfg),
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_cache": True,
        "torch_dtype": dtype,
    }
    if cfg.arch == "deepseek_v3":
        out = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            **common,
            "num_key_value_heads": cfg.num_heads,
            "n_routed_experts": cfg.n_routed_experts,
            "n_shared_experts": cfg.n_shared_experts,
            "first_k_dense_replace": cfg.first_k_dense,
            "moe_layer_freq": 1,
            "routed_scaling_factor": cfg.routed_scaling_factor,
            "n_group": cfg.n_group,
            "topk_group": cfg.topk_group,
            "topk_method": "noaux_tc",
            "scoring_func": "sigmoid",
            "q_lora_rank": cfg.q_lora_rank or None,
            "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "qk_rope_head_dim": cfg.qk_rope_head_dim,
            "v_head_dim": cfg.v_head_dim,
            "rope_interleave": True,
            "num_nextn_predict_layers": 0,
        }
    elif cfg.arch == "mixtral":
        if problems := hf_mixtral.export_problems(cfg):
            raise HFFormatError(f"trainer.model cannot be written as {hf_mixtral.ARCHITECTURE}: " + "; ".join(problems))
        out = hf_mixtral.hf_config(cfg, common)
    else:
        problems = []
        if cfg.n_shared_experts:
            problems.append(f"n_shared_experts = {cfg.n_shared_experts} (Qwen3-MoE has none; set 0)")
        if cfg.routed_scaling_factor != 1.0:
            problems.append(f"routed_scaling_factor = {cfg.routed_scaling_factor} (Qwen3-MoE applies none; set 1.0)")
        if cfg.n_group != 1:
            problems.append(f"n_group = {cfg.n_group} (Qwen3-MoE has no group-limited routing; set 1)")
        if problems:
            raise HFFormatError("trainer.model cannot be written as Qwen3MoeForCausalLM: " + "; ".join(problems))
        out = {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            **common,
            "num_key_value_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim,
            "num_experts": cfg.n_routed_experts,
            "decoder_sparse_step": 1,
            "mlp_only_layers": list(range(cfg.first_k_dense)),
            "use_sliding_window": False,
            "sliding_window": None,
            "output_router_logits": False,
            "router_aux_loss_coef": 0.0,
        }
    out.update(extra or {})
    return out


# model_type values of released checkpoints whose architecture is DeepseekV3ForCausalLM.
DEEPSEEK_V3_ALIASES = ("kimi_k2",)


def model_config_from_hf(hf: dict, max_seq_len: int | None = None) -> ModelConfig:
    """Our ModelConfig from an HF config.json dict of DeepseekV3, Qwen3Moe or Mixtral."""
    cfg = _model_config_from_hf(hf, max_seq_len)
    try:
        cfg.check()
    except ConfigError as e:
        raise HFFormatError(f"the HF config maps onto a model we cannot build: {e}") from e
    return cfg


def _model_config_from_hf(hf: dict, max_seq_len: int | None) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type in DEEPSEEK_V3_ALIASES and hf.get("architectures", ["DeepseekV3ForCausalLM"]) == [
        "DeepseekV3ForCausalLM"
    ]:
        model_type = "deepseek_v3"  # Kimi-K2 ships DeepSeek-V3's architecture under its own model_type
    base = dict(
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        intermediate_size=hf["intermediate_size"],
        # Mixtral has one MLP width, its experts'.
        moe_intermediate_size=hf["intermediate_size" if model_type == "mixtral" else "moe_intermediate_size"],
        num_experts_per_tok=hf["num_experts_per_tok"],
        num_heads=hf["num_attention_heads"],
        **rope_fields_from_hf(hf),
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_seq_len=max_seq_len or int(hf.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )
    if hf.get("hidden_act", "silu") != "silu" or hf.get("attention_bias", False):
        raise HFFormatError("only hidden_act = silu and attention_bias = false are supported")
    if model_type == "deepseek_v3":
        # vLLM reads these two itself, with other defaults than transformers' (softmax routing, no correction
        # bias): a config.json without them would be served as another model than the one trained.
        routing = {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}
        if any(hf.get(key) != want for key, want in routing.items()):
            raise HFFormatError(
                f"DeepseekV3 config.json has scoring_func = {hf.get('scoring_func')!r} and topk_method = "
                f"{hf.get('topk_method')!r}; we train (and transformers runs) sigmoid routing with the correction "
                'bias, which vLLM serves only with scoring_func = "sigmoid" and topk_method = "noaux_tc" '
                "written in config.json, as DeepSeek-V3's released config has them: add them"
            )
        if not hf.get("rope_interleave", True):
            raise HFFormatError("DeepseekV3 needs rope_interleave = true")
        return ModelConfig(
            arch="deepseek_v3",
            first_k_dense=hf.get("first_k_dense_replace", 0),
            n_routed_experts=hf.get("n_routed_experts") or hf["num_local_experts"],
            n_shared_experts=hf.get("n_shared_experts") or 0,
            q_lora_rank=hf.get("q_lora_rank") or 0,
            kv_lora_rank=hf["kv_lora_rank"],
            qk_nope_head_dim=hf["qk_nope_head_dim"],
            qk_rope_head_dim=hf["qk_rope_head_dim"],
            v_head_dim=hf["v_head_dim"],
            routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(hf.get("norm_topk_prob", True)),
            n_group=hf.get("n_group") or 1,
            topk_group=hf.get("topk_group") or 1,
            num_kv_heads=hf["num_attention_heads"],
            **base,
        )
    if model_type == "qwen3_moe":
        dense = list(hf.get("mlp_only_layers") or [])
        if hf.get("decoder_sparse_step", 1) != 1 or dense != list(range(len(dense))):
            raise HFFormatError(
                f"Qwen3Moe with decoder_sparse_step = {hf.get('decoder_sparse_step')} and mlp_only_layers = {dense}: "
                "only leading dense layers (mlp_only_layers = [0..k-1], decoder_sparse_step = 1) are supported"
            )
        return ModelConfig(
            arch="qwen3_moe",
            first_k_dense=len(dense),
            n_routed_experts=hf.get("num_experts") or hf["num_local_experts"],
            n_shared_experts=0,
            num_kv_heads=hf["num_key_value_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
            routed_scaling_factor=1.0,
            **base,
        )
    if model_type == "mixtral":
        if problems := hf_mixtral.import_problems(hf, base["max_seq_len"]):
            raise HFFormatError(f"{hf_mixtral.ARCHITECTURE} config: " + "; ".join(problems))
        return hf_mixtral.model_config(hf, base)
    raise HFFormatError(f"model_type {model_type!r} is not supported; use deepseek_v3, qwen3_moe or mixtral")


def hf_tensors(
    model: Transformer,
    dtype: torch.dtype | None = None,
    dense: bool = True,
    experts: bool = True,
    gather: Callable[[str, DTensor], torch.Tensor | None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) pairs of the model, experts split per expert; `dtype` casts floating tensors
    except the expert-score bias, which HF keeps in fp32. `dense` / `experts` select the part: under
    expert parallelism a rank holds a shard of the experts (a DTensor on dim 0), and yields only those,
    under their global expert numbers. FSDP-sharded dense tensors (trainer/fsdp.py) are gathered whole, so
    every rank of their mesh must iterate them: by `gather(name, shard)`, which returns the whole tensor on the
    rank that is to yield it and None elsewhere (it decides instead of `dense`), or, without it, by an
    all-gather on every rank. Mixtral's router and experts take its released names."""
    pairs = _hf_tensors(model, dtype, dense, experts, gather)
    if model.cfg.arch == "mixtral":
        return ((hf_mixtral.released_name(name), t) for name, t in pairs)
    return pairs


def _hf_tensors(
    model: Transformer,
    dtype: torch.dtype | None,
    dense: bool,
    experts: bool,
    gather: Callable[[str, DTensor], torch.Tensor | None] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    state = model.state_dict()
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for name, t in state.items():
        is_expert = name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))
        sharded_dense = isinstance(t, DTensor) and not is_expert
        if sharded_dense and gather is not None:
            whole = gather(name, t)
            if whole is None:
                continue
            t = whole
        elif not (experts if is_expert else dense):
            continue
        elif sharded_dense:
            t = t.full_tensor()
        first = 0
        if isinstance(t, DTensor):  # this rank's contiguous block of experts
            first = t.device_mesh.get_local_rank() * t.to_local().shape[0]
            t = t.to_local()
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix = name[: -len(".gate_up_proj")]
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.{first + e}.gate_proj.weight", _cast(t[e, :inter], dtype)
                yield f"{prefix}.{first + e}.up_proj.weight", _cast(t[e, inter:], dtype)
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name[: -len(".down_proj")]
            for e in range(t.shape[0]):
                yield f"{prefix}.{first + e}.down_proj.weight", _cast(t[e], dtype)
        else:
            yield name, _hf_cast(name, t, dtype)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def _hf_cast(name: str, t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """HF keeps the expert-score bias in fp32; the other floating tensors take `dtype`."""
    return t.float() if name.endswith("e_score_correction_bias") else _cast(t, dtype)


def export_hf(
    model: Transformer,
    out_dir: str | os.PathLike[str],
    dtype: str = "float32",
    extra: dict | None = None,
    fp8_blocks: bool = False,
) -> Path:
    """Write config.json and model.safetensors (per-expert names) into out_dir; returns the directory.
    `fp8_blocks`: DeepSeek-V3's released FP8 layout (trainer/hf_fp8.py): the decoder's Linear weights
    quantized from the masters to e4m3 with 128 x 128 block scales, the other tensors in `dtype`."""
    if dtype not in _DTYPES:
        raise HFFormatError(f"dtype {dtype!r} is not one of {', '.join(_DTYPES)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cast = _DTYPES[dtype]
    if fp8_blocks:  # quantized from the masters, not from a cast to `dtype` (the round trip needs their fp32 values)
        masters = ((name, t.detach().to("cpu")) for name, t in hf_tensors(model))
        pairs = quantize_tensors(masters, lambda name, t: _hf_cast(name, t, cast))
        extra = {"quantization_config": quantization_config(model.cfg.arch, model.moe_layer_ids()), **(extra or {})}
    else:
        pairs = hf_tensors(model, cast)
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in pairs}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(model.cfg, dtype, extra), indent=2) + "\n")
    return out


def export_fresh_hf(
    cfg: ModelConfig, seed: int, out_dir: str | os.PathLike[str], dtype: str = "float32", extra: dict | None = None
) -> Path:
    """Export a freshly initialised model; the same (cfg, seed, dtype) always gives the same bytes."""
    return export_hf(build_model(cfg, seed=seed), out_dir, dtype, extra)


def vllm_cpu_problems(cfg: ModelConfig) -> list[str]:
    """Shapes of `cfg` that vLLM's CPU build rejects (empty when it should serve the model)."""
    problems = []
    head = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim if cfg.arch == "deepseek_v3" else cfg.head_dim
    if head not in VLLM_CPU_HEAD_SIZES:
        problems.append(f"attention head size {head} is not one of {VLLM_CPU_HEAD_SIZES}")
    if cfg.arch == "deepseek_v3" and cfg.kv_lora_rank + cfg.qk_rope_head_dim != 576:
        problems.append(
            f"kv_lora_rank + qk_rope_head_dim = {cfg.kv_lora_rank + cfg.qk_rope_head_dim}; CPU MLA needs 576 (512 + 64)"
        )
    for name in ("hidden_size", "moe_intermediate_size"):
        if getattr(cfg, name) % 32:
            problems.append(f"{name} = {getattr(cfg, name)} is not a multiple of 32")
    return problems


def load_hf_state(model: Transformer, path: str | os.PathLike[str]) -> None:
    """Copy the weights of an HF directory into `model` (shapes must match; names are checked both ways),
    streamed entry by entry, reading only the experts this rank holds, FP8 block weights dequantized into the
    masters (trainer/hf_stream.py)."""
    stream_hf_state(model, path)


def import_hf(
    path: str | os.PathLike[str],
    experts_backend: str = "reference",
    device: str | torch.device = "cpu",
    max_seq_len: int | None = None,
) -> Transformer:
    """Build our model from an HF DeepseekV3/Qwen3Moe/Mixtral directory (fp32 master weights on `device`)."""
    path = Path(path)
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise HFFormatError(f"{path} has no config.json; pass an HF checkpoint directory")
    cfg = model_config_from_hf(json.loads(cfg_file.read_text()), max_seq_len)
    model = build_model(cfg, experts_backend, seed=None)
    load_hf_state(model, path)
    return model.to(device)
