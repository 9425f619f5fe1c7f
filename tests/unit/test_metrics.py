"""Metrics segments (written and read by DuckDB) and the SQLite run registry, on real files."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import duckdb
import pytest

from common.gitinfo import git_sha
from common.metrics import (
    MetricsReader,
    MetricsWriter,
    SeriesCache,
    StepPoint,
    has_metrics,
    list_segments,
    metrics_path,
    read_metrics,
    read_tag_stats,
    step_series,
)
from common.runs.registry import Registry


def _wait_for(predicate, timeout_s=10.0, what="condition"):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not reached within {timeout_s}s"
        time.sleep(0.02)


def test_ten_thousand_points_written_in_batches_read_back_exactly(tmp_path):
    writer = MetricsWriter(tmp_path, run="r1", role="trainer", rank=0, batch_size=1000, flush_interval_s=60, fanin=4)
    expected = []
    for step in range(5000):
        for tag in ("loss", "reward"):
            value = step * 0.001 + (1.0 if tag == "reward" else 0.0)
            writer.log(tag, step, value, ts_ms=1_000 + step)
            expected.append(("r1", "trainer", 0, tag, step, 1_000 + step, value))
    # A full batch wakes the flush thread (the timer is a minute away): they reach disk before close.
    _wait_for(lambda: len(read_metrics(tmp_path)) >= 9_000, what="9,000 points on disk")
    writer.close()
    points = read_metrics(tmp_path)
    assert [(p.run, p.role, p.rank, p.tag, p.step, p.ts_ms, p.value) for p in points] == sorted(
        expected, key=lambda r: (r[3], r[4])
    )


def test_segments_merge_without_losing_or_repeating_a_batch(tmp_path):
    writer = MetricsWriter(tmp_path, "r1", "trainer", flush_interval_s=60, fanin=4)
    for batch in range(21):
        writer.log("loss", batch, batch * 0.5)
        writer.flush()
    assert writer.compact() == 6  # five merges of 4 single batches, then one of 4 merged ones
    writer.close()
    segments = list_segments(metrics_path(tmp_path, "trainer", 0))
    assert [(s.first, s.last) for s in segments] == [(0, 15), (16, 19), (20, 20)]
    # Each footer says what its segment holds (rows, first and last step a tag), merged files too.
    assert [read_tag_stats(s.path) for s in segments] == [
        {"loss": [16, 0, 15]},
        {"loss": [4, 16, 19]},
        {"loss": [1, 20, 20]},
    ]
    assert step_series(tmp_path, ["loss"]) == {"loss": {b: b * 0.5 for b in range(21)}}


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


def test_a_writer_never_waits_for_readers_in_other_processes(tmp_path):
    """Two processes read every segment in a loop while the writer flushes 200 batches: each flush takes what
    writing a small file takes, no point is lost, and a reader that reads again gets only what is new."""
    writer = MetricsWriter(tmp_path, "r3", "trainer", flush_interval_s=60, fanin=4)
    loop = (
        "import sys, time\n"
        "from common.metrics import read_metrics\n"
        "print('reading', flush=True)\n"
        "end = time.monotonic() + 30\n"
        "while time.monotonic() < end and sys.stdin.readable():\n"
        "    read_metrics(sys.argv[1])\n"
    )
    readers = [
        subprocess.Popen([sys.executable, "-c", loop, str(tmp_path)], stdout=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    incremental = MetricsReader(tmp_path, role="trainer")
    seen: list[int] = []
    try:
        for r in readers:
            assert r.stdout.readline().strip() == "reading"
        slowest = 0.0
        for step in range(200):
            writer.log_many(step, {"loss": step * 0.5, "reward": step * 0.25})
            start = time.monotonic()
            writer.flush()
            slowest = max(slowest, time.monotonic() - start)
            if step % 10 == 0:
                writer.compact()
                seen += [p.step for p in incremental.read() if p.tag == "loss"]
        assert slowest < 1.0, f"a flush took {slowest:.2f}s next to two readers"
    finally:
        for r in readers:
            r.kill()
            r.wait(timeout=30)
    writer.close()
    seen += [p.step for p in incremental.read() if p.tag == "loss"]
    assert seen == list(range(200))  # every step once: incremental reads neither skip nor repeat
    assert incremental.read() == []
    assert step_series(tmp_path, ["loss"])["loss"] == {s: s * 0.5 for s in range(200)}


def test_a_failed_flush_keeps_its_points_and_the_thread_retries(tmp_path, caplog):
    """A full disk (a real tmpfs of 512 KiB, mounted here as root) fails the flushes; the points stay buffered,
    the failure is logged once, and once space is back every point reaches disk in order."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        writer = MetricsWriter(disk, "r4", "trainer", flush_interval_s=0.05)
        filler = disk / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT)
        with contextlib.suppress(OSError):
            while True:  # until the disk is full
                os.write(fd, b"x" * 4096)
        os.close(fd)
        with caplog.at_level("WARNING", logger="common.metrics"):
            for step in range(300):
                writer.log("loss", step, float(step))
            time.sleep(0.5)  # ten flush attempts, all refused
            failures = [r for r in caplog.records if "failed" in r.getMessage()]
            assert len(failures) == 1 and "No space left" in failures[0].getMessage()
            filler.unlink()
            _wait_for(lambda: len(read_metrics(disk)) == 300, what="the buffered points on disk")
        assert any("works again" in r.getMessage() for r in caplog.records)
        writer.log("loss", 300, 300.0)
        writer.close()
        assert [(p.step, p.value) for p in read_metrics(disk)] == [(s, float(s)) for s in range(301)]
        assert not list(metrics_path(disk, "trainer", 0).glob(".*.tmp"))  # no half-written segment left
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_run_written_before_segments_is_still_read(tmp_path):
    (tmp_path / "metrics").mkdir()
    with duckdb.connect(str(tmp_path / "metrics" / "evaluator-0.duckdb")) as con:
        con.execute(
            "CREATE TABLE metrics(run VARCHAR, role VARCHAR, rank INTEGER, tag VARCHAR, step BIGINT, ts_ms BIGINT, "
            "value DOUBLE)"
        )
        con.execute("INSERT INTO metrics VALUES ('old', 'evaluator', 0, 'accuracy', 2, 10, 0.5)")
    assert has_metrics(tmp_path, "evaluator") and not has_metrics(tmp_path, "trainer")
    assert step_series(tmp_path, ["accuracy"]) == {"accuracy": {2: 0.5}}


