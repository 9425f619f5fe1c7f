"""The tokenizer of the pretraining data: loading an HF tokenizer (tokenizer.json) with its end-of-document
id, its identity (what a prepped shard records so a run never mixes tokenizers), and which tokenizer a
config means when trainer.data.tokenizer is empty."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError


def tokenizer_file(path: str | Path) -> Path:
    """The tokenizer.json of an HF tokenizer directory (or the file itself)."""
    p = Path(path)
    file = p / "tokenizer.json" if p.is_dir() else p
    if not file.is_file():
        raise FileNotFoundError(f"no tokenizer.json at {path}; pass an HF tokenizer directory")
    return file


def load_hf_tokenizer(path: str | Path) -> tuple[Any, int | None]:
    """(tokenizers.Tokenizer, eos id or None) of an HF tokenizer directory or tokenizer.json file; the eos token
    is tokenizer_config.json's eos_token."""
    from tokenizers import Tokenizer

    file = tokenizer_file(path)
    tok = Tokenizer.from_file(str(file))
    eos_id = None
    cfg_file = file.parent / "tokenizer_config.json"
    if cfg_file.is_file():
        eos = json.loads(cfg_file.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        eos_id = tok.token_to_id(eos) if eos else None
    return tok, eos_id


def load_tokenizer(path: str | Path) -> tuple[Callable[[str], list[int]], int | None]:
    """(encode, eos id) of an HF tokenizer directory or tokenizer.json file."""
    tok, eos_id = load_hf_tokenizer(path)
    return (lambda text: tok.encode(text, add_special_tokens=False).ids), eos_id


@dataclass(frozen=True)
class TokenizerIdentity:
    """What makes two tokenizers produce the same ids: the bytes of tokenizer.json and the eos id."""

    sha256: str
    vocab_size: int
    eos_id: int

    @classmethod
    def of(cls, path: str | Path) -> TokenizerIdentity:
        tok, eos_id = load_hf_tokenizer(path)
        if eos_id is None:
            raise ValueError(
                f"tokenizer {path} has no eos_token (tokenizer_config.json): documents need an end-of-document id"
            )
        digest = hashlib.sha256(tokenizer_file(path).read_bytes()).hexdigest()
        return cls(digest, tok.get_vocab_size(with_added_tokens=True), eos_id)


def data_tokenizer(cfg: Config, root: Path) -> Path:
    """The tokenizer of trainer.data: trainer.data.tokenizer, else rollout.model's (an HF directory as is; a
    tiny-kit model's tokenizer is written once under `root`, byte-identical to the one in its checkpoints)."""
    if cfg.trainer.data.tokenizer:
        return Path(cfg.trainer.data.tokenizer)
    from trainer.tinykit import KIT_VERSION, TINY_MODELS, build_tokenizer

    name = cfg.rollout.model
    if name not in TINY_MODELS:
        if not (Path(name) / "tokenizer.json").is_file():
            raise ConfigError(
                f"trainer.data.tokenizer is empty and rollout.model = {name!r} holds no tokenizer.json: set "
                "trainer.data.tokenizer to an HF tokenizer directory"
            )
        return Path(name)
    final = root / f"tokenizer-tinykit-v{KIT_VERSION}"
    if not (final / "tokenizer_config.json").is_file():
        tmp = root / f".{final.name}.{os.getpid()}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build_tokenizer(tmp)  # tokenizer_config.json is its last file
        try:
            os.rename(tmp, final)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
            if not (final / "tokenizer_config.json").is_file():
                raise
    return final
