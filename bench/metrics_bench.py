"""Metrics benchmark (issue 38 item 1): a run of 10,000 RL steps written as the demo's trainer writes it, and
how long the launcher's progress line and the dashboard take to read it.

Each step logs what the demo's trainer logs: 7 gen/* figures for each of its 1,024 samples (at the sample's
index) and 60 per-step figures (rl/*, loss/*, perf/*, ...), one flush a step (the trainer flushes every 5 s
and a demo step takes about 6 s), each flush followed by the writer's merges, as its flush thread does; an
evaluator writes one score per version. Then, on the finished 10,000 steps:

- console, first read: a fresh progress line reads its figures (what `slipstream launch` does at start);
- console, next read: after one more step, what its next poll reads;
- dashboard, first read: a fresh dashboard's run page (every tag, thinned to at most ~2 x 2000 steps, the
  per-sample tags deferred) and its panels; second read: the deferred tags' backlog (the page's next poll);
  dashboard, next read: after one more step.

Last, the writer's flush time with and without two processes reading every series in a loop (fresh readers,
the worst case) over 200 more steps: the ratio says whether readers hold up a writer.

    .venv/bin/python bench/metrics_bench.py [--steps 10000] [--samples 1024]
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.metrics import MetricsWriter, list_segments, metrics_path, read_metrics  # noqa: E402
from common.runs.console import read_figures  # noqa: E402
from common.runs.dash.panels import build_panels  # noqa: E402
from common.runs.dash.sources import series_cache  # noqa: E402

GEN_TAGS = ("gen/start_s", "gen/queue_s", "gen/generate_s", "gen/concurrency", "gen/prompt_tokens", "gen/output_tokens")
GEN_TAGS += ("gen/worker",)
STEP_TAGS = ["rl/reward_mean", "rl/accuracy", "perf/samples_per_s", "perf/step_s"] + [f"loss/t{i}" for i in range(56)]
RNG = random.Random(0)  # figures are random: real ones compress about as badly
READER = """
import sys, time
from common.metrics import SeriesCache
print("reading", flush=True)
while True:
    SeriesCache(sys.argv[1], max_points=2000).update()
"""


def write_step(writer: MetricsWriter, evaluator: MetricsWriter, step: int, samples: int) -> float:
    """One step's points, flushed and merged; returns the flush's seconds (the merge is the thread's own time)."""
    base = step * samples
    for tag in GEN_TAGS:
        writer.log_points([tag] * samples, range(base, base + samples), [RNG.random() for _ in range(samples)])
    writer.log_many(step, {tag: RNG.random() for tag in STEP_TAGS})
    evaluator.log("eval/arithmetic/accuracy/mean", step, 0.2 + step * 1e-5)
    start = time.perf_counter()
    writer.flush()
    took = time.perf_counter() - start
    writer.compact()
    evaluator.flush()
    evaluator.compact()
    return took


def timed(fn):  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--contended-steps", type=int, default=200)
    parser.add_argument("--keep", type=Path, help="write the run here and keep it (default: a temporary dir)")
    args = parser.parse_args()
    run_dir = args.keep or Path(tempfile.mkdtemp(prefix="metrics-bench-"))
    try:
        trainer = MetricsWriter(run_dir, "bench", "trainer", flush_interval_s=3600, batch_size=10**9)
        evaluator = MetricsWriter(run_dir, "bench", "evaluator", flush_interval_s=3600, batch_size=10**9)
        start = time.perf_counter()
        flushes = [write_step(trainer, evaluator, s, args.samples) for s in range(args.steps)]
        wrote_s = time.perf_counter() - start
        points = args.steps * (args.samples * len(GEN_TAGS) + len(STEP_TAGS) + 1)
        segments = list_segments(metrics_path(run_dir, "trainer", 0))
        size = sum(s.path.stat().st_size for s in segments)
        print(
            f"wrote {args.steps} steps, {points:,} points in {wrote_s:.0f} s; trainer: {len(segments)} segments, "
            f"{size / 2**20:.0f} MiB"
        )

        console_first, figures = timed(lambda: read_figures(run_dir, args.steps, 0))
        dash = series_cache(run_dir)
        dash_first, drawn = timed(lambda: (dash.update(), build_panels(dash.series(), None)))
        deferred = dash.pending
        dash_backlog, _ = timed(lambda: (dash.update(), build_panels(dash.series(), None)))
        from common.runs.console import figures_cache

        console = figures_cache(run_dir)
        read_figures(run_dir, args.steps, 0, console)
        write_step(trainer, evaluator, args.steps, args.samples)
        console_next, figures_next = timed(lambda: read_figures(run_dir, args.steps + 1, 0, console))
        dash_next, _ = timed(lambda: (dash.update(), build_panels(dash.series(), None)))
        assert figures.step == args.steps and figures_next.step == args.steps + 1, (figures, figures_next)
        kept = {tag: len(points) for tag, points in dash.series().items()}

        quiet = [
            write_step(trainer, evaluator, s, args.samples)
            for s in range(args.steps + 1, args.steps + 1 + args.contended_steps)
        ]
        readers = [
            subprocess.Popen([sys.executable, "-c", READER, str(run_dir)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
            for _ in range(2)
        ]
        try:
            for r in readers:
                assert r.stdout is not None and r.stdout.readline().strip() == "reading"
            first = args.steps + 1 + args.contended_steps
            busy = [write_step(trainer, evaluator, s, args.samples) for s in range(first, first + args.contended_steps)]
        finally:
            for r in readers:
                r.kill()
                r.wait(timeout=30)
        trainer.close()
        evaluator.close()
        total = args.steps + 1 + 2 * args.contended_steps
        assert len([p for p in read_metrics(run_dir, ["rl/reward_mean"])]) == total  # no step lost

        def p(xs: list[float], q: float) -> float:
            return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] * 1000

        print()
        print("| read | seconds |")
        print("| --- | --- |")
        print(f"| console, first read of {args.steps} steps | {console_first:.3f} |")
        print(f"| console, next read (one more step) | {console_next:.3f} |")
        print(
            f"| dashboard, first read and panels{' (per-sample tags deferred)' if deferred else ''} | {dash_first:.3f} |"
        )
        print(f"| dashboard, second read: the deferred backlog, and panels | {dash_backlog:.3f} |")
        print(f"| dashboard, next read and panels | {dash_next:.3f} |")
        print()
        print(
            f"dashboard keeps {min(kept.values())}-{max(kept.values())} steps a tag "
            f"(gen/queue_s: {kept['gen/queue_s']} of {(args.steps + 1) * args.samples:,}); "
            f"panels drawn: {len(drawn[1])}"
        )
        print()
        print("| trainer flush (7,228 points) | p50 ms | p99 ms | max ms |")
        print("| --- | --- | --- | --- |")
        print(
            f"| during the {args.steps}-step write | {p(flushes, 0.5):.1f} | {p(flushes, 0.99):.1f} | {max(flushes) * 1000:.1f} |"
        )
        print(
            f"| {args.contended_steps} steps, no reader | {p(quiet, 0.5):.1f} | {p(quiet, 0.99):.1f} | {max(quiet) * 1000:.1f} |"
        )
        print(
            f"| {args.contended_steps} steps, 2 readers in a loop | {p(busy, 0.5):.1f} | {p(busy, 0.99):.1f} | {max(busy) * 1000:.1f} |"
        )
        print(
            f"| ratio readers / none (p50, p99) | {statistics.median(busy) / statistics.median(quiet):.2f} | "
            f"{p(busy, 0.99) / p(quiet, 0.99):.2f} | |"
        )
    finally:
        if not args.keep:
            shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
