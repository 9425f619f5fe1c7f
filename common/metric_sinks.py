"""Metric sinks beside DuckDB: TensorBoard event files and W&B runs, fed by a role's MetricsWriter.

`metrics.sinks` in the config picks them; `open_metrics` builds a role-rank's writer with them. Each role
and rank is its own series of the experiment: TensorBoard gets `<run_dir>/tensorboard/<role>-<rank>/` (one
event directory per writer, so TensorBoard lists each role-rank as a run; tags unchanged) and W&B one run per
role-rank named `<role>-<rank>` in the group `<experiment>` (W&B's convention for multi-process jobs; its
shared mode needs the server, so it is no use offline), all files under `<run_dir>/wandb/`. Both get the
resolved config and the git revision. Our tags count steps independently (eval points for a version arrive
after later training steps), so W&B logs each tag with its own step metric `step/<tag>` (`define_metric`) and
lets its row counter `_step` run free. The readers at the bottom read both back with no network: tests
compare them with DuckDB, point for point.

TensorBoard is written with the tensorboard package's own EventFileWriter and event protos rather than
`torch.utils.tensorboard`: the roles then need no torch import to log, and scalars go out as `simple_value`
(what TensorBoard's EventAccumulator lists under Scalars; tensorboard.summary.Writer writes tensors instead).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError, to_toml
from common.metrics import MetricSink, MetricsWriter

# The package each extra sink imports; a configured sink whose package is missing stops the role at start.
SINK_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}
# W&B's own history keys (row counter, wall time, run time) and our per-tag step metrics: not metric tags.
_WANDB_STEP_PREFIX = "step/"


def tensorboard_dir(run_dir: str | Path, role: str, rank: int) -> Path:
    """The event directory of one role-rank: TensorBoard shows each as a run of `<run_dir>/tensorboard`."""
    return Path(run_dir) / "tensorboard" / f"{role}-{rank}"


def wandb_dir(run_dir: str | Path) -> Path:
    """Where W&B writes everything of a run (its offline runs, logs, cache, settings)."""
    return Path(run_dir) / "wandb"


@dataclasses.dataclass(frozen=True)
class RunInfo:
    """What every sink attaches to its series: the experiment, the resolved config and the source revision."""

    exp: str
    role: str
    rank: int
    config: dict[str, Any]
    config_toml: str
    git_sha: str
    git_dirty: bool | None

    @property
    def series(self) -> str:
        return f"{self.role}-{self.rank}"


def run_info(cfg: Config, exp: str, role: str, rank: int) -> RunInfo:
    from common.gitinfo import git_sha

    sha, dirty = git_sha()
    return RunInfo(exp, role, rank, dataclasses.asdict(cfg), to_toml(cfg), sha, dirty)


class TensorBoardSink:
    """One role-rank's event file; every batch is flushed to disk before `write` returns, so a killed role
    loses no point that DuckDB holds (bar the instant between the two writes)."""

    name = "tensorboard"

    def __init__(self, logdir: Path, info: RunInfo) -> None:
        from tensorboard.compat.proto import event_pb2, summary_pb2
        from tensorboard.plugins.text.summary_v2 import text_pb
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = event_pb2.Event, summary_pb2.Summary
        logdir.mkdir(parents=True, exist_ok=True)
        self.logdir = logdir
        self._writer = EventFileWriter(str(logdir), max_queue_size=4096)  # a batch in one hand-off, not 10 at a time
        dirty = {True: " (with uncommitted changes)", False: "", None: " (dirty state unknown)"}[info.git_dirty]
        for tag, text in (
            ("run/config", f"```toml\n{info.config_toml}\n```"),
            ("run/git", f"{info.git_sha}{dirty}"),
            ("run/experiment", f"{info.exp} ({info.series})"),
        ):
            self._writer.add_event(self._event(step=0, summary=text_pb(tag, text)))
        self._writer.flush()

    def write(self, tags: Sequence[str], steps: Sequence[int], ts_ms: Sequence[int], values: Sequence[float]) -> None:
        for tag, step, ts, value in zip(tags, steps, ts_ms, values, strict=True):
            summary = self._summary(value=[self._summary.Value(tag=tag, simple_value=value)])
            self._writer.add_event(self._event(wall_time=ts / 1000, step=step, summary=summary))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """One W&B run per role-rank (`<role>-<rank>` in group `<experiment>`), each tag on its own step metric."""

    name = "wandb"

    def __init__(self, root: Path, info: RunInfo, project: str, entity: str, mode: str) -> None:
        root.mkdir(parents=True, exist_ok=True)
        # W&B reads these when it starts; unset, it writes its cache, settings and artifacts under $HOME.
        # A user's own setting wins (setdefault): the run's files stay under the run dir unless asked otherwise.
        for var in ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
            os.environ.setdefault(var, str(root))
        import wandb

        config = {**info.config, "git_sha": info.git_sha, "git_dirty": info.git_dirty, "experiment": info.exp}
        self.run = wandb.init(
            project=project,
            entity=entity or None,
            group=info.exp,
            name=info.series,
            job_type=info.role,
            dir=str(root),
            config=config,
            mode=mode,  # type: ignore[arg-type]
            reinit="create_new",  # a process may hold several writers (tests do); each is its own run
            # console="off": W&B would otherwise wrap the role's stdout/stderr; no system stats: roles have their own.
            settings=wandb.Settings(console="off", x_disable_stats=True, silent=True),
        )
        self._defined: set[str] = set()

    def write(self, tags: Sequence[str], steps: Sequence[int], ts_ms: Sequence[int], values: Sequence[float]) -> None:
        for row in wandb_rows(tags, steps, values):
            for tag in row.keys() - self._defined:
                if tag.startswith(_WANDB_STEP_PREFIX):
                    continue
                self.run.define_metric(_WANDB_STEP_PREFIX + tag, hidden=True)
                self.run.define_metric(tag, step_metric=_WANDB_STEP_PREFIX + tag)
                self._defined.add(tag)
            self.run.log(row)

    def close(self) -> None:
        self.run.finish()


def wandb_rows(tags: Sequence[str], steps: Sequence[int], values: Sequence[float]) -> list[dict[str, float]]:
    """A batch as W&B history rows in logging order: each row holds a tag at most once, with its step under
    `step/<tag>`; a tag seen again starts the next row (a row is one W&B `_step`)."""
    rows: list[dict[str, float]] = []
    row: dict[str, float] = {}
    for tag, step, value in zip(tags, steps, values, strict=True):
        if tag.startswith(_WANDB_STEP_PREFIX):
            raise ValueError(f"metric tag {tag!r} starts with {_WANDB_STEP_PREFIX!r}, the W&B sink's step metrics")
        if tag in row:
            rows.append(row)
            row = {}
        row[tag] = value
        row[_WANDB_STEP_PREFIX + tag] = step
    if row:
        rows.append(row)
    return rows


def require_sink_packages(sinks: Sequence[str]) -> None:
    """Fail at role start, naming the package and the install command, when a configured sink cannot load."""
    for sink in sinks:
        package = SINK_PACKAGES.get(sink)
        if package is None:
            continue
        try:
            importlib.import_module(package)
        except ImportError as exc:
            raise ConfigError(
                f"metrics.sinks includes {sink!r} but the {package!r} package is not installed ({exc}): "
                f"pip install 'slipstream[tools]' (or pip install {package}), or remove {sink!r} from metrics.sinks"
            ) from exc


def build_sinks(cfg: Config, run_dir: str | Path, exp: str, role: str, rank: int) -> list[MetricSink]:
    """The extra sinks `metrics.sinks` asks for, opened for one role-rank (DuckDB is the writer itself)."""
    m = cfg.metrics
    require_sink_packages(m.sinks)
    extra = [s for s in m.sinks if s != "duckdb"]
    if not extra:
        return []
    info = run_info(cfg, exp, role, rank)
    sinks: list[MetricSink] = []
    for sink in extra:
        if sink == "tensorboard":
            sinks.append(TensorBoardSink(tensorboard_dir(run_dir, role, rank), info))
        elif sink == "wandb":
            sinks.append(WandbSink(wandb_dir(run_dir), info, m.wandb_project, m.wandb_entity, m.wandb_mode))
        else:
            raise ConfigError(f"metrics.sinks: unknown sink {sink!r}; choose from duckdb, tensorboard, wandb")
    return sinks


def open_metrics(
    cfg: Config, run_dir: str | Path, exp: str, role: str, rank: int = 0, **writer_args: Any
) -> MetricsWriter:
    """A role-rank's MetricsWriter with the sinks of `metrics.sinks` (the one way roles make their writer)."""
    sinks = build_sinks(cfg, run_dir, exp, role, rank)
    return MetricsWriter(run_dir, exp, role, rank, sinks=sinks, **writer_args)


