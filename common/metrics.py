"""Metrics: scalar time series in DuckDB, one file per run, role and rank.

Each file holds the table `metrics(run, role, rank, tag, step, ts_ms, value)`. Writers buffer
points and insert them in one statement per batch (when the buffer fills, on a timer, and at
exit). The writer opens its file only for the length of a flush, so readers (the evaluator, a
dashboard, a test) can read a live run between flushes. Each batch stored in DuckDB then goes to the
writer's other sinks (TensorBoard, W&B: common/metric_sinks.py) on a thread of their own: they cost tens of
microseconds a point, which must not hold up a role's `log`; a failing sink never costs DuckDB a point.
"""

from __future__ import annotations

import atexit
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import duckdb

log = logging.getLogger(__name__)

_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS metrics("
    "run VARCHAR, role VARCHAR, rank INTEGER, tag VARCHAR, step BIGINT, ts_ms BIGINT, value DOUBLE)"
)
# One statement per batch: DuckDB's executemany costs ~1 ms per row, unnest of lists ~3 us.
_INSERT = "INSERT INTO metrics SELECT $run, $role, $rank, unnest($tag), unnest($step), unnest($ts_ms), unnest($value)"


def metrics_path(run_dir: str | Path, role: str, rank: int = 0) -> Path:
    """The metrics file of one role and rank of a run."""
    return Path(run_dir) / "metrics" / f"{role}-{rank}.duckdb"


@dataclass(frozen=True)
class Point:
    run: str
    role: str
    rank: int
    tag: str
    step: int
    ts_ms: int
    value: float


class MetricSink(Protocol):
    """Another destination of a writer's points, fed each batch right after DuckDB stored it."""

    name: str

    def write(self, tags: Sequence[str], steps: Sequence[int], ts_ms: Sequence[int], values: Sequence[float]) -> None:
        """Take one batch (parallel lists, in logging order); raising loses only this sink's copy of it."""
        ...

    def close(self) -> None: ...


class MetricsWriter:
    """Buffered writer of one (run, role, rank) metrics file (and its extra sinks); thread-safe."""

    def __init__(
        self,
        run_dir: str | Path,
        run: str,
        role: str,
        rank: int = 0,
        batch_size: int = 1000,
        flush_interval_s: float = 5.0,
        sinks: Sequence[MetricSink] = (),
    ) -> None:
        self.path = metrics_path(run_dir, role, rank)
        self._sinks = _SinkFeeder(list(sinks), str(self.path)) if sinks else None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.run, self.role, self.rank = run, role, rank
        self.batch_size = batch_size
        self._lock = threading.Lock()
        self._tags: list[str] = []
        self._steps: list[int] = []
        self._ts: list[int] = []
        self._values: list[float] = []
        with _connect(self.path, read_only=False) as con:
            con.execute(_SCHEMA)
        self._closed = threading.Event()
        self._timer = threading.Thread(target=self._flush_periodically, args=(flush_interval_s,), daemon=True)
        self._timer.start()
        atexit.register(self.close)

    def log(self, tag: str, step: int, value: float, ts_ms: int | None = None) -> None:
        """Record one point; it reaches the file at the next flush."""
        if self._closed.is_set():
            raise RuntimeError(f"metrics writer {self.path} is closed; cannot log {tag!r}")
        with self._lock:
            self._tags.append(tag)
            self._steps.append(int(step))
            self._ts.append(int(time.time() * 1000) if ts_ms is None else int(ts_ms))
            self._values.append(float(value))
            full = len(self._tags) >= self.batch_size
        if full:
            self.flush()

    def log_many(self, step: int, values: Mapping[str, float]) -> None:
        """Record several tags at one step with one timestamp."""
        ts_ms = int(time.time() * 1000)
        for tag, value in values.items():
            self.log(tag, step, value, ts_ms)

    def flush(self) -> None:
        with self._lock:
            if not self._tags:
                return
            batch = {
                "run": self.run,
                "role": self.role,
                "rank": self.rank,
                "tag": self._tags,
                "step": self._steps,
                "ts_ms": self._ts,
                "value": self._values,
            }
            with _connect(self.path, read_only=False) as con:
                con.execute(_INSERT, batch)
            # Cleared only after the insert succeeded: a failed flush keeps the points for the next one.
            tags, steps, ts, values = self._tags, self._steps, self._ts, self._values
            self._tags, self._steps, self._ts, self._values = [], [], [], []
            if self._sinks is not None:  # queued under the lock: sinks get batches in the order DuckDB stored them
                self._sinks.put((tags, steps, ts, values))

    def _flush_periodically(self, interval_s: float) -> None:
        while not self._closed.wait(interval_s):
            try:
                self.flush()
            except duckdb.Error as exc:
                log.warning("metrics flush to %s failed (will retry): %s", self.path, exc)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._timer.join(timeout=5)
        try:
            self.flush()
        finally:
            if self._sinks is not None:
                self._sinks.close()
        atexit.unregister(self.close)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_Batch = tuple[list[str], list[int], list[int], list[float]]