def test_series_cache_thins_long_series_and_keeps_the_ends_exact(tmp_path):
    with MetricsWriter(tmp_path, "r5", "trainer", flush_interval_s=60, batch_size=10**9) as writer:
        for step in range(10_000):
            writer.log("gen/queue_s", step, float(step))
        writer.log("rl/reward_mean", 0, 0.25)
    cache = SeriesCache(tmp_path, max_points=100)
    assert cache.update()
    long = cache.series()["gen/queue_s"]
    assert 100 <= len(long) <= 202 and long[0].value == 0.0 and max(long) == 9_999
    strides = {b - a for a, b in zip(sorted(long)[:-1], sorted(long)[1:-1], strict=False)}
    assert len(strides) == 1  # evenly spaced, the newest step added at the end
    assert cache.series()["rl/reward_mean"] == {0: StepPoint(0, cache.last("rl/reward_mean").ts_ms, 0.25)}
    assert not cache.update()  # nothing new
    with MetricsWriter(tmp_path, "r5", "trainer", flush_interval_s=60) as writer:  # a restarted role appends
        writer.log("gen/queue_s", 10_000, -1.0)
        writer.log("rl/reward_mean", 0, 0.75, ts_ms=cache.last("rl/reward_mean").ts_ms + 1)  # step 0 again, newer
    assert cache.update()
    assert cache.last("gen/queue_s") == StepPoint(10_000, cache.last("gen/queue_s").ts_ms, -1.0)
    assert cache.series()["rl/reward_mean"][0].value == 0.75
    assert len(cache.series()["gen/queue_s"]) <= 202
    # Deferred: the first read leaves the big tag out, the next reads its backlog and what came since, once.
    deferring = SeriesCache(tmp_path, max_points=100, defer_rows=5_000)
    assert deferring.update() and deferring.pending
    assert deferring.tags() == ["rl/reward_mean"] and deferring.series()["rl/reward_mean"][0].value == 0.75
    with MetricsWriter(tmp_path, "r5", "trainer", flush_interval_s=60) as writer:
        writer.log("gen/queue_s", 10_001, -2.0)
    assert deferring.update() and not deferring.pending
    got = deferring.series()["gen/queue_s"]
    assert set(got) - {10_001} <= set(cache.series()["gen/queue_s"]) and 100 <= len(got) <= 202
    assert deferring.first("gen/queue_s").value == 0.0 and deferring.last("gen/queue_s").value == -2.0
    assert not deferring.update()
    exact = SeriesCache(tmp_path, tags=["gen/queue_s"])
    exact.update()
    assert len(exact.series()["gen/queue_s"]) == 10_002 and exact.tags() == ["gen/queue_s"]


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
