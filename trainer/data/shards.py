"""Prepped sources on disk: `<root>/<name>/index.json` plus token shards `shard-NNNNN.npy` (1-D .npy arrays,
uint16 when the vocabulary fits, else uint32, memory-mapped when read). The shards of a source concatenated
in order are its token stream: every document followed by the tokenizer's eos id. The index holds the plan
that produced them (inputs with sizes and mtimes, the input range of every shard, text key, tokenizer
identity), and for every finished shard its token and document counts, size and sha256; `complete` turns
true when every shard is written. `ShardRows` reads a stream as training rows."""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from common.config import Config, DataSourceConfig
from common.saved_dataset import is_saved_dataset, saved_dataset_files
from trainer.data.tokenizer import TokenizerIdentity

INDEX = "index.json"
FORMAT = 1


class NotPrepped(RuntimeError):
    """A source of trainer.data.sources has no complete, matching set of shards; the message names the fix."""


def token_dtype(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id of a vocabulary."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def shard_name(i: int) -> str:
    return f"shard-{i:05d}.npy"


KINDS = {".jsonl": "jsonl", ".parquet": "parquet", ".arrow": "arrow"}


def input_files(path: str | Path) -> list[tuple[Path, str]]:
    """(file, kind) of a source path in reading order: a .jsonl / .parquet / .arrow file; a `datasets`
    save_to_disk directory (its state.json lists the arrow files); or a directory of .jsonl and .parquet files
    (sorted by name)."""
    p = Path(path)
    if p.is_file():
        if p.suffix not in KINDS:
            raise ValueError(f"{p}: unknown data format {p.suffix!r}; use .jsonl, .parquet or a datasets directory")
        return [(p, KINDS[p.suffix])]
    if not p.is_dir():
        raise FileNotFoundError(f"data source {str(p)!r} does not exist (paths are relative to the working directory)")
    if is_saved_dataset(p):
        return [(f, "arrow") for f in saved_dataset_files(p)]
    found = sorted(f for f in p.iterdir() if f.is_file() and f.suffix in (".jsonl", ".parquet"))
    if not found:
        raise ValueError(f"{p}: no .jsonl or .parquet files and no state.json (datasets save_to_disk) in it")
    return [(f, KINDS[f.suffix]) for f in found]


def input_listing(files: list[tuple[Path, str]]) -> list[list[Any]]:
    """[path, kind, size, mtime_ns] of every input file: a changed input changes the plan."""
    return [[str(f), kind, f.stat().st_size, f.stat().st_mtime_ns] for f, kind in files]


def source_plan(src: DataSourceConfig, tok: TokenizerIdentity, inputs: list[list[Any]]) -> dict[str, Any]:
    """The part of an index that decides its shards' bytes (besides each shard's input range)."""
    return {
        "format": FORMAT,
        "path": src.path,
        "text_key": src.text_key,
        "inputs": inputs,
        "tokenizer": asdict(tok),
        "dtype": token_dtype(tok.vocab_size).name,
    }


def read_index(source_dir: Path) -> dict[str, Any] | None:
    path = source_dir / INDEX
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write a file that a reader sees whole or not at all (a kill in between leaves only a .tmp file); the same
    content already there is left alone, mtime included."""
    text = json.dumps(obj, indent=1)
    if path.is_file() and path.read_text() == text:
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class ShardRows:
    """Training rows [seq_len + 1] of one token stream held in shards: row j is stream[j * seq_len :
    j * seq_len + seq_len + 1], so rows overlap by one token (every token but the first is a target exactly
    once), as trainer/pretrain.py's token_rows cuts a stream held in memory."""

    def __init__(self, shards: list[np.ndarray], seq_len: int, label: str) -> None:
        self.shards = [s for s in shards if len(s)]
        self.seq_len = seq_len
        self.starts = np.cumsum([0] + [len(s) for s in self.shards])
        total = int(self.starts[-1])
        self.n_rows = max(0, (total - 1) // seq_len)
        if self.n_rows < 1:
            raise ValueError(f"{label}: {total} tokens do not fill one row of seq_len + 1 = {seq_len + 1}")

    def __len__(self) -> int:
        return self.n_rows

    def __getitem__(self, rows: np.ndarray) -> np.ndarray:
        """The rows of an index array, [len(rows), seq_len + 1] int64."""
        width = self.seq_len + 1
        out = np.empty((len(rows), width), dtype=np.int64)
        for k, j in enumerate(np.asarray(rows, dtype=np.int64)):
            pos, filled = int(j) * self.seq_len, 0
            while filled < width:  # a row crosses into the next shard(s) at a boundary
                s = int(np.searchsorted(self.starts, pos, side="right")) - 1
                off = pos - int(self.starts[s])
                take = min(width - filled, len(self.shards[s]) - off)
                out[k, filled : filled + take] = self.shards[s][off : off + take]
                filled, pos = filled + take, pos + take
        return out


def open_prepped(root: Path, index: int, src: DataSourceConfig, tok: TokenizerIdentity, seq_len: int) -> ShardRows:
    """The rows of prepped source `src` (trainer.data.sources[index]); NotPrepped if its shards are missing,
    incomplete or were made from other inputs or another tokenizer."""
    key = f"trainer.data.sources[{index}] ({src.name!r})"
    fix = f"run `slipstream prep CONFIG` (it tokenizes trainer.data.sources into trainer.data.root = {str(root)!r})"
    source_dir = root / src.name
    idx = read_index(source_dir)
    if idx is None:
        raise NotPrepped(f"{key} is not prepped: no {source_dir / INDEX}; {fix}")
    if not idx.get("complete"):
        raise NotPrepped(f"{key}: the prep of {source_dir} did not finish; {fix} again (it resumes)")
    plan = idx["plan"]
    for name, want in (("path", src.path), ("text_key", src.text_key), ("tokenizer", asdict(tok))):
        if plan[name] != want:
            raise NotPrepped(
                f"{key}: {source_dir} was prepped with {name} = {plan[name]!r}, the config has {want!r}; {fix}"
            )
    if Path(src.path).exists():
        # The raw inputs are here (a training host may hold only the shards): they must be what was prepped.
        if input_listing(input_files(src.path)) != plan["inputs"]:
            raise NotPrepped(f"{key}: the inputs under {src.path!r} changed since they were prepped; {fix}")
    shards = []
    for meta in idx["shards"]:
        file = source_dir / meta["file"]
        if not file.is_file() or file.stat().st_size != meta["bytes"]:
            raise NotPrepped(f"{key}: shard {file} is missing or not {meta['bytes']} bytes; {fix}")
        shards.append(np.load(file, mmap_mode="r"))
    return ShardRows(shards, seq_len, str(source_dir))


def data_root(cfg: Config) -> Path:
    """trainer.data.root, else <run.root>/data."""
    return Path(cfg.trainer.data.root or Path(cfg.run.root) / "data")
