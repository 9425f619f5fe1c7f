"""Next-token pretraining, a driver of the training core (trainer/core.py): JSONL text through a
tokenizer, or pre-tokenized arrays, or a mixture of sources prepped into token shards by `slipstream prep`
(trainer/data/), packed into fixed-length rows (with trainer.pack, attention stays inside each EOS-ended
document: trainer/pack.py); the core does the rest (ranks,
optimizer, schedule, checkpoints). `ROLE=trainer` with `trainer.mode = "pretrain"` runs it on every
trainer rank (trainer/role.py); `python -m trainer.pretrain` runs one rank without the rendezvous. Loss, gradient norm, throughput and per-MoE-layer router telemetry
go to a metrics writer (anything with `log(tag, step, value)`, e.g. common.metrics.MetricsWriter).

    python -m trainer.pretrain CONFIG --data text.jsonl --tokenizer TOKENIZER_DIR --seq-len 256 \\
        --batch-size 8 [--run-dir DIR] [--set trainer.steps=100 ...]
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from common.config import Config, DataSourceConfig, add_set_argument, load_config
from trainer.checkpoint import CheckpointSchedule, TrainState
from trainer.core import TrainingCore, cross_entropy_loss
from trainer.data.mixture import Mixture, effective_probabilities
from trainer.data.shards import open_prepped
from trainer.data.tokenizer import TokenizerIdentity, load_tokenizer
from trainer.optim import StepStats, router_figures
from trainer.pack import stream_documents
from trainer.ranks import Ranks
from trainer.setup import resolve_device, starting_model

log = logging.getLogger(__name__)


class MetricsSink(Protocol):
    def log(self, tag: str, step: int, value: float) -> None: ...

    def flush(self) -> None: ...


@dataclass
class PretrainData:
    path: str
    """A .jsonl file of {text_key: str} objects, or a .npy array of token ids (1-D stream or 2-D rows)."""
    seq_len: int
    """Tokens per training row (each row holds seq_len + 1 ids: inputs and shifted targets)."""
    batch_size: int
    """Rows per micro-batch."""
    tokenizer: str = ""
    """HF tokenizer directory (tokenizer.json) for JSONL text; unused for arrays."""
    text_key: str = "text"
    """Field of each JSONL object that holds the text."""
    eos_id: int | None = None
    """Id appended after every document; None = the tokenizer's eos token."""
    sources: list[DataSourceConfig] = field(default_factory=list)
    """Instead of `path`: a mixture of sources prepped under `root` (trainer.data.sources); `tokenizer` must be
    the one they were prepped with."""
    root: str = ""
    """Directory of the prepped sources (trainer.data.root resolved)."""


def open_rows(data: PretrainData, seed: int, encode: Callable[[str], list[int]] | None = None) -> Mixture:
    """The run's row stream: the mixture of `data.sources`, or `data.path` as a mixture of one source.

    Prepped sources are only read: one that is not prepped raises NotPrepped naming `slipstream prep CONFIG`.
    Tokenizing them here instead would hold every rank (and its accelerator) idle for as long as the corpus
    takes, inside the launcher's restart policy and the ranks' collective timeouts; prep runs once, on as many
    cores as it is given, and is shared by every run under the same data root."""
    if not data.sources:
        return Mixture([(Path(data.path).stem, token_rows(data, encode))], [1.0], seed)
    tok = TokenizerIdentity.of(data.tokenizer)
    root = Path(data.root)
    rows = [(src.name, open_prepped(root, i, src, tok, data.seq_len)) for i, src in enumerate(data.sources)]
    probs = effective_probabilities([s.weight for s in data.sources], [s.temperature for s in data.sources])
    return Mixture(rows, probs, seed)


def token_rows(data: PretrainData, encode: Callable[[str], list[int]] | None = None) -> np.ndarray:
    """All training rows [N, seq_len + 1] (int64; -1 = no target) of a data source."""
    path = Path(data.path)
    width = data.seq_len + 1
    if path.suffix == ".npy":
        arr = np.load(path)
        if arr.ndim == 2:
            if arr.shape[1] != width:
                raise ValueError(f"{path}: rows have {arr.shape[1]} ids, expected seq_len + 1 = {width}")
            return arr.astype(np.int64)
        stream = arr.astype(np.int64).reshape(-1)
    elif path.suffix == ".jsonl":
        eos = data.eos_id
        if encode is None:
            if not data.tokenizer:
                raise ValueError(f"{path} is text: pass a tokenizer directory (--tokenizer)")
            encode, tok_eos = load_tokenizer(data.tokenizer)
            eos = tok_eos if eos is None else eos
        if eos is None:
            raise ValueError("no end-of-document id: the tokenizer has no eos_token; pass --eos-id")
        ids: list[int] = []
        with path.open() as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                obj = json.loads(line)
                if data.text_key not in obj:
                    raise ValueError(f"{path}:{n}: no {data.text_key!r} field (set --text-key)")
                ids.extend(encode(obj[data.text_key]))
                ids.append(eos)
        stream = np.asarray(ids, dtype=np.int64)
    else:
        raise ValueError(f"{path}: unknown data format {path.suffix!r}; use .jsonl (text) or .npy (token ids)")
    n_rows = (len(stream) - 1) // data.seq_len
    if n_rows < 1:
        raise ValueError(f"{path}: {len(stream)} tokens do not fill one row of seq_len + 1 = {width}")
    # Rows overlap by one token so every token except the very first is a target exactly once.
    idx = np.arange(n_rows)[:, None] * data.seq_len + np.arange(width)[None, :]
    return stream[idx]


