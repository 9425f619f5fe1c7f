"""Tiny-model kit: a local tokenizer and tiny, seeded HF checkpoints that vLLM's CPU build serves. It lives
with the model it exports: the serving side (rollout/worker.py, `slipstream eval`) asks the model's owner for
a checkpoint, and nothing here reaches back into rollout/.

`rollout.model = "tiny-deepseek"`, `"tiny-qwen3"` or `"tiny-mixtral"` resolves here to a checkpoint directory
(config.json, model.safetensors, tokenizer files) shaped by the config's `trainer.model`
(a `ModelConfig`) and seeded by `run.seed`. Checkpoints are cached under `<run dir>/models/` in a
directory named by a hash of everything that determines their bytes, so a cached copy is reused
only when it would be identical. The weights come from one function, `generate_weights`, which
exports the trainer core's seeded initialisation (trainer/hf.py). The tokenizer is a WordLevel vocabulary (special tokens, role markers, digits, arithmetic
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

TINY_MODELS = {"tiny-deepseek": "deepseek_v3", "tiny-qwen3": "qwen3_moe", "tiny-mixtral": "mixtral"}
# Bump when the generator or tokenizer changes in a way that changes the files' bytes.
KIT_VERSION = 3

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
ROLES = ["<|system|>", "<|user|>", "<|assistant|>"]
OPERATORS = list("+-*/=()^%<>")
PUNCTUATION = [" ", "\n", ".", ",", "?", "!", ":", ";", "'", '"']
WORDS = [
    "what",
    "is",
    "the",
    "answer",
    "of",
    "to",
    "and",
    "solve",
    "compute",
    "sum",
    "plus",
    "minus",
    "times",
    "divided",
    "by",
    "equals",
    "result",
    "number",
    "yes",
    "no",
    "think",
    "step",
    "final",
    "total",
]
# Added last (ids 114-127), so every earlier id is what it was: the tool-call format's tags (added tokens that are
# not special, so a decode that skips special tokens keeps them, as Qwen's tokenizer does), a tool role, the JSON
# characters the tiny vocabulary lacked and the words of a calculator call, each one token.
TOOL_TAGS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
TOOL_EXTRAS = ["<|tool|>", "{", "}", "[", "]", "_", "name", "arguments", "expression", "calculator"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def vocabulary() -> list[str]:
    """Every token of the tiny tokenizer, in id order."""
    base = SPECIAL + ROLES + list(string.digits) + OPERATORS + list(string.ascii_letters) + PUNCTUATION + WORDS
    return base + TOOL_TAGS + TOOL_EXTRAS


def build_tokenizer(out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into out_dir."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(vocabulary())}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    # Whole known words first, then single characters, so unknown words fall back to letters.
    words = "|".join(sorted(WORDS + [w for w in TOOL_EXTRAS if w.isalpha()], key=len, reverse=True))
    pattern = rf"\b(?:{words})\b|[A-Za-z0-9]|\s|[^A-Za-z0-9\s]"
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    tok.decoder = decoders.Fuse()  # tokens already carry their spaces
    tok.add_special_tokens(SPECIAL + ROLES + ["<|tool|>"])
    tok.add_tokens(TOOL_TAGS)
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
    from trainer.hf import vllm_cpu_problems

    problems = vllm_cpu_problems(m)
    if m.vocab_size < len(vocabulary()):
        problems.append(f"vocab_size {m.vocab_size} is below the tiny tokenizer's {len(vocabulary())} tokens")
    if problems:
        raise ConfigError("trainer.model cannot be served by vLLM's CPU build: " + "; ".join(problems))


def generate_weights(m: ModelConfig, seed: int, out_dir: Path) -> None:
    """Write config.json and model.safetensors of a freshly initialised model (the swappable generator).

    The trainer core's own deterministic init and HF export, so a tiny checkpoint is exactly what
    the trainer would start from; token ids follow the tiny tokenizer.
    """
    from trainer.hf import export_fresh_hf

    export_fresh_hf(m, seed, out_dir, "float32", extra={"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})


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
    blob = json.dumps(
        {"model": dataclasses.asdict(m), "seed": seed, "vocab": vocabulary(), "kit": KIT_VERSION}, sort_keys=True
    )
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
