"""The files of an HF model directory besides its weights: config.json, generation_config.json and the
tokenizer with its chat template. A published version (and a converted checkpoint) carries copies of them, so
that a version directory is a whole HF model: transformers and vLLM open it as they open the original, and the
evaluator reads the tokenizer and chat template from the version it evaluates."""

from __future__ import annotations

import shutil
from pathlib import Path

CONFIG_FILES = ("config.json", "generation_config.json")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
MODEL_FILES = CONFIG_FILES + TOKENIZER_FILES


def copy_model_files(src: Path, dst: Path, names: tuple[str, ...] = MODEL_FILES) -> list[str]:
    """Copy those of `names` that `src` holds into `dst` (made if absent); the names copied, in order."""
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for name in names:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)
            copied.append(name)
    return copied


def tokenizer_dir(path: Path) -> Path | None:
    """`path` when it holds a tokenizer (its tokenizer_config.json), else None."""
    return path if (path / "tokenizer_config.json").is_file() else None
