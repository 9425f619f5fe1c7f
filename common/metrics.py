"""Metrics: scalar time series, one directory of immutable segment files per run, role and rank.

A writer owns `<run>/metrics/<role>-<rank>/` and appends to it only by creating files: each flush writes
its buffered points as one Parquet segment (written by pyarrow) named by its batch numbers (`<first>-<last>.parquet`, first =
last for a flush), written under a hidden temporary name and renamed into place, so a reader sees a
segment whole or not at all. No file is ever locked or rewritten: readers (the console, the dashboard,
the evaluator, tests) never block a writer and a writer never waits for a reader (DuckDB allows one
process per database file, which is why a run's metrics are no longer DuckDB files; DuckDB still reads
and writes the segments). Every row carries its batch number `seq`, so a reader that keeps the highest
batch it has read (MetricsReader, SeriesCache) reads only what is new since.

Compaction keeps the file count small: when `fanin` neighbouring segments hold as many batches each, the
writer merges them into one (sorted by tag and step, so that a reader asking for a few tags skips most of
the file), renames it into place and only then removes the inputs; a reader listing the directory in
between keeps the widest file of each range (list_segments). Segments of 4096 batches are not merged
further. A flush that fails (a full disk) keeps its points, in order, for the next one; the flush thread
logs the failure once and retries, and never dies.

Each batch stored then goes to the writer's other sinks (TensorBoard, W&B: common/metric_sinks.py) on a
thread of their own: they cost tens of microseconds a point, which must not hold up a role's `log`; a
failing sink never costs the segments a point.

Runs written before segments (`<role>-<rank>.duckdb` files) are still read.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import logging
import math
import os
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import duckdb
import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

# A segment's columns: run, role, rank, tag, step, ts_ms, value, and seq, the batch (flush) number of its writer.
_POINT_COLUMNS = "run, role, rank, tag, step, ts_ms, value"
_SEGMENT = re.compile(r"^(\d{12})-(\d{12})\.parquet$")
TOP_SPAN = 4096
"""Segments of this many batches are not merged further (a merge then rewrites at most 1/16 of a run)."""
MERGE_MAX_BYTES = 32 << 20
"""Nor are segments that together hold more than this: a merge sorts its rows in the writer's process (a
role's background thread, one DuckDB thread), so it stays about 2 million rows and 200 MB of memory."""
LEGACY_SUFFIX = ".duckdb"


def metrics_path(run_dir: str | Path, role: str, rank: int = 0) -> Path:
    """The segment directory of one role and rank of a run."""
    return Path(run_dir) / "metrics" / f"{role}-{rank}"


def writer_dirs(run_dir: str | Path, role: str | None = None) -> list[Path]:
    """The segment directories of a run (every role and rank, or one role's ranks)."""
    root = Path(run_dir) / "metrics"
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob(f"{role}-*" if role else "*-*") if p.is_dir() and _is_series_name(p.name))


def has_metrics(run_dir: str | Path, role: str | None = None) -> bool:
    """Whether any writer of the run (or of `role`) has stored a point."""
    return any(list_segments(d) for d in writer_dirs(run_dir, role)) or bool(_legacy_files(run_dir, role))


def _is_series_name(name: str) -> bool:
    role, _, rank = name.rpartition("-")
    return bool(role) and rank.isdigit()


@dataclass(frozen=True)
class Point:
    run: str
    role: str
    rank: int
    tag: str
    step: int
    ts_ms: int
    value: float


@dataclass(frozen=True)
class Segment:
    """One immutable file of a writer: batches first..last."""

    first: int
    last: int
    path: Path

    @property
    def span(self) -> int:
        return self.last - self.first + 1


def _segment_name(first: int, last: int) -> str:
    return f"{first:012d}-{last:012d}.parquet"


def list_segments(directory: Path) -> list[Segment]:
    """The segments that hold each batch of a writer once, in batch order. A compaction renames its merged
    file into place before it removes the inputs: a listing made in between sees both, and keeps the wider."""
    found: list[Segment] = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if m := _SEGMENT.match(entry.name):
                found.append(Segment(int(m[1]), int(m[2]), Path(entry.path)))
    found.sort(key=lambda s: (s.first, -s.last))
    cover: list[Segment] = []
    for seg in found:
        if not cover or seg.first > cover[-1].last:
            cover.append(seg)
    return cover


