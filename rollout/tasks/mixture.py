"""Prompt mixtures: several prompt sources, each with its own verifier, interleaved by weight into one task.

The order. Source s, with share p_s = weight / sum of weights, gives its k-th item the ideal position
(k + 1/2) / p_s; the mixture is every item sorted by ideal position (ties go to the earlier source). So
problem(index) is a pure function of the index and the config (no state, no seed): the flow's one-integer
cursor and an exact resume work as for any task. It is smooth: among the first i indices source s has
within 1/2 + m p_s / 2 of i p_s items (m sources), so any N consecutive indices hold N p_s of them up to
1 + m p_s, whatever N (a 64-prompt step included).

Each file source visits its rows in an order shuffled by its own seed (file order with shuffle = false);
item k of the arithmetic generator is its problem k, random already.

The end. The mixture ends just before the first source without `repeat` would run out: it holds every
item whose ideal position comes before that source's first missing one, so every share holds to the
last index and no row of such a source is seen twice. A source with `repeat` cycles through its rows, reshuffled on every
pass. The schedule is a table built at load (10 bytes per index kept, about 26 while sorting); problems
are made on demand.
Left out: sources that drop out and renormalise the rest (shares would drift at the end of the data).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from common.config import PromptSourceConfig, TaskConfig, source_format
from rollout.tasks import Problem
from rollout.tasks.arithmetic import ArithmeticTask
from rollout.tasks.sources import RecordKeys, read_problems
from rollout.tasks.verifiers import Verifier, make_verifier, resolved_verifier

log = logging.getLogger(__name__)

_MASK64 = (1 << 64) - 1


def interleave(weights: Sequence[float], sizes: Sequence[int | None]) -> tuple[np.ndarray, np.ndarray]:
    """(source, rank) of every index of the mixture: index i is item rank[i] of source source[i].

    sizes[s] is the number of items of source s, or None for a source that never runs out (repeat); at
    least one must be finite. Items are merged by ideal position (k + 1/2) / p_s, ties by source order,
    up to (excluded) the first missing item of a finite source.
    """
    total = float(sum(weights))
    shares = [w / total for w in weights]
    end = min((n + 0.5) / p for n, p in zip(sizes, shares, strict=True) if n is not None)
    positions, owners, ranks = [], [], []
    for s, p in enumerate(shares):
        k = np.arange(int(np.ceil(end * p)) + 1, dtype=np.int64)
        t = (k + 0.5) / p
        k, t = k[t < end], t[t < end]  # one formula for the bound and the items: float rounding cannot differ
        positions.append(t)
        ranks.append(k)
        owners.append(np.full(len(k), s, dtype=np.int16))
    position, owner, rank = np.concatenate(positions), np.concatenate(owners), np.concatenate(ranks)
    order = np.lexsort((owner, position))  # by position, then source
    return owner[order], rank[order]


def _scramble(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that spreads neighbouring inputs apart (wraps mod 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def shuffled_order(rows: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of range(rows), a pure function of (rows, seed, epoch) on every machine and numpy version.

    Rows are sorted by a bijective hash of (row + a per-(seed, epoch) offset): no ties, no RNG stream.
    """
    offset = _scramble(np.array([((seed & _MASK64) * 0x9E3779B97F4A7C15 + epoch) & _MASK64], dtype=np.uint64))
    with np.errstate(over="ignore"):
        keys = _scramble(np.arange(rows, dtype=np.uint64) + offset[0])
    return np.argsort(keys, kind="stable")