class _SinkFeeder:
    """The thread that hands a writer's stored batches to its sinks, in order, and closes them at the end."""

    def __init__(self, sinks: list[MetricSink], source: str, close_timeout_s: float = 120.0) -> None:
        self.sinks, self.source, self.close_timeout_s = sinks, source, close_timeout_s
        self._queue: queue.SimpleQueue[_Batch | None] = queue.SimpleQueue()
        self._failed: set[str] = set()  # sinks whose failure was logged: logged once, not per batch
        self._thread = threading.Thread(target=self._run, name=f"metric sinks {source}", daemon=True)
        self._thread.start()

    def put(self, batch: _Batch) -> None:
        self._queue.put(batch)

    def close(self) -> None:
        """Write what is queued, close the sinks; a sink stuck past close_timeout_s is left behind, logged."""
        self._queue.put(None)
        self._thread.join(self.close_timeout_s)
        if self._thread.is_alive():
            log.error("metrics sinks of %s still busy after %.0fs; left unclosed", self.source, self.close_timeout_s)

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            for sink in self.sinks:
                self._call(sink, functools.partial(sink.write, *batch))
        for sink in self.sinks:
            self._call(sink, sink.close)

    def _call(self, sink: MetricSink, call: Callable[[], None]) -> None:
        """A failure is logged (once per sink) and swallowed: a broken TensorBoard directory or W&B service
        costs that sink its points, never DuckDB's, the other sinks' nor the role's."""
        try:
            call()
        except Exception:
            if sink.name not in self._failed:
                self._failed.add(sink.name)
                log.exception(
                    "metrics sink %s of %s failed; its points are dropped, DuckDB keeps them", sink.name, self.source
                )


def _connect(path: Path, read_only: bool, timeout_s: float = 10.0) -> duckdb.DuckDBPyConnection:
    """Open a metrics file, waiting out the other side's short hold: a writer holds its file only
    while it flushes, a reader only while it reads (milliseconds), and DuckDB lets one process in."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return duckdb.connect(str(path), read_only=read_only)
        except (duckdb.IOException, duckdb.ConnectionException) as exc:
            if time.monotonic() > deadline:
                raise TimeoutError(f"metrics file {path} stayed locked for {timeout_s}s: {exc}") from None
            time.sleep(0.01)


def read_metrics(run_dir: str | Path, tags: Iterable[str] | None = None, role: str | None = None) -> list[Point]:
    """Every point of a run (all roles and ranks), ordered by tag, step and time."""
    # Files are named <role>-<rank>.duckdb: open only the wanted role's, so a reader never holds
    # another role's file while that role flushes.
    files = sorted((Path(run_dir) / "metrics").glob(f"{role}-*.duckdb" if role else "*.duckdb"))
    wanted = list(tags) if tags is not None else None
    points: list[Point] = []
    for path in files:
        with _connect(path, read_only=True) as con:
            query = "SELECT run, role, rank, tag, step, ts_ms, value FROM metrics WHERE true"
            params: dict[str, object] = {}
            if wanted is not None:
                query += " AND list_contains($tags, tag)"
                params["tags"] = wanted
            if role is not None:
                query += " AND role = $role"
                params["role"] = role
            points.extend(Point(*row) for row in con.execute(query, params).fetchall())
    points.sort(key=lambda p: (p.tag, p.step, p.ts_ms, p.role, p.rank))
    return points


def step_series(run_dir: str | Path, tags: Iterable[str], role: str | None = None) -> dict[str, dict[int, float]]:
    """tag -> step -> value, each step's newest point (a step trained again after a resume counts once,
    with the figures of the run that kept it)."""
    series: dict[str, dict[int, float]] = {}
    for p in read_metrics(run_dir, tags, role):  # time-ordered within a step: the newest is written last
        series.setdefault(p.tag, {})[p.step] = p.value
    return series