class MetricSink(Protocol):
    """Another destination of a writer's points, fed each batch right after its segment was stored."""

    name: str

    def write(self, tags: Sequence[str], steps: Sequence[int], ts_ms: Sequence[int], values: Sequence[float]) -> None:
        """Take one batch (parallel lists, in logging order); raising loses only this sink's copy of it."""
        ...

    def close(self) -> None: ...


_Batch = tuple[list[str], list[int], list[int], list[float]]


class MetricsWriter:
    """Buffered writer of one (run, role, rank) segment directory (and its extra sinks); thread-safe.

    `log` only appends to memory: it never touches the disk nor waits for it. The flush thread writes the
    buffer every `flush_interval_s`, or as soon as `batch_size` points wait; `flush()` writes it now."""

    def __init__(
        self,
        run_dir: str | Path,
        run: str,
        role: str,
        rank: int = 0,
        batch_size: int = 1000,
        flush_interval_s: float = 5.0,
        sinks: Sequence[MetricSink] = (),
        fanin: int = 16,
    ) -> None:
        if fanin < 2:
            raise ValueError(f"metrics compaction fanin must be >= 2, got {fanin}")
        self.path = metrics_path(run_dir, role, rank)
        self.path.mkdir(parents=True, exist_ok=True)
        for stale in self.path.glob(".*.tmp"):  # a write cut off by a crash of this writer's last incarnation
            stale.unlink(missing_ok=True)
        segments = list_segments(self.path)
        self._next_seq = segments[-1].last + 1 if segments else 0  # a restarted role appends after its last batch
        self.run, self.role, self.rank = run, role, rank
        self.batch_size, self.fanin, self.flush_interval_s = batch_size, fanin, flush_interval_s
        self._sinks = _SinkFeeder(list(sinks), str(self.path)) if sinks else None
        self._lock = threading.Lock()  # the buffer: held for appends and swaps only, never across disk work
        self._io_lock = threading.Lock()  # the directory: one write or merge at a time, in batch order
        # In memory, this writer's own (used under _io_lock); one thread: it works beside the role's own.
        self._con = duckdb.connect(config={"threads": 1})
        self._tags: list[str] = []
        self._steps: list[int] = []
        self._ts: list[int] = []
        self._values: list[float] = []
        self._closed = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._flush_periodically, name=f"metrics {self.path}", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    def log(self, tag: str, step: int, value: float, ts_ms: int | None = None) -> None:
        """Record one point; it reaches disk at the next flush."""
        if self._closed.is_set():
            raise RuntimeError(f"metrics writer {self.path} is closed; cannot log {tag!r}")
        with self._lock:
            self._tags.append(tag)
            self._steps.append(int(step))
            self._ts.append(int(time.time() * 1000) if ts_ms is None else int(ts_ms))
            self._values.append(float(value))
            full = len(self._tags) >= self.batch_size
        if full:
            self._wake.set()

    def log_points(
        self, tags: Sequence[str], steps: Sequence[int], values: Sequence[float], ts_ms: int | None = None
    ) -> None:
        """Record many points at once (parallel sequences, e.g. one figure per sample of a step) at one time."""
        if not len(tags) == len(steps) == len(values):
            raise ValueError(
                f"log_points needs as many tags, steps and values; got {len(tags)}, {len(steps)}, {len(values)}"
            )
        if self._closed.is_set():
            raise RuntimeError(f"metrics writer {self.path} is closed; cannot log {len(tags)} points")
        ts = int(time.time() * 1000) if ts_ms is None else int(ts_ms)
        with self._lock:
            self._tags.extend(tags)
            self._steps.extend(int(s) for s in steps)
            self._ts.extend([ts] * len(tags))
            self._values.extend(float(v) for v in values)
            full = len(self._tags) >= self.batch_size
        if full:
            self._wake.set()

    def log_many(self, step: int, values: Mapping[str, float]) -> None:
        """Record several tags at one step with one timestamp."""
        ts_ms = int(time.time() * 1000)
        for tag, value in values.items():
            self.log(tag, step, value, ts_ms)

    def flush(self) -> None:
        """Write what is buffered as one segment. On failure its points go back to the buffer, ahead of any
        logged since, and the error is raised: the next flush writes them."""
        with self._io_lock:
            with self._lock:
                batch: _Batch = (self._tags, self._steps, self._ts, self._values)
                self._tags, self._steps, self._ts, self._values = [], [], [], []
            if not batch[0]:
                return
            try:
                self._write_segment(batch)
            except BaseException:
                with self._lock:
                    self._tags, self._steps = batch[0] + self._tags, batch[1] + self._steps
                    self._ts, self._values = batch[2] + self._ts, batch[3] + self._values
                raise
            if self._sinks is not None:  # queued under _io_lock: sinks get batches in the order they were stored
                self._sinks.put(batch)

    def _write_segment(self, batch: _Batch) -> None:
        seq = self._next_seq
        final = self.path / _segment_name(seq, seq)
        tags, steps, ts, values = batch
        n = len(tags)
        columns = {
            "run": pa.array([self.run] * n, pa.string()),
            "role": pa.array([self.role] * n, pa.string()),
            "rank": pa.array([self.rank] * n, pa.int32()),
            "tag": pa.array(tags, pa.string()),
            "step": pa.array(steps, pa.int64()),
            "ts_ms": pa.array(ts, pa.int64()),
            "value": pa.array(values, pa.float64()),
            "seq": pa.array([seq] * n, pa.int64()),
        }
        stats: dict[str, list[int]] = {}
        for tag, step in zip(tags, steps, strict=True):
            if (st := stats.get(tag)) is None:
                stats[tag] = [1, step, step]
            else:
                st[0] += 1
                st[1], st[2] = min(st[1], step), max(st[2], step)
        _write_atomically(pa.table(columns), stats, final)  # pyarrow: ~15x faster than through DuckDB
        self._next_seq = seq + 1

    def compact(self) -> int:
        """Merge each run of `fanin` neighbouring segments of one span (below TOP_SPAN) into one; returns how
        many merges were made. A failed merge leaves its inputs in place (nothing is lost) and is raised."""
        merges = 0
        with self._io_lock:
            while group := self._mergeable(list_segments(self.path)):
                first, last = group[0].first, group[-1].last
                final = self.path / _segment_name(first, last)
                files = [str(s.path) for s in group]
                query = (
                    "SELECT * EXCLUDE (file_row_number) FROM read_parquet($files, file_row_number = true) "
                    "ORDER BY tag, step, ts_ms, seq, file_row_number"
                )
                stats = merge_tag_stats(read_tag_stats(s.path) for s in group)
                _write_atomically(self._con.sql(query, params={"files": files}).to_arrow_table(), stats, final)
                for seg in group:  # only after the merged file is in place: readers see one or the other
                    seg.path.unlink(missing_ok=True)
                merges += 1
        return merges

    def _mergeable(self, segments: list[Segment]) -> list[Segment] | None:
        for i in range(len(segments) - self.fanin + 1):
            group = segments[i : i + self.fanin]
            span = group[0].span
            if span * self.fanin > TOP_SPAN or any(s.span != span for s in group):
                continue
            with contextlib.suppress(FileNotFoundError):
                if sum(s.path.stat().st_size for s in group) <= MERGE_MAX_BYTES:
                    return group
        return None

    def _flush_periodically(self) -> None:
        """Flush on the timer or when a batch is full, then compact. Any failure is logged (once until it
        clears) and retried: the points stay buffered and this thread goes on."""
        failing = ""
        while True:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            if self._closed.is_set():
                return  # close() writes the rest itself
            try:
                self.flush()
                self.compact()
            except Exception as exc:
                if not failing:
                    log.warning(
                        "metrics flush to %s failed; its %d points stay buffered and are retried every %.0fs: %s",
                        self.path,
                        len(self._tags),
                        self.flush_interval_s,
                        exc,
                    )
                failing = str(exc)
                continue
            if failing:
                log.warning("metrics flush to %s works again (it had failed: %s)", self.path, failing)
                failing = ""

    def close(self) -> None:
        """Stop the flush thread and write what is left; raises if that last write fails."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=120)
        try:
            self.flush()
        finally:
            if self._sinks is not None:
                self._sinks.close()
            self._con.close()
        atexit.unregister(self.close)

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        costs that sink its points, never the segments', the other sinks' nor the role's."""
        try:
            call()
        except Exception:
            if sink.name not in self._failed:
                self._failed.add(sink.name)
                log.exception(
                    "metrics sink %s of %s failed; its points are dropped, the segments keep them",
                    sink.name,
                    self.source,
                )


