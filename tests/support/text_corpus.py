"""Small generated text corpora and a word-level tokenizer for the data tests (test_prep, test_data_mixture)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers

WORDS = ["<eos>"] + [f"w{i}" for i in range(40)]
"""The vocabulary: id 0 is the end-of-document token."""


def word_tokenizer(directory: Path) -> Path:
    """A WordLevel tokenizer over WORDS (whitespace-split) with eos_token <eos>, as an HF directory."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return directory


def documents(n: int, seed: int, words: range = range(1, 41)) -> list[str]:
    """n documents of 3..30 words drawn from WORDS[words]."""
    rng = np.random.default_rng(seed)
    return [" ".join(WORDS[int(i)] for i in rng.choice(list(words), rng.integers(3, 31))) for _ in range(n)]


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)))
    return path


def expected_stream(docs: list[str]) -> list[int]:
    """Every document's ids followed by the eos id 0."""
    index = {w: i for i, w in enumerate(WORDS)}
    return [t for d in docs for t in [*(index[w] for w in d.split()), 0]]
