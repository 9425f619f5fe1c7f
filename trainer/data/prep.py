"""`slipstream prep CONFIG`: tokenize every source of trainer.data.sources into token shards under
trainer.data.root (format: trainer/data/shards.py), in parallel processes, with a progress bar.

A source's inputs are cut into pieces of about trainer.data.shard_mb MB of raw text (JSONL by byte range at
line ends, parquet by row groups, arrow by record batches); each piece becomes one shard, tokenized on its
own, so pieces run in any order on any process and the stream (the shards in order) is the same whatever
the shard size. Every shard is written to a temporary file and renamed, and the index records a shard only
after its rename: a killed prep leaves at most temporary files, and the next run redoes exactly the shards
the index lacks. A run whose plan (inputs, sizes, mtimes, text key, tokenizer, pieces) equals the index's
tokenizes nothing. A plan that changed starts the source over.

Left out: tokenizing at train time (the trainer refuses unprepped sources and names this command), remote
inputs, and deduplication or filtering of documents.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from common.config import Config, ConfigError, DataSourceConfig, add_set_argument, load_config
from trainer.data.shards import (
    INDEX,
    data_root,
    input_files,
    input_listing,
    read_index,
    shard_name,
    source_plan,
    write_json_atomic,
)
from trainer.data.tokenizer import TokenizerIdentity, data_tokenizer, load_hf_tokenizer

ENCODE_BATCH = 512  # documents per encode_batch call


class PrepError(ValueError):
    """A raw input cannot be read as the config says (bad JSON, missing text field, ...); names file and fix."""


@dataclass(frozen=True)
class Piece:
    """The input of one shard: [start, stop) of a file, in bytes (jsonl), row groups (parquet) or record
    batches (arrow)."""

    file: str
    kind: str
    start: int
    stop: int


@dataclass(frozen=True)
class ShardJob:
    key: str
    """trainer.data.sources[i], for error messages."""
    text_key: str
    piece: Piece
    out: str
    """The shard file to write."""
    eos_id: int
    dtype: str


@dataclass
class SourceReport:
    name: str
    directory: Path
    shards: int
    tokenized: int
    """Shards tokenized by this run (the others were already done)."""
    tokens: int
    documents: int


# -- planning -----------------------------------------------------------------------------------


def plan_pieces(files: list[tuple[Path, str]], text_key: str, piece_bytes: int, key: str) -> list[Piece]:
    """Cut the inputs into pieces of about piece_bytes of text each (never splitting a document)."""
    pieces: list[Piece] = []
    for file, kind in files:
        if kind == "jsonl":
            pieces += _jsonl_pieces(file, piece_bytes)
        elif kind == "parquet":
            import pyarrow.parquet as pq

            meta = pq.ParquetFile(file).metadata
            _check_column(meta.schema.to_arrow_schema().names, text_key, file, key)
            sizes = [meta.row_group(g).total_byte_size for g in range(meta.num_row_groups)]
            pieces += [Piece(str(file), kind, a, b) for a, b in _group(sizes, piece_bytes)]
        else:
            import pyarrow as pa

            with pa.memory_map(str(file)) as src:  # zero-copy: this reads only batch headers
                reader = pa.ipc.open_stream(src)
                _check_column(reader.schema.names, text_key, file, key)
                sizes = [batch.column(text_key).nbytes for batch in reader]
            pieces += [Piece(str(file), kind, a, b) for a, b in _group(sizes, piece_bytes)]
    return pieces


def _jsonl_pieces(file: Path, piece_bytes: int) -> list[Piece]:
    size = file.stat().st_size
    pieces, start = [], 0
    with file.open("rb") as f:
        while start < size:
            stop = start + piece_bytes
            if stop < size:
                f.seek(stop - 1)
                f.readline()  # to the end of the line holding byte stop - 1
                stop = f.tell()
            stop = min(stop, size)
            pieces.append(Piece(str(file), "jsonl", start, stop))
            start = stop
    return pieces


def _group(sizes: list[int], target: int) -> Iterator[tuple[int, int]]:
    """Consecutive [start, stop) runs of items whose sizes add up to at least target (the last one less)."""
    start, acc = 0, 0
    for i, n in enumerate(sizes):
        acc += n
        if acc >= target:
            yield start, i + 1
            start, acc = i + 1, 0
    if start < len(sizes):
        yield start, len(sizes)


def _check_column(names: list[str], text_key: str, file: Path, key: str) -> None:
    if text_key not in names:
        raise PrepError(f"{file}: no column {text_key!r} (columns: {', '.join(names)}); set {key}.text_key")


# -- one shard (in a worker process) ------------------------------------------------------------

_TOKENIZER: Any = None


def _init_worker(tokenizer: str) -> None:
    global _TOKENIZER
    # One process, one core: the pool is the parallelism (and a forked rayon pool would be unsafe).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _TOKENIZER, _ = load_hf_tokenizer(tokenizer)


def _texts(job: ShardJob) -> Iterator[str]:
    p = job.piece
    if p.kind == "jsonl":
        with open(p.file, "rb") as f:
            f.seek(p.start)
            data = f.read(p.stop - p.start)
        for n, line in enumerate(data.split(b"\n")):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                where = f"{p.file}:{_line_number(p.file, p.start, n)}"
                raise PrepError(f"{where}: not a JSON object ({exc.msg}); fix or delete the line") from None
            text = obj.get(job.text_key) if isinstance(obj, dict) else None
            if not isinstance(text, str):
                where = f"{p.file}:{_line_number(p.file, p.start, n)}"
                raise PrepError(f"{where}: no string field {job.text_key!r}; set {job.key}.text_key")
            yield text
        return
    import pyarrow as pa

    if p.kind == "parquet":
        import pyarrow.parquet as pq

        table = pq.ParquetFile(p.file).read_row_groups(list(range(p.start, p.stop)), columns=[job.text_key])
        texts = table.column(job.text_key).to_pylist()
        where = f"row groups {p.start}..{p.stop - 1}"
    else:
        texts = []
        with pa.memory_map(p.file) as src:  # copied out before the map closes
            for i, batch in enumerate(pa.ipc.open_stream(src)):
                if i >= p.stop:
                    break
                if i >= p.start:
                    texts += batch.column(job.text_key).to_pylist()
        where = f"record batches {p.start}..{p.stop - 1}"
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise PrepError(f"{p.file} ({where}): row {i} has {text!r} for {job.text_key!r}, not a string")
        yield text


def _line_number(file: str, start: int, index: int) -> int:
    """1-based line number of line `index` of a piece starting at byte `start` (counted only on an error)."""
    with open(file, "rb") as f:
        return f.read(start).count(b"\n") + index + 1


def tokenize_shard(job: ShardJob) -> dict[str, Any]:
    """Tokenize one piece into its shard file (eos after every document); the shard's index entry."""
    dtype = np.dtype(job.dtype)
    ids: list[int] = []
    docs = 0
    texts = _texts(job)
    while True:
        batch = [t for _, t in zip(range(ENCODE_BATCH), texts, strict=False)]
        if not batch:
            break
        for enc in _TOKENIZER.encode_batch(batch, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(job.eos_id)
        docs += len(batch)
    tokens = np.asarray(ids, dtype=np.int64)
    if len(tokens) and int(tokens.max()) > np.iinfo(dtype).max:
        raise PrepError(f"{job.piece.file}: token id {int(tokens.max())} does not fit {dtype}; the tokenizer changed?")
    out = Path(job.out)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as f:
        np.save(f, tokens.astype(dtype))
    with tmp.open("rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    os.replace(tmp, out)
    return {"file": out.name, "tokens": len(tokens), "documents": docs, "bytes": out.stat().st_size, "sha256": digest}


# -- the run ------------------------------------------------------------------------------------


class _Source:
    """One source's index as this run keeps it up to date."""

    def __init__(
        self, index: int, src: DataSourceConfig, root: Path, tok: TokenizerIdentity, piece_bytes: int, stack: ExitStack
    ):
        self.src, self.key = src, f"trainer.data.sources[{index}]"
        self.dir = root / src.name
        self.dir.mkdir(parents=True, exist_ok=True)
        stack.enter_context(_lock(self.dir))
        files = input_files(src.path)
        plan = source_plan(src, tok, input_listing(files))
        plan["pieces"] = [
            [p.file, p.kind, p.start, p.stop] for p in plan_pieces(files, src.text_key, piece_bytes, self.key)
        ]
        self.pieces = [Piece(*p) for p in plan["pieces"]]
        for stale in self.dir.glob(".*.tmp"):
            stale.unlink()  # left by a killed run
        old = read_index(self.dir)
        if old is not None and old["plan"] == plan:
            self.index = old
            for k, meta in enumerate(self.index["shards"]):
                if meta is not None and not _intact(self.dir, meta):
                    self.index["shards"][k] = None
        else:
            for shard in self.dir.glob("shard-*.npy"):
                shard.unlink()  # another plan's
            self.index = {"name": src.name, "plan": plan, "complete": False, "shards": [None] * len(self.pieces)}
        self.tokenized = 0
        self.last_write = 0.0

    def jobs(self, eos_id: int) -> list[tuple[int, ShardJob]]:
        dtype = self.index["plan"]["dtype"]
        return [
            (k, ShardJob(self.key, self.src.text_key, piece, str(self.dir / shard_name(k)), eos_id, dtype))
            for k, piece in enumerate(self.pieces)
            if self.index["shards"][k] is None
        ]

    def done(self, k: int, meta: dict[str, Any]) -> None:
        self.index["shards"][k] = meta
        self.tokenized += 1
        if time.monotonic() - self.last_write > 1.0:  # a kill loses at most a second of recorded shards
            self.write()

    def write(self) -> None:
        shards = self.index["shards"]
        self.index["complete"] = all(m is not None for m in shards)
        self.index["tokens"] = sum(m["tokens"] for m in shards if m is not None)
        self.index["documents"] = sum(m["documents"] for m in shards if m is not None)
        write_json_atomic(self.dir / INDEX, self.index)
        self.last_write = time.monotonic()

    def report(self) -> SourceReport:
        i = self.index
        return SourceReport(self.src.name, self.dir, len(i["shards"]), self.tokenized, i["tokens"], i["documents"])


def _intact(directory: Path, meta: dict[str, Any]) -> bool:
    file = directory / meta["file"]
    return file.is_file() and file.stat().st_size == meta["bytes"]


def _lock(directory: Path) -> IO[str]:
    f = (directory / ".prep.lock").open("w")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.close()
        raise PrepError(f"another slipstream prep is writing {directory}; wait for it to finish") from None
    return f


def prep(cfg: Config, progress: bool = True) -> list[SourceReport]:
    """Tokenize the sources of trainer.data.sources that are not prepped yet; a report per source."""
    d = cfg.trainer.data
    if not d.sources:
        raise ConfigError(
            "slipstream prep tokenizes trainer.data.sources, and the config has none; add "
            '[[trainer.data.sources]] tables (name = "...", path = "...")'
        )
    root = data_root(cfg)
    root.mkdir(parents=True, exist_ok=True)
    tokenizer = data_tokenizer(cfg, root)
    tok = TokenizerIdentity.of(tokenizer)
    with ExitStack() as stack:  # holds every source's lock
        piece_bytes = max(1, int(d.shard_mb * (1 << 20)))
        sources = [_Source(i, src, root, tok, piece_bytes, stack) for i, src in enumerate(d.sources)]
        _tokenize(sources, tokenizer, tok.eos_id, d.prep_processes, progress)
    return [s.report() for s in sources]


def _tokenize(sources: list[_Source], tokenizer: Path, eos_id: int, processes: int, progress: bool) -> None:
    jobs = [(s, k, job) for s in sources for k, job in s.jobs(eos_id)]
    processes = max(1, min(processes or os.cpu_count() or 1, len(jobs)))
    if jobs:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), unit="shard", desc="prep", disable=not progress, file=sys.stderr)
        # spawn: the parent may hold threads (tokenizers' pool, the caller's), which fork would copy half-alive.
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(processes, ctx, initializer=_init_worker, initargs=(str(tokenizer),)) as pool:
            pending: dict[Future[dict[str, Any]], tuple[_Source, int]] = {}
            queue = iter(jobs)
            tokens = 0
            t0 = time.perf_counter()
            try:
                while True:
                    while len(pending) < 2 * processes and (nxt := next(queue, None)) is not None:
                        pending[pool.submit(tokenize_shard, nxt[2])] = (nxt[0], nxt[1])
                    if not pending:
                        break
                    finished, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        source, k = pending.pop(fut)
                        meta = fut.result()  # a worker's PrepError surfaces here
                        source.done(k, meta)
                        tokens += meta["tokens"]
                        bar.update()
                        bar.set_postfix(tok_per_s=f"{tokens / (time.perf_counter() - t0):.3g}")
            finally:
                for fut in pending:
                    fut.cancel()
                for source in sources:
                    source.write()  # what finished stays finished
                bar.close()
    for source in sources:
        source.write()


def cli_main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="slipstream prep",
        description="Tokenize trainer.data.sources into token shards under trainer.data.root; a re-run skips finished shards.",
    )
    ap.add_argument("config", help="TOML config with [[trainer.data.sources]] tables")
    add_set_argument(ap, "trainer.data.prep_processes=4")
    ap.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = ap.parse_args(list(argv))
    try:
        cfg = load_config(args.config, args.overrides)
        t0 = time.perf_counter()
        reports = prep(cfg, progress=not args.no_progress)
    except (ConfigError, PrepError, FileNotFoundError) as exc:
        print(f"slipstream prep: {exc}", file=sys.stderr)
        return 2
    for r in reports:
        print(
            f"{r.name}: {r.shards} shards ({r.tokenized} tokenized, {r.shards - r.tokenized} already done), "
            f"{r.tokens:,} tokens, {r.documents:,} documents -> {r.directory}"
        )
    print(f"prep finished in {time.perf_counter() - t0:.1f}s")
    return 0
