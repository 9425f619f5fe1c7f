"""Metric sinks beside DuckDB (common/metric_sinks.py): a MetricsWriter with real TensorBoard and offline W&B
sinks, read back with TensorBoard's own EventAccumulator and W&B's own transaction log, against DuckDB."""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError, load_config
from common.metric_sinks import (
    TensorBoardSink,
    open_metrics,
    read_tensorboard,
    read_wandb,
    read_wandb_records,
    require_sink_packages,
    run_info,
    tensorboard_dir,
    wandb_rows,
    wandb_run_files,
    wandb_run_name,
)
from common.metrics import MetricsWriter, read_metrics, step_series

WANDB_VARS = ("WANDB_DIR", "WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR")
ALL_SINKS = 'metrics.sinks=["duckdb", "tensorboard", "wandb"]'


@pytest.fixture
def home(tmp_path, monkeypatch):
    """An empty $HOME and no W&B directory settings (restored after the test: the sink sets them in-process)."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in WANDB_VARS:
        monkeypatch.setenv(var, "unset")  # recorded by monkeypatch, so the sink's setdefault is undone too
        monkeypatch.delenv(var)
    return home


def _log_independent_series(writer: MetricsWriter) -> None:
    """Training tags every step, an eval tag per 10 steps arriving 7 steps late, one step logged twice (a resume:
    the newest counts), and values that float32 cannot hold exactly."""
    for step in range(1500):
        writer.log("train/loss", step, 1.0 / (step + 1) + 1e-12, ts_ms=1_700_000_000_000 + step)
        writer.log("gen/reward", step, (step % 7) / 3.0, ts_ms=1_700_000_000_000 + step)
        if step % 10 == 7 and step > 7:
            writer.log("eval/accuracy", step - 17, step / 1e4, ts_ms=1_700_000_000_000 + step)
    writer.log("train/loss", 1499, -2.5, ts_ms=1_700_000_002_000)


def test_every_duckdb_point_reads_back_from_tensorboard_and_wandb_at_its_step(tmp_path, home):
    cfg = load_config(None, [ALL_SINKS])
    run_dir = tmp_path / "run"
    writer = open_metrics(cfg, run_dir, "exp1", "trainer", 1, batch_size=400, flush_interval_s=60)
    _log_independent_series(writer)
    writer.close()

    duck = step_series(run_dir, ["train/loss", "gen/reward", "eval/accuracy"])
    assert duck["train/loss"][1499] == -2.5 and len(duck["eval/accuracy"]) == 149
    tb = read_tensorboard(tensorboard_dir(run_dir, "trainer", 1))
    assert tb.keys() == duck.keys()
    for tag, series in duck.items():
        assert tb[tag].keys() == series.keys(), tag
        assert all(np.float32(tb[tag][s]) == np.float32(v) for s, v in series.items()), tag
    files = wandb_run_files(run_dir, "trainer-1")
    assert len(files) == 1 and files[0].stat().st_size > 3 * 32768  # several LevelDB blocks read across
    assert read_wandb(files) == duck  # JSON keeps a double exactly
    # Nothing outside the run dir: W&B's cache, settings and data dirs followed the run.
    assert not any(home.iterdir())


def test_each_series_carries_the_resolved_config_and_the_git_revision(tmp_path, home):
    cfg = load_config(None, [ALL_SINKS, "trainer.optim.lr=0.0123"])
    run_dir = tmp_path / "run"
    with open_metrics(cfg, run_dir, "exp2", "evaluator", 0) as writer:
        writer.log("eval/accuracy", 0, 0.5)
    sha = run_info(cfg, "exp2", "evaluator", 0).git_sha
    assert len(sha) == 40

    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(str(tensorboard_dir(run_dir, "evaluator", 0)))
    acc.Reload()
    texts = {t: acc.Tensors(t)[0].tensor_proto.string_val[0].decode() for t in acc.Tags()["tensors"]}
    assert sha in texts["run/git"]
    assert "lr = 0.0123" in texts["run/config"] and "exp2 (evaluator-0)" in texts["run/experiment"]

    [file] = wandb_run_files(run_dir)
    assert wandb_run_name(file) == "evaluator-0"
    runs = [r.run for r in read_wandb_records(file) if r.WhichOneof("record_type") == "run"]
    assert runs[0].run_group == "exp2" and runs[0].job_type == "evaluator"
    config = {item.key: json.loads(item.value_json) for item in runs[0].config.update}
    assert config["git_sha"] == sha and config["experiment"] == "exp2"
    assert config["trainer"]["optim"]["lr"] == 0.0123


class _BrokenSink:
    """A sink whose disk is gone: a stand-in, since a real sink's failure (a full disk, a dead W&B service)
    cannot be provoked here on demand."""

    name = "broken"

    def __init__(self) -> None:
        self.calls = 0

    def write(self, tags, steps, ts_ms, values) -> None:
        self.calls += 1
        raise OSError("No space left on device")

    def close(self) -> None:
        raise OSError("No space left on device")


def test_a_failing_sink_is_logged_once_and_costs_the_segments_and_the_other_sinks_nothing(tmp_path, caplog):
    broken = _BrokenSink()
    cfg = load_config(None)
    tb = TensorBoardSink(tensorboard_dir(tmp_path, "trainer", 0), run_info(cfg, "e", "trainer", 0))
    writer = MetricsWriter(tmp_path, "e", "trainer", batch_size=1000, flush_interval_s=0.05, sinks=[broken, tb])
    with caplog.at_level(logging.WARNING, logger="common.metrics"):
        for rounds in range(1, 4):  # each round's points reach disk by the timer thread: it outlives the failures
            for step in range(rounds * 30 - 30, rounds * 30):
                writer.log("loss", step, step * 0.5)
            deadline = time.monotonic() + 10
            while len(read_metrics(tmp_path)) < rounds * 30:
                assert time.monotonic() < deadline, f"the timer thread stopped flushing after round {rounds - 1}"
                time.sleep(0.02)
        for step in range(90, 100):
            writer.log("loss", step, step * 0.5)
        writer.close()
    assert broken.calls >= 4
    assert [r.getMessage() for r in caplog.records if "sink broken" in r.getMessage()] == [
        f"metrics sink broken of {writer.path} failed; its points are dropped, the segments keep them"
    ]
    assert [(p.step, p.value) for p in read_metrics(tmp_path)] == [(s, s * 0.5) for s in range(100)]
    assert read_tensorboard(tensorboard_dir(tmp_path, "trainer", 0)) == {"loss": {s: s * 0.5 for s in range(100)}}


def test_a_configured_sink_whose_package_is_missing_stops_the_role_naming_the_pip_command(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what `import wandb` meets where it is not installed
    with pytest.raises(ConfigError, match=r"metrics.sinks includes 'wandb'.*pip install 'slipstream\[tools\]'"):
        require_sink_packages(["duckdb", "tensorboard", "wandb"])
    require_sink_packages(["duckdb", "tensorboard"])


def test_sinks_config_is_typed_from_set_and_rejects_an_unknown_or_repeated_sink():
    cfg = load_config(None, [ALL_SINKS, 'metrics.wandb_mode="online"'])
    assert cfg.metrics.sinks == ["duckdb", "tensorboard", "wandb"] and cfg.metrics.wandb_mode == "online"
    assert load_config(None).metrics.sinks == ["duckdb"]
    with pytest.raises(ConfigError, match=r"metrics.sinks has unknown sink\(s\) \['mlflow'\]"):
        load_config(None, ['metrics.sinks=["duckdb", "mlflow"]'])
    with pytest.raises(ConfigError, match="names a sink twice"):
        load_config(None, ['metrics.sinks=["tensorboard", "tensorboard"]'])
    with pytest.raises(ConfigError, match="metrics.wandb_mode"):
        load_config(None, ['metrics.wandb_mode="shared"'])


def test_wandb_rows_hold_each_tag_once_with_its_own_step_in_logging_order():
    rows = wandb_rows(["a", "b", "a", "c"], [5, 2, 6, 0], [0.1, 0.2, 0.3, 0.4])
    assert rows == [{"a": 0.1, "step/a": 5, "b": 0.2, "step/b": 2}, {"a": 0.3, "step/a": 6, "c": 0.4, "step/c": 0}]
    with pytest.raises(ValueError, match="'step/x' starts with 'step/'"):
        wandb_rows(["step/x"], [0], [1.0])


def test_a_wandb_file_with_a_foreign_header_is_refused(tmp_path):
    path = Path(tmp_path) / "run-x.wandb"
    path.write_bytes(b"LEVELDB" + bytes(64))
    with pytest.raises(ValueError, match="is not a W&B transaction log"):
        list(read_wandb_records(path))


class _SlowSink:
    """A sink as slow as a remote service on a bad day: a stand-in, since a real one's speed cannot be set."""

    name = "slow"

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.closed = False

    def write(self, tags, steps, ts_ms, values) -> None:
        time.sleep(0.3)
        self.batches.append(list(steps))

    def close(self) -> None:
        self.closed = True


def test_a_slow_sink_holds_up_no_flush_and_close_hands_it_every_batch_in_order(tmp_path):
    slow = _SlowSink()
    writer = MetricsWriter(tmp_path, "e", "trainer", batch_size=1000, flush_interval_s=60, sinks=[slow])
    started = time.monotonic()
    for step in range(5):
        writer.log("loss", step, 1.0)
        writer.flush()
    assert time.monotonic() - started < 0.3 * 2, "flush waited on the sink"
    writer.close()
    assert slow.batches == [[0], [1], [2], [3], [4]] and slow.closed