class Pretrainer:
    """One next-token training run on the training core: `run()` trains `trainer.steps` optimizer steps,
    resuming if it can. Every rank reads the same rows; the core gives each its share."""

    def __init__(
        self,
        cfg: Config,
        data: PretrainData,
        run_dir: str | Path,
        metrics: MetricsSink | None = None,
        encode: Callable[[str], list[int]] | None = None,
        ranks: Ranks | None = None,
    ) -> None:
        self.cfg = cfg
        self.ranks = ranks if ranks is not None else Ranks.single(resolve_device(cfg.trainer.device))
        self.device = self.ranks.device
        self.run_dir = Path(run_dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.metrics = metrics
        self.data = data
        self.sampler = open_rows(data, cfg.run.seed, encode)
        self.core = TrainingCore(cfg, self.ranks, *starting_model(cfg, self.device))
        self.model, self.optimizer = self.core.model, self.core.optimizer
        self.state = self.core.resume(self.ckpt_root) or TrainState()
        if self.state.data_cursor:
            self.sampler.restore(self.state.data_cursor)
        self.eos: int | None = None
        """End-of-document id: packed rows keep attention inside each document (trainer.pack)."""
        if cfg.trainer.packs():
            self.eos = (
                data.eos_id if data.eos_id is not None or not data.tokenizer else load_tokenizer(data.tokenizer)[1]
            )
            if self.eos is None:
                log.warning(
                    "trainer.pack: no end-of-document id (pass --eos-id or a tokenizer with an eos token): rows "
                    "attend across documents"
                )

    def train_step(self) -> tuple[float, StepStats]:
        """One optimizer step over grad_accum micro-batches of batch_size rows (over all ranks); returns
        (mean loss per token, stats)."""
        oc = self.cfg.trainer.optim
        rows = torch.cat([self.sampler.next_batch(self.data.batch_size) for _ in range(oc.grad_accum)])
        targets = rows[:, 1:]
        n_targets = int((targets >= 0).sum())
        batch = {"tokens": rows[:, :-1].clamp(min=0), "targets": targets}
        if self.eos is not None:
            batch |= stream_documents(batch["tokens"], self.eos)
        per_forward = -(-self.data.batch_size // self.ranks.world)
        result = self.core.step(batch, cross_entropy_loss(n_targets), per_forward, tokens=n_targets)
        return result.figures["loss"], result.optim

    def _log(self, loss: float, stats: StepStats, tokens_per_s: float) -> None:
        if self.metrics is None or not self.ranks.is_main:
            return
        step = stats.step
        for tag, value in (
            ("train/loss", loss),
            ("train/grad_norm", stats.grad_norm),
            ("train/lr_factor", stats.lr_factor),
            ("train/tokens_per_s", tokens_per_s),
            ("train/bias_rate", stats.bias_rate),
        ):
            self.metrics.log(tag, step, value)
        for tag, value in router_figures(stats.router).items():
            self.metrics.log(tag, step, value)

    def save(self) -> Path:
        self.state.data_cursor = self.sampler.cursor()
        path = self.core.save(self.ckpt_root, self.state)
        if self.metrics is not None and self.ranks.is_main:
            # The figures of the steps a checkpoint holds are on disk with it: a resume never retrains them,
            # so a rank stopped before its next periodic flush (a gang restart) must not lose them.
            self.metrics.flush()
        return path

    def run(self, steps: int | None = None) -> list[float]:
        """Train until step `steps` (default trainer.steps); returns the losses of the steps run here."""
        target = self.cfg.trainer.steps if steps is None else steps
        ck = self.cfg.trainer.checkpoint
        schedule = CheckpointSchedule(ck.interval_steps, ck.interval_minutes)
        losses = []
        while self.state.step < target:
            t0 = time.perf_counter()
            loss, stats = self.train_step()
            self.state.step, self.state.tokens = stats.step, stats.tokens
            n_tokens = self.cfg.trainer.optim.grad_accum * self.data.batch_size * self.data.seq_len
            self._log(loss, stats, n_tokens / (time.perf_counter() - t0))
            losses.append(loss)
            if self.ranks.is_main:
                log.info("step %d loss %.4f grad_norm %.3f", stats.step, loss, stats.grad_norm)
            # Every rank must take the same decision (a save is collective): rank 0's clock decides.
            if self.state.step < target and self.ranks.broadcast(schedule.due(self.state.step)):
                self.save()
                schedule.saved()
        self.save()
        return losses


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m trainer.pretrain", description=__doc__.splitlines()[0])
    ap.add_argument("config", help="TOML config (the trainer section is used)")
    ap.add_argument("--data", required=True, help=".jsonl text or .npy token ids")
    ap.add_argument("--tokenizer", default="", help="HF tokenizer directory (for .jsonl)")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--text-key", default="text")
    ap.add_argument("--eos-id", type=int, default=None)
    ap.add_argument("--run-dir", default="", help="default: run.dir, else <run.root>/<run.name>")
    add_set_argument(ap)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s trainer %(message)s")
    cfg = load_config(args.config, args.overrides)
    run_dir = Path(args.run_dir or cfg.run.dir or Path(cfg.run.root) / cfg.run.name)
    data = PretrainData(args.data, args.seq_len, args.batch_size, args.tokenizer, args.text_key, args.eos_id)
    from common.metric_sinks import open_metrics

    with open_metrics(cfg, run_dir, cfg.run.name, "trainer") as metrics:
        Pretrainer(cfg, data, run_dir, metrics).run()


if __name__ == "__main__":
    main()
