"""Metrics in DuckDB and the SQLite run registry, on real files."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from common.gitinfo import git_sha
from common.metrics import MetricsWriter, metrics_path, read_metrics, step_series
from common.runs.registry import Registry


def test_ten_thousand_points_written_in_batches_read_back_exactly(tmp_path):
    writer = MetricsWriter(tmp_path, run="r1", role="trainer", rank=0, batch_size=1000, flush_interval_s=60)
    expected = []
    for step in range(5000):
        for tag in ("loss", "reward"):
            value = step * 0.001 + (1.0 if tag == "reward" else 0.0)
            writer.log(tag, step, value, ts_ms=1_000 + step)
            expected.append(("r1", "trainer", 0, tag, step, 1_000 + step, value))
    # Batches reached the file before close (the buffer holds at most batch_size points).
    assert len(read_metrics(tmp_path)) >= 9_000
    writer.close()
    points = read_metrics(tmp_path)
    assert [(p.run, p.role, p.rank, p.tag, p.step, p.ts_ms, p.value) for p in points] == sorted(
        expected, key=lambda r: (r[3], r[4])
    )
    assert metrics_path(tmp_path, "trainer", 0).exists()


def test_timer_flushes_without_filling_a_batch_and_files_are_per_role_and_rank(tmp_path):
    a = MetricsWriter(tmp_path, "r2", "trainer", rank=1, flush_interval_s=0.1)
    b = MetricsWriter(tmp_path, "r2", "evaluator", rank=0, flush_interval_s=0.1)
    a.log_many(3, {"loss": 2.5, "grad_norm": 0.5})
    b.log("accuracy", 3, 0.75)
    deadline = time.monotonic() + 5
    while len(read_metrics(tmp_path)) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert {(p.role, p.rank, p.tag, p.value) for p in read_metrics(tmp_path)} == {
        ("trainer", 1, "loss", 2.5),
        ("trainer", 1, "grad_norm", 0.5),
        ("evaluator", 0, "accuracy", 0.75),
    }
    assert [p.tag for p in read_metrics(tmp_path, tags=["accuracy"], role="evaluator")] == ["accuracy"]
    a.close()
    b.close()
    with pytest.raises(RuntimeError, match="closed"):
        a.log("loss", 4, 1.0)


def test_registry_records_the_real_git_sha_of_the_checkout(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (repo / "f.txt").write_text("x")
    subprocess.run(git + ["add", "f.txt"], check=True)
    subprocess.run(git + ["commit", "-qm", "c"], check=True)
    sha = subprocess.run(git[:3] + ["rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    registry = Registry.for_root(tmp_path / "runs")
    row = registry.start("exp-1", "demo", '[run]\nname = "demo"\n', repo_dir=repo)
    assert (row.git_sha, row.git_dirty, row.status) == (sha, False, "running")
    registry.finish("exp-1", "succeeded")
    row = registry.get("exp-1")
    assert row.status == "succeeded" and row.ended_at >= row.started_at
    assert row.config == '[run]\nname = "demo"\n'
    with pytest.raises(ValueError, match="already in"):
        registry.start("exp-1", "demo", "", repo_dir=repo)
    with pytest.raises(ValueError, match="not one of"):
        registry.finish("exp-1", "exploded")


def test_git_sha_outside_a_checkout_is_unknown_with_a_logged_reason(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        assert git_sha(tmp_path) == ("unknown", None)
    assert "not a git checkout" in caplog.text


def test_a_flush_waits_out_a_reader_in_another_process(tmp_path):
    writer = MetricsWriter(tmp_path, "r3", "evaluator", flush_interval_s=60)
    writer.log("accuracy", 0, 0.5)
    writer.flush()
    path = metrics_path(tmp_path, "evaluator", 0)
    hold = (
        "import duckdb, sys, time\n"
        f"con = duckdb.connect({str(path)!r}, read_only=True)\n"
        "print('holding', flush=True)\n"
        "time.sleep(1.0)\n"
        "con.close()\n"
    )
    reader = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == "holding"
        writer.log("accuracy", 1, 0.75)
        start = time.monotonic()
        writer.flush()  # the reader's process holds the file's lock for about a second
        assert time.monotonic() - start > 0.3
    finally:
        reader.wait(timeout=30)
    writer.close()
    assert [p.value for p in read_metrics(tmp_path, role="evaluator")] == [0.5, 0.75]


def test_step_series_keeps_the_newest_point_of_a_step_trained_twice(tmp_path):
    with MetricsWriter(tmp_path, run="r1", role="trainer", rank=0) as writer:
        writer.log("loss", 3, 0.9, ts_ms=2_000)  # a resumed run's point for step 3, written later...
        writer.log("loss", 3, 0.5, ts_ms=1_000)  # ...than the lost run's (flushed together here)
        writer.log("loss", 4, 0.4, ts_ms=3_000)
        writer.log("reward", 3, 1.0, ts_ms=1_000)
    with MetricsWriter(tmp_path, run="r1", role="evaluator", rank=0) as writer:
        writer.log("loss", 3, 7.0, ts_ms=5_000)
    assert step_series(tmp_path, ["loss"], role="trainer") == {"loss": {3: 0.9, 4: 0.4}}
    assert step_series(tmp_path, ["loss", "reward"]) == {"loss": {3: 7.0, 4: 0.4}, "reward": {3: 1.0}}
