"""Pretraining data: `slipstream prep` throughput with 1 and 2 tokenizing processes, and what the mixture
loader adds to a training step.

Corpus: two generated JSONL sources (about --mb MB of text in all; words of the tiny kit's vocabulary and
random letter runs, 5-200 words a document), tokenized with the tiny kit's tokenizer (the default config's).
Prep: wall time of `prep()` into a fresh data root, spawn of the worker processes included. Loader:
`Mixture.next_batch` of one step's rows (batch_size x grad_accum rows of seq_len + 1) against a whole
`Pretrainer.train_step` of the default tiny model on the same mixture.

Run: .venv/bin/python bench/data_bench.py [--mb 10] [--steps 10]
"""

from __future__ import annotations

import argparse
import json
import string
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.config import Config, DataSourceConfig  # noqa: E402
from trainer.data.prep import prep  # noqa: E402
from trainer.pretrain import PretrainData, Pretrainer  # noqa: E402
from trainer.tinykit import WORDS, build_tokenizer  # noqa: E402


def write_corpus(path: Path, mb: float, seed: int) -> None:
    rng = np.random.default_rng(seed)
    letters = np.array(list(string.ascii_lowercase))
    size, lines = 0, []
    while size < mb * (1 << 20):
        words = [
            WORDS[i] if rng.random() < 0.6 else "".join(rng.choice(letters, rng.integers(2, 9)))
            for i in rng.integers(0, len(WORDS), rng.integers(5, 201))
        ]
        line = json.dumps({"text": " ".join(words)}) + "\n"
        lines.append(line)
        size += len(line)
    path.write_text("".join(lines))


def config(tmp: Path, root: str, processes: int) -> Config:
    cfg = Config()
    d = cfg.trainer.data
    d.tokenizer = str(tmp / "tok")
    d.root, d.prep_processes, d.shard_mb = root, processes, 1.0
    d.sources = [
        DataSourceConfig("web", str(tmp / "web.jsonl"), weight=0.7),
        DataSourceConfig("code", str(tmp / "code.jsonl"), weight=0.3, temperature=2.0),
    ]
    d.seq_len, d.batch_size = 256, 8
    cfg.trainer.device = "cpu"
    return cfg


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=10.0, help="MB of generated text (two sources, 70/30)")
    ap.add_argument("--steps", type=int, default=10, help="timed training steps (after 2 warm-up steps)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        build_tokenizer(tmp / "tok")
        write_corpus(tmp / "web.jsonl", args.mb * 0.7, 1)
        write_corpus(tmp / "code.jsonl", args.mb * 0.3, 2)
        mb = sum((tmp / f).stat().st_size for f in ("web.jsonl", "code.jsonl")) / (1 << 20)
        print(f"corpus: {mb:.1f} MB of JSONL in two sources")
        print("| prep processes | shards | tokens | seconds | tokens/s | MB/s |")
        print("|---:|---:|---:|---:|---:|---:|")
        for processes in (1, 2):
            cfg = config(tmp, str(tmp / f"data{processes}"), processes)
            t0 = time.perf_counter()
            reports = prep(cfg, progress=False)
            dt = time.perf_counter() - t0
            tokens = sum(r.tokens for r in reports)
            shards = sum(r.shards for r in reports)
            print(f"| {processes} | {shards} | {tokens:,} | {dt:.2f} | {tokens / dt:,.0f} | {mb / dt:.2f} |")
        t0 = time.perf_counter()
        again = prep(cfg, progress=False)
        print(
            f"second prep of the same config: {sum(r.tokenized for r in again)} shards tokenized, "
            f"{time.perf_counter() - t0:.2f} s"
        )

        d = cfg.trainer.data
        data = PretrainData("", d.seq_len, d.batch_size, d.tokenizer, sources=d.sources, root=d.root)
        trainer = Pretrainer(cfg, data, tmp / "run")
        rows = d.batch_size * cfg.trainer.optim.grad_accum
        loads = []
        for _ in range(200):
            t0 = time.perf_counter()
            trainer.sampler.next_batch(rows)
            loads.append(time.perf_counter() - t0)
        steps = []
        for i in range(args.steps + 2):
            t0 = time.perf_counter()
            trainer.train_step()
            if i >= 2:
                steps.append(time.perf_counter() - t0)
        load_ms, step_ms = 1e3 * float(np.median(loads)), 1e3 * float(np.median(steps))
        print()
        print(
            "| rows per step (x seq_len + 1) | loader ms per step (median of 200) | train_step ms (median) | loader share |"
        )
        print("|---:|---:|---:|---:|")
        print(f"| {rows} x {d.seq_len + 1} | {load_ms:.3f} | {step_ms:.1f} | {load_ms / step_ms:.3%} |")


if __name__ == "__main__":
    main()