# ----------------------------------------------------------------------------------------------
# Readers (no network): what each sink holds, as tag -> step -> value
# ----------------------------------------------------------------------------------------------


def read_tensorboard(logdir: str | Path) -> dict[str, dict[int, float]]:
    """Every scalar of one event directory through TensorBoard's own EventAccumulator (no sampling), the
    newest value of each step (as DuckDB's `step_series`; TensorBoard's reader also drops a tag's points
    past a step logged again, as after a resume)."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def wandb_run_files(run_dir: str | Path, series: str | None = None) -> list[Path]:
    """The `.wandb` files of a run's offline W&B runs, oldest first; with `series` (`<role>-<rank>`), that
    series' only (a relaunched role is a new W&B run of the same name)."""
    files = sorted(wandb_dir(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    if series is None:
        return files
    return [f for f in files if wandb_run_name(f) == series]


def read_wandb_records(path: str | Path) -> Iterator[Any]:
    """The records (wandb_internal_pb2.Record) of a `.wandb` file: W&B writes them in LevelDB's log format
    (32 KiB blocks of checksummed chunks) behind a 7-byte header ':W&B', 0xBEE1, version 0. Checksums are
    not verified: a torn tail (a killed role) ends the read instead."""
    from wandb.proto import wandb_internal_pb2

    data = Path(path).read_bytes()
    magic, ident, version = struct.unpack_from("<4sHB", data, 0)
    if (magic, ident, version) != (b":W&B", 0xBEE1, 0):
        raise ValueError(f"{path} is not a W&B transaction log (header {data[:7]!r})")
    block, chunk_header = 32768, 7
    pos, parts = 7, bytearray()
    while pos + chunk_header <= len(data):
        room = block - pos % block
        if room < chunk_header:  # a block's tail too short for a chunk header is zero padding
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        start, pos = pos + chunk_header, pos + chunk_header + length
        if kind == 0 or pos > len(data):  # zero fill or a chunk cut short: the end of what was written
            return
        parts += data[start:pos]
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # generated, no stubs
            record.ParseFromString(bytes(parts))
            parts = bytearray()
            yield record
        elif kind not in (2, 3):  # FIRST, MIDDLE continue a record
            raise ValueError(f"{path}: unknown chunk type {kind} at byte {pos - length - chunk_header}")


def wandb_run_name(path: str | Path) -> str:
    """The display name (`<role>-<rank>`) recorded in a `.wandb` file's run record."""
    for record in read_wandb_records(path):
        if record.WhichOneof("record_type") == "run":
            return str(record.run.display_name)
    raise ValueError(f"{path} holds no run record")


def read_wandb(paths: Sequence[str | Path]) -> dict[str, dict[int, float]]:
    """Every metric of the history of W&B `.wandb` files (in order: a later file's point for a step wins),
    tag -> step -> value, each tag's step read from its `step/<tag>` field."""
    series: dict[str, dict[int, float]] = {}
    for path in paths:
        for record in read_wandb_records(path):
            if record.WhichOneof("record_type") != "history":
                continue
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            for key, value in row.items():
                if key.startswith("_") or key.startswith(_WANDB_STEP_PREFIX):
                    continue
                series.setdefault(key, {})[int(row[_WANDB_STEP_PREFIX + key])] = float(value)
    return series
