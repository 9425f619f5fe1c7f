"""The mixture of pretraining sources: which source, and which of its rows, every row of the run takes.

Each source is a set of training rows (seq_len + 1 ids) read in shuffled passes by its own `RowSampler`.
Global row g of the run comes from source i with probability p_i, where

    p_i = w_i ** (1 / T_i) / sum_j w_j ** (1 / T_j)        (w = weight, T = temperature)

so temperature 1 takes the weights as given, T > 1 flattens a source's share towards the others and T < 1
sharpens it. The draw for row g is a pure function of (seed, g): uniform numbers come in blocks of
`BLOCK` rows from a generator seeded by (seed, block), so no generator state needs saving. Row g's row
within its source is the source sampler's next one. The cursor (rows drawn so far, and every source's
epoch and position) is all the state: `restore(cursor())` continues the very same stream.

Every trainer rank builds the same global batch and the training core gives each rank its share, so the
stream, and a resume from its cursor, does not depend on the number of ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

BLOCK = 4096
"""Rows per block of mixture draws."""
_MIX_STREAM = 0x6D6978  # keeps the mixture's generator apart from the samplers' (seed, source, epoch)


class Rows(Protocol):
    """Training rows: len() of them, and rows[index array] -> [k, seq_len + 1] int64."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: np.ndarray) -> np.ndarray: ...


def effective_probabilities(weights: Sequence[float], temperatures: Sequence[float]) -> np.ndarray:
    """p_i proportional to weights_i ** (1 / temperatures_i)."""
    w = np.asarray(weights, dtype=np.float64) ** (1.0 / np.asarray(temperatures, dtype=np.float64))
    return w / w.sum()


class RowSampler:
    """Shuffled pass after pass over the rows; the cursor (epoch, position) is all its state. `stream`
    separates the orders of several sources of one seed (None: the order of a run with one source)."""

    def __init__(self, rows: Rows, seed: int, stream: int | None = None) -> None:
        self.rows = rows
        self.seed, self.stream = seed, stream
        self.epoch = 0
        self.position = 0
        self._order = self._shuffle(0)

    def _shuffle(self, epoch: int) -> np.ndarray:
        key = [self.seed, epoch] if self.stream is None else [self.seed, self.stream, epoch]
        return np.random.default_rng(key).permutation(len(self.rows))

    def next_rows(self, size: int) -> np.ndarray:
        """The next `size` rows, [size, seq_len + 1] int64."""
        picked: list[int] = []
        while len(picked) < size:
            if self.position == len(self.rows):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffle(self.epoch)
            take = min(size - len(picked), len(self.rows) - self.position)
            picked.extend(self._order[self.position : self.position + take])
            self.position += take
        return np.asarray(self.rows[np.asarray(picked, dtype=np.int64)], dtype=np.int64)

    def next_batch(self, size: int) -> torch.Tensor:
        return torch.from_numpy(self.next_rows(size))

    def cursor(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, cursor: dict[str, Any]) -> None:
        self.epoch, self.position = int(cursor["epoch"]), int(cursor["position"])
        self._order = self._shuffle(self.epoch)


class Mixture:
    """Rows drawn from named sources with fixed probabilities; `next_batch(n)` gives the next n rows of the
    run's one global stream."""

    def __init__(
        self, sources: Sequence[tuple[str, Rows]], probabilities: Sequence[float] | np.ndarray, seed: int
    ) -> None:
        if len(sources) != len(probabilities) or not sources:
            raise ValueError(f"{len(sources)} sources but {len(probabilities)} probabilities")
        self.names = [name for name, _ in sources]
        single = len(sources) == 1
        self.samplers = [RowSampler(rows, seed, None if single else i) for i, (_, rows) in enumerate(sources)]
        self.cdf = np.cumsum(np.asarray(probabilities, dtype=np.float64))
        self.cdf /= self.cdf[-1]
        self.seed = seed
        self.drawn = 0
        """Rows of the global stream handed out so far."""
        self._block: tuple[int, np.ndarray] = (-1, np.empty(0, dtype=np.int64))

    def choices(self, start: int, size: int) -> np.ndarray:
        """The source of global rows start .. start + size - 1 (a pure function of seed and row)."""
        if len(self.samplers) == 1:
            return np.zeros(size, dtype=np.int64)
        out = np.empty(size, dtype=np.int64)
        done = 0
        while done < size:
            g = start + done
            block, off = divmod(g, BLOCK)
            if self._block[0] != block:
                u = np.random.default_rng([self.seed, _MIX_STREAM, block]).random(BLOCK)
                self._block = (block, np.minimum(np.searchsorted(self.cdf, u, side="right"), len(self.cdf) - 1))
            take = min(size - done, BLOCK - off)
            out[done : done + take] = self._block[1][off : off + take]
            done += take
        return out

    def next_rows(self, size: int) -> np.ndarray:
        """The next `size` rows of the stream, [size, seq_len + 1] int64."""
        if size < 1:
            raise ValueError(f"a batch needs at least one row, asked for {size}")
        which = self.choices(self.drawn, size)
        out: np.ndarray | None = None
        for i, sampler in enumerate(self.samplers):
            mask = which == i
            n = int(mask.sum())
            if n:
                rows = sampler.next_rows(n)
                if out is None:
                    out = np.empty((size, rows.shape[1]), dtype=np.int64)
                out[mask] = rows
        assert out is not None
        self.drawn += size
        return out

    def next_batch(self, size: int) -> torch.Tensor:
        return torch.from_numpy(self.next_rows(size))

    def cursor(self) -> dict[str, Any]:
        """{"rows": drawn, "sources": {name: {"epoch", "position"}}}; one source: its sampler's cursor alone
        (the draws are then all 0), the format of checkpoints from before mixtures."""
        if len(self.samplers) == 1:
            return self.samplers[0].cursor()
        return {"rows": self.drawn, "sources": {n: s.cursor() for n, s in zip(self.names, self.samplers, strict=True)}}

    def restore(self, cursor: dict[str, Any]) -> None:
        if len(self.samplers) == 1 and "sources" not in cursor:
            self.samplers[0].restore(cursor)
            return
        saved = cursor.get("sources", {})
        if list(saved) != self.names:
            raise ValueError(
                f"the checkpoint's data cursor is for sources {list(saved) or 'of one file'}, the config has "
                f"{self.names}; resume with the sources the run started with, or start a new run directory"
            )
        self.drawn = int(cursor["rows"])
        for name, sampler in zip(self.names, self.samplers, strict=True):
            sampler.restore(saved[name])