class MixtureSource:
    """One source of a mixture: its problems (file rows or the generator), row order and verifier."""

    def __init__(self, cfg: PromptSourceConfig, verifier: Verifier, rows: Sequence[Problem] | ArithmeticTask) -> None:
        self.cfg, self.verifier, self.rows = cfg, verifier, rows
        self.name = cfg.name
        self._orders: dict[int, np.ndarray] = {}  # pass -> row order, the few recent passes
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, src: PromptSourceConfig, task: TaskConfig, config_key: str) -> MixtureSource:
        verifier = make_verifier(src, task, config_key)
        if src.format == "arithmetic":
            generator = ArithmeticTask.from_config(src, max_completion_chars=task.max_completion_chars, name=src.name)
            return cls(src, verifier, generator)
        keys = RecordKeys(src.prompt_key, src.answer_key, src.id_key)
        problems = read_problems(src.path, source_format(src), keys, config_key, source=src.name)
        seen: set[str] = set()
        for p in problems:
            if p.id in seen:
                raise ValueError(
                    f"{config_key}: problem id {p.id!r} appears twice in {src.path}; ids must be unique: "
                    f'fix the file, or set id_key = "" to name rows by their line or row number'
                )
            seen.add(p.id)
        if resolved_verifier(src) == "arithmetic":
            # The arithmetic check compares integers: a reference that is not one would fail every completion.
            for p in problems:
                if not p.answer.strip().lstrip("-").isdigit():
                    raise ValueError(
                        f"{config_key}: problem {p.id!r} has answer {p.answer!r}, not an integer, which "
                        "the arithmetic verifier needs; use verifier = 'math' or 'exact'"
                    )
        return cls(src, verifier, problems)

    @property
    def generated(self) -> bool:
        return isinstance(self.rows, ArithmeticTask)

    def __len__(self) -> int:
        return len(self.rows)

    def item(self, k: int) -> Problem:
        """The source's k-th problem in mixture order (k may pass the row count when the source repeats)."""
        if isinstance(self.rows, ArithmeticTask):
            p = self.rows.problem(k)
            return dataclasses.replace(p, id=f"{self.name}/{p.id}", source=self.name)
        epoch, row = divmod(k, len(self.rows))
        if self.cfg.shuffle:
            row = int(self._order(epoch)[row])
        return self.rows[row]

    def _order(self, epoch: int) -> np.ndarray:
        with self._lock:
            order = self._orders.get(epoch)
            if order is None:
                order = self._orders[epoch] = shuffled_order(len(self.rows), self.cfg.seed, epoch)
                if len(self._orders) > 4:  # bounded memory: drop the oldest pass computed
                    del self._orders[next(iter(self._orders))]
            return order


@dataclass(frozen=True)
class SourceShare:
    """What one source contributes to a mixture."""

    name: str
    share: float
    rows: int
    items: int

    @property
    def passes(self) -> float:
        return self.items / self.rows


class MixtureTask:
    """Prompt sources interleaved by weight (see the module docstring); each problem rewarded by its source's verifier."""

    name = "mixture"

    def __init__(self, sources: Sequence[MixtureSource]) -> None:
        self.sources = list(sources)
        self._by_name = {s.name: s for s in self.sources}
        if len(self._by_name) != len(self.sources):
            raise ValueError(f"mixture source names must be unique, got {[s.name for s in self.sources]}")
        weights = [s.cfg.weight for s in self.sources]
        sizes = [None if s.cfg.repeat else len(s) for s in self.sources]
        self._source, self._rank = interleave(weights, sizes)

    @classmethod
    def from_config(cls, cfg: TaskConfig) -> MixtureTask:
        task = cls(
            [MixtureSource.from_config(src, cfg, f"rollout.task.sources[{i}]") for i, src in enumerate(cfg.sources)]
        )
        parts = [f"{s.name} {s.share:.1%} ({s.items} of {s.rows} rows, {s.passes:.2f} passes)" for s in task.shares()]
        log.info("task: mixture of %d problems: %s", len(task), "; ".join(parts))
        return task

    def shares(self) -> list[SourceShare]:
        total = sum(s.cfg.weight for s in self.sources)
        counts = np.bincount(self._source, minlength=len(self.sources))
        return [
            SourceShare(s.name, s.cfg.weight / total, len(s), int(c)) for s, c in zip(self.sources, counts, strict=True)
        ]

    def __len__(self) -> int:
        return len(self._source)

    def problem(self, index: int) -> Problem:
        if not 0 <= index < len(self):
            raise IndexError(f"mixture problem {index} is outside [0, {len(self)})")
        return self.sources[self._source[index]].item(int(self._rank[index]))

    def reward(self, problem: Problem, completion: str) -> float:
        source = self._by_name.get(problem.source)
        if source is None:
            raise ValueError(
                f"problem {problem.id!r} names source {problem.source!r}, which is not in this mixture "
                f"({', '.join(self._by_name)})"
            )
        return source.verifier(problem, completion)