TAG_STATS_KEY = b"slipstream.tag_stats"
"""A segment's footer entry: JSON {tag: [rows, min step, max step]}, so readers size their reads unscanned."""
_DELTA = {"step": "DELTA_BINARY_PACKED", "ts_ms": "DELTA_BINARY_PACKED", "seq": "DELTA_BINARY_PACKED"}
ROW_GROUP_ROWS = 128 * 1024  # merged files are sorted by tag: small row groups let a tag filter skip the others


def _write_atomically(table: pa.Table, stats: Mapping[str, Sequence[int]], final: Path) -> None:
    """Write a segment under a hidden name and rename it in; on failure nothing is left behind (the file is
    closed first, so a full disk gets its space back)."""
    tmp = final.with_name(f".{final.name}.tmp")
    table = table.replace_schema_metadata({TAG_STATS_KEY: json.dumps(stats, separators=(",", ":")).encode()})
    try:
        with open(tmp, "wb") as f:
            pq.write_table(
                table,
                f,
                compression="zstd",
                row_group_size=ROW_GROUP_ROWS,
                use_dictionary=["run", "role", "rank", "tag"],
                column_encoding=_DELTA,  # 30-40% smaller than dictionaries of steps and times that never repeat
            )
        os.replace(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def read_tag_stats(path: Path) -> dict[str, list[int]]:
    """tag -> [rows, min step, max step] of one segment, from its footer."""
    meta = pq.read_schema(path).metadata or {}
    if TAG_STATS_KEY not in meta:
        raise ValueError(
            f"metrics segment {path} has no {TAG_STATS_KEY.decode()} footer entry; it was not written by common.metrics"
        )
    return json.loads(meta[TAG_STATS_KEY])


def merge_tag_stats(parts: Iterable[Mapping[str, Sequence[int]]]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for part in parts:
        for tag, (n, lo, hi) in part.items():
            if (st := out.get(tag)) is None:
                out[tag] = [n, lo, hi]
            else:
                out[tag] = [st[0] + n, min(st[1], lo), max(st[2], hi)]
    return out


# --- reading -------------------------------------------------------------------------------------------------

_RETRIES = 20  # a compaction may remove a listed segment before it is read: list again


def _legacy_files(run_dir: str | Path, role: str | None) -> list[Path]:
    root = Path(run_dir) / "metrics"
    return sorted(root.glob(f"{role}-*{LEGACY_SUFFIX}" if role else f"*{LEGACY_SUFFIX}")) if root.is_dir() else []


def _tag_filter(tags: Sequence[str] | None, prefixes: Sequence[str]) -> tuple[str, dict[str, object]]:
    """SQL selecting the wanted tags (all when neither is given) and its parameters."""
    if tags is None and not prefixes:
        return "true", {}
    terms: list[str] = []
    params: dict[str, object] = {}
    if tags is not None:
        terms.append("list_contains($tags, tag)")
        params["tags"] = list(tags)
    for i, prefix in enumerate(prefixes):
        terms.append(f"starts_with(tag, $prefix{i})")
        params[f"prefix{i}"] = prefix
    return "(" + " OR ".join(terms) + ")", params


Fetch = Callable[[duckdb.DuckDBPyConnection, str, dict[str, object], "list[Segment] | None"], list[tuple]]
"""A query run over each writer's new rows: (connection, SQL relation, its parameters, the segments it reads
or None for a file from before segments) -> rows."""


class MetricsReader:
    """Reads a run's points incrementally: each `read()` returns the points stored since the previous call
    (all of them the first time), of every role and rank or of one role, of every tag or only of `tags` and
    of the tags starting with one of `prefixes`. Never blocks a writer: it only reads renamed-in files."""

    def __init__(
        self,
        run_dir: str | Path,
        role: str | None = None,
        tags: Iterable[str] | None = None,
        prefixes: Sequence[str] = (),
        upto: Mapping[Path, int] | None = None,
    ) -> None:
        """`upto` (writer directory -> batch) reads only those writers' batches up to those (a backlog)."""
        self.run_dir, self.role, self.upto = Path(run_dir), role, upto
        self._tags = None if tags is None else set(tags)
        self._prefixes = tuple(prefixes)
        self._filter, self._params = _tag_filter(None if tags is None else list(tags), prefixes)
        self._high: dict[Path, int] = {}  # writer directory -> highest batch read
        self._legacy_done: set[Path] = set()
        self._con = duckdb.connect()

    def high(self) -> dict[Path, int]:
        """writer directory -> the highest batch read so far."""
        return dict(self._high)

    def wants(self, tag: str) -> bool:
        """Whether `tag` passes this reader's tag filter."""
        return (self._tags is None and not self._prefixes) or (
            (self._tags is not None and tag in self._tags) or any(tag.startswith(p) for p in self._prefixes)
        )

    def close(self) -> None:
        self._con.close()

    def __enter__(self) -> MetricsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def read(self) -> list[Point]:
        """The new points, ordered by tag, step and time (a step's newest point last)."""

        def fetch(con: duckdb.DuckDBPyConnection, source: str, params: dict[str, object], _: object) -> list[tuple]:
            return con.execute(f"SELECT {_POINT_COLUMNS}, seq, file_row_number FROM {source}", params).fetchall()

        rows = self.each_new(fetch)
        rows.sort(key=lambda r: (r[3], r[4], r[5], r[7], r[8], r[1], r[2]))
        return [Point(*row[:7]) for row in rows]

    def each_new(self, fetch: Fetch) -> list[tuple]:
        """What `fetch(con, source, params, segments)` returns for each writer's rows not read yet; `source` is
        a SQL relation of the segment columns plus `file_row_number`, already filtered to the wanted tags.
        Marks them read once fetched."""
        out: list[tuple] = []
        for directory in writer_dirs(self.run_dir, self.role):
            if self.upto is not None and directory not in self.upto:
                continue
            high = self._high.get(directory, -1)
            end = math.inf if self.upto is None else self.upto[directory]
            for attempt in range(_RETRIES):
                fresh = [s for s in list_segments(directory) if s.last > high and s.first <= end]
                if not fresh:
                    break
                source = (
                    "(SELECT * FROM read_parquet($files, file_row_number = true) "
                    f"WHERE seq > $high AND seq <= $end AND {self._filter})"
                )
                last = min(fresh[-1].last, end)
                params = {**self._params, "files": [str(s.path) for s in fresh], "high": high, "end": last}
                try:
                    out.extend(fetch(self._con, source, params, fresh))
                except (duckdb.IOException, FileNotFoundError):
                    if attempt == _RETRIES - 1:
                        raise
                    continue  # a merge removed one of them since they were listed: list again
                self._high[directory] = int(last)
                break
        for path in [] if self.upto is not None else _legacy_files(self.run_dir, self.role):
            if path in self._legacy_done:
                continue
            with duckdb.connect(str(path), read_only=True) as con:  # a run from before segments: no writer left
                source = f"(SELECT *, -1::BIGINT AS seq, rowid AS file_row_number FROM metrics WHERE {self._filter})"
                out.extend(fetch(con, source, dict(self._params), None))
            self._legacy_done.add(path)
        return out


def read_metrics(run_dir: str | Path, tags: Iterable[str] | None = None, role: str | None = None) -> list[Point]:
    """Every point of a run (all roles and ranks, or one role), ordered by tag, step and time."""
    with MetricsReader(run_dir, role, tags) as reader:
        return reader.read()


def step_series(run_dir: str | Path, tags: Iterable[str], role: str | None = None) -> dict[str, dict[int, float]]:
    """tag -> step -> value, each step's newest point (a step trained again after a resume counts once,
    with the figures of the run that kept it)."""
    series: dict[str, dict[int, float]] = {}
    for p in read_metrics(run_dir, tags, role):  # time-ordered within a step: the newest is written last
        series.setdefault(p.tag, {})[p.step] = p.value
    return series


@dataclass(frozen=True)
class StepPoint:
    step: int
    ts_ms: int
    value: float


@dataclass
class _Tag:
    stride: int = 1
    points: dict[int, StepPoint] = field(default_factory=dict)  # steps divisible by stride
    first: StepPoint | None = None
    latest: StepPoint | None = None

    def add(self, p: StepPoint) -> None:
        """A point newer than (or as new as) what is kept for its step replaces it."""
        if p.step % self.stride == 0:
            old = self.points.get(p.step)
            if old is None or p.ts_ms >= old.ts_ms:
                self.points[p.step] = p
        if (
            self.first is None
            or p.step < self.first.step
            or (p.step == self.first.step and p.ts_ms >= self.first.ts_ms)
        ):
            self.first = p
        if (
            self.latest is None
            or p.step > self.latest.step
            or (p.step == self.latest.step and p.ts_ms >= self.latest.ts_ms)
        ):
            self.latest = p

    def thin(self, max_points: int) -> None:
        while len(self.points) > 2 * max_points:
            self.stride *= 2
            self.points = {s: p for s, p in self.points.items() if s % self.stride == 0}

    def series(self) -> dict[int, StepPoint]:
        out = dict(self.points)
        for end in (self.first, self.latest):
            if end is not None:
                out[end.step] = end
        return dict(sorted(out.items()))


class SeriesCache:
    """tag -> step -> newest point of a run, kept current by reading only what was stored since the last
    `update()`. With `max_points`, a tag of more steps keeps every stride-th step (the stride doubles as the
    run grows, so between max_points and 2 x max_points of them) plus its first and newest: a plot of a
    10,000-step run costs as much as one of a short run, and the newest figures are exact.

    With `defer_rows`, a first read leaves out the tags that hold more rows than that (the per-sample gen/*
    figures: 7 million rows a tag in a 10,000-step demo, against 10,000 for a per-step figure): everything else
    is there at once, and the next `update()` reads those tags' backlog (`pending` says one waits)."""

    def __init__(
        self,
        run_dir: str | Path,
        role: str | None = None,
        tags: Iterable[str] | None = None,
        prefixes: Sequence[str] = (),
        max_points: int | None = None,
        defer_rows: int | None = None,
    ) -> None:
        if max_points is not None and max_points < 1:
            raise ValueError(f"max_points must be >= 1 or None, got {max_points}")
        if defer_rows is not None and max_points is None:
            raise ValueError("defer_rows needs max_points (a deferred tag is read thinned)")
        self.run_dir, self.role = Path(run_dir), role
        self.max_points, self.defer_rows = max_points, defer_rows
        self._reader = MetricsReader(run_dir, role, tags, prefixes)
        self._tags: dict[str, _Tag] = {}
        self._deferring: set[str] = set()  # left out of this update's read
        self._backlog: MetricsReader | None = None  # reads them, up to where the main reader had read
        self._reading_backlog = False

    @property
    def pending(self) -> bool:
        """Whether deferred tags wait for the next update."""
        return self._backlog is not None

    def close(self) -> None:
        self._reader.close()
        if self._backlog is not None:
            self._backlog.close()

    def update(self) -> bool:
        """Read what is new (and a deferred backlog); True when anything was read or deferred."""
        rows: list[tuple] = []
        if self._backlog is not None:
            self._reading_backlog = True
            try:
                rows += self._backlog.each_new(self._fetch)
            finally:
                self._reading_backlog = False
            self._backlog.close()
            self._backlog = None
        rows += self._reader.each_new(self._fetch)
        deferred = bool(self._deferring)
        if deferred:
            self._backlog = MetricsReader(self.run_dir, self.role, self._deferring, upto=self._reader.high())
            self._deferring = set()
        rows.sort(key=lambda r: (r[0], r[1], r[2], r[4], r[5]))  # tag, step, time, batch, row: newest last
        for tag, step, ts_ms, value, *_ in rows:
            self._tags.setdefault(tag, _Tag()).add(StepPoint(step, ts_ms, value))
        if self.max_points is not None:
            for t in self._tags.values():
                t.thin(self.max_points)
        return bool(rows) or deferred

    def _fetch(
        self, con: duckdb.DuckDBPyConnection, source: str, params: dict[str, object], segments: list[Segment] | None
    ) -> list[tuple]:
        """The new rows; with max_points, each tag's at its stride, chosen from the tag's new row count before
        they are fetched (from the segments' footers: a first read of a long run scans once and moves only the
        points it keeps), and its ends. A segment read in part (merged after some of its batches were read)
        counts whole: its stride may come out larger, never the ends wrong (a step beyond what it read was
        read before, and kept)."""
        columns = "SELECT r.tag, r.step, r.ts_ms, r.value, r.seq, r.file_row_number"
        if self.max_points is None:
            return con.execute(f"{columns} FROM {source} r", params).fetchall()
        if segments is None:
            query = f"SELECT tag, count(*), min(step), max(step) FROM {source} GROUP BY tag"
            stats = [(tag, n, lo, hi) for tag, n, lo, hi in con.execute(query, params).fetchall()]
        else:
            merged = merge_tag_stats(read_tag_stats(seg.path) for seg in segments)
            stats = [(tag, n, lo, hi) for tag, (n, lo, hi) in merged.items() if self._reader.wants(tag)]
        ends: dict[str, tuple[int, int, int]] = {}
        for tag, n, lo, hi in stats:
            first_sight = tag not in self._tags and not self._reading_backlog and segments is not None
            if first_sight and (tag in self._deferring or (self.defer_rows is not None and n > self.defer_rows)):
                self._deferring.add(tag)  # left out of the query below (the join keeps the tags of `ends`)
                continue
            t = self._tags.setdefault(tag, _Tag())
            kept, stride = len(t.points), t.stride
            while kept + n / stride > 2 * self.max_points:
                stride, kept = stride * 2, kept // 2
            if stride != t.stride:
                t.stride = stride
                t.points = {s: p for s, p in t.points.items() if s % stride == 0}
            ends[tag] = (stride, lo, hi)
        if not ends:
            return []
        if all(stride == 1 for stride, _, _ in ends.values()) and len(ends) == len(stats):
            return con.execute(f"{columns} FROM {source} r", params).fetchall()
        strides = (
            "(SELECT unnest($s_tag) AS tag, unnest($s_stride) AS stride, unnest($s_lo) AS lo, unnest($s_hi) AS hi)"
        )
        query = (
            f"{columns} FROM {source} r JOIN {strides} s ON r.tag = s.tag "
            "WHERE r.step % s.stride = 0 OR r.step = s.lo OR r.step = s.hi"
        )
        params = {**params, "s_tag": list(ends), "s_stride": [e[0] for e in ends.values()]}
        params |= {"s_lo": [e[1] for e in ends.values()], "s_hi": [e[2] for e in ends.values()]}
        return con.execute(query, params).fetchall()

    def series(self) -> dict[str, dict[int, StepPoint]]:
        """tag -> step -> point, in step order (thinned as the class says)."""
        return {tag: t.series() for tag, t in sorted(self._tags.items())}

    def last(self, tag: str) -> StepPoint | None:
        """The newest step's point of `tag` (exact whatever the thinning)."""
        t = self._tags.get(tag)
        return None if t is None else t.latest

    def first(self, tag: str) -> StepPoint | None:
        """The first step's point of `tag` (exact whatever the thinning)."""
        t = self._tags.get(tag)
        return None if t is None else t.first

    def tags(self) -> list[str]:
        return sorted(self._tags)
