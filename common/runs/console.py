"""The launcher's console. Without --verbose, `slipstream launch` writes each role's whole output to
<run dir>/logs/<entry>-<i>.log (and its own to logs/launch.log); the terminal shows what a person watching
the run needs: the launcher's own lines (roles started, exited, restarted; Redis), the warnings, errors and
tracebacks of our roles, one progress line (step, reward, held-out score, weight versions, throughput) read
from the run's metrics and live Redis, and at the end the trainer's report. On a terminal the progress line
is redrawn in place; elsewhere (CI, a file) it is printed when its figures changed, at most every
PROGRESS_EVERY_S. Left out: vLLM's own output (the worker role relays it as `[vllm <id>] ...`) never reaches
the console, only the worker's log; the worker's own lines say when it is up or down."""

from __future__ import annotations

import logging
import math
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TextIO

import duckdb

from common.metrics import SeriesCache
from common.runs.dash.panels import eval_score_tags
from common.runs.dash.sources import LiveState

log = logging.getLogger(__name__)

LOGS = "logs"
# How often the progress line reads the metrics (what is new since its last read) and Redis.
PROGRESS_POLL_S = 2.0
# Off a terminal: the shortest time between two printed progress lines.
PROGRESS_EVERY_S = 15.0
# Lines of one replica's life put on the console; the rest stay in its log (the console says so once).
MAX_SHOWN_LINES = 40

# A line of our roles' log format (common/log.py) at WARNING or above; found anywhere in a line, since a
# progress bar's update (a role's tqdm) may come first.
_LEVEL = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (WARNING|ERROR|CRITICAL) ")
# vLLM's own output as the worker role relays it.
_VLLM = "[vllm "
_CLEAR = "\r\x1b[2K"


def log_path(run_dir: Path, name: str) -> Path:
    """Where the launcher keeps one process's output: <run dir>/logs/<name>.log."""
    return run_dir / LOGS / f"{name}.log"


class Console:
    """Lines scroll; the progress line stays below them (redrawn in place on a terminal). Thread-safe."""

    def __init__(self, out: TextIO, tty: bool | None = None, every_s: float = PROGRESS_EVERY_S) -> None:
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.every_s = every_s
        self._lock = threading.Lock()
        self._progress = ""
        self._key = ""  # the figures of the progress line (without the clock): what "changed" means
        self._printed_key: str | None = None
        self._printed_at = -math.inf

    def line(self, text: str) -> None:
        with self._lock:
            redraw = self.tty and self._progress
            self.out.write((_CLEAR if redraw else "") + text + "\n" + (self._fit(self._progress) if redraw else ""))
            self.out.flush()

    def progress(self, text: str, key: str) -> None:
        """Show `text` as the progress line; `key` is its part that matters for "changed" (no clock)."""
        with self._lock:
            self._progress, self._key = text, key
            if self.tty:
                self.out.write(_CLEAR + self._fit(text))
            elif key != self._printed_key and time.monotonic() - self._printed_at >= self.every_s:
                self._print_progress()
            self.out.flush()

    def finish(self) -> None:
        """Leave the last progress line in the scrollback, once, and stop drawing it."""
        with self._lock:
            if self.tty and self._progress:
                self.out.write("\n")
            elif self._progress and self._key != self._printed_key:
                self._print_progress()
            self._progress = ""
            self.out.flush()

    def _print_progress(self) -> None:
        self.out.write(self._progress + "\n")
        self._printed_key, self._printed_at = self._key, time.monotonic()

    @staticmethod
    def _fit(text: str) -> str:
        return text[: max(20, shutil.get_terminal_size().columns - 1)]


class ConsoleHandler(logging.Handler):
    """The launcher's own log lines, above the progress line."""

    def __init__(self, console: Console) -> None:
        super().__init__()
        self.console = console

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(record, "console", True):  # logged with extra={"console": False}: the log file only
            return
        try:
            self.console.line(self.format(record))
        except Exception:
            self.handleError(record)


class Shown:
    """Which lines of one replica's output belong on the console: our log lines at WARNING or above and
    Python tracebacks (from 'Traceback' to the exception's own line), never vLLM's relayed output; at most
    MAX_SHOWN_LINES of them per life of the replica, then once a line that says where the rest are."""

    def __init__(self, log: Path) -> None:
        self.log = log
        self.count = 0
        self._traceback = False

    def __call__(self, line: str) -> str | None:
        """The text to show for this line, or None. A progress bar's updates end in '\\r', not a newline:
        only the text after the last one is the line."""
        text = line.rsplit("\r", 1)[-1]
        if text.startswith(_VLLM):
            return None
        if self._traceback:
            self._traceback = text[:1].isspace()  # the first unindented line is the exception itself
            shown = True
        elif text.startswith("Traceback (most recent call last):"):
            self._traceback = shown = True
        elif found := _LEVEL.search(text):
            text, shown = text[found.start() :], True
        else:
            shown = False
        if not shown:
            return None
        self.count += 1
        if self.count <= MAX_SHOWN_LINES:
            return text
        return f"... more in {self.log}" if self.count == MAX_SHOWN_LINES + 1 else None


@dataclass
class Figures:
    """What the progress line shows. Steps are trainer steps; held-out scores are per policy version."""

    steps: int
    warmup_steps: int
    step: int | None = None
    """Steps done (RL or pretraining)."""
    warm_step: int | None = None
    """Warm-start steps done, until the first RL step."""
    loss: float | None = None
    reward: float | None = None
    # benchmark -> (first version, its score, newest version, its score) of the benchmark's first score tag
    heldout: dict[str, tuple[int, float, int, float]] = field(default_factory=dict)
    rate: str = ""
    weights: int | None = None
    rollout_versions: list[int | None] = field(default_factory=list)
    eval_versions: list[int | None] = field(default_factory=list)
    problem: str = ""


# The tags the progress line shows: the newest point of each (and the first of each score) is all it reads.
FIGURE_TAGS = ("rl/reward_mean", "train/loss", "warmup/loss", "perf/samples_per_s", "train/tokens_per_s")


def figures_cache(run_dir: Path) -> SeriesCache:
    """What read_figures reads, kept between polls: each poll reads only the points stored since."""
    return SeriesCache(run_dir, tags=FIGURE_TAGS, prefixes=("eval/",), max_points=64)


def read_figures(run_dir: Path, steps: int, warmup_steps: int, cache: SeriesCache | None = None) -> Figures:
    """The run's figures from its metrics (every role and rank), brought up to date in `cache` when given."""
    if cache is None:
        cache = figures_cache(run_dir)
    cache.update()
    f = Figures(steps, warmup_steps)

    def last(tag: str) -> tuple[int, float] | None:
        p = cache.last(tag)
        return None if p is None else (p.step, p.value)

    if rl := last("rl/reward_mean"):
        f.step, f.reward = rl[0] + 1, rl[1]  # RL steps are logged 0-based
    elif pre := last("train/loss"):
        f.step, f.loss = pre  # pretraining steps 1-based
    if (warm := last("warmup/loss")) and f.step is None:
        f.warm_step, f.loss = warm[0] + 1, warm[1]  # logged at the 0-based step
    for bench, tags in eval_score_tags(cache.tags()).items():
        first, newest = cache.first(tags[0]), cache.last(tags[0])
        assert first is not None and newest is not None  # a listed tag has points
        f.heldout[bench] = (first.step, first.value, newest.step, newest.value)
    if rate := last("perf/samples_per_s"):
        f.rate = f"{rate[1]:.0f} samples/s"
    elif rate := last("train/tokens_per_s"):
        f.rate = f"{rate[1] / 1000:.1f}k tokens/s"
    return f


def add_live(f: Figures, live: LiveState) -> None:
    """The served version and the live workers' versions, from Redis."""
    if not live.running:
        f.problem = f"Redis: {live.reason}"
        return
    f.weights = live.weights_current
    for w in live.workers:
        if w["alive"]:
            version = w["version"]
            (f.rollout_versions if w["pool"] == "train" else f.eval_versions).append(
                version if isinstance(version, int) else None
            )


def progress_text(f: Figures) -> str:
    """One line: where training is, its reward (or loss), held-out scores, versions, throughput."""
    if f.step is not None:
        parts = [f"step {f.step}/{f.steps}"]
    elif f.warm_step is not None:
        parts = [f"warm start {f.warm_step}/{f.warmup_steps}"]
    else:
        parts = ["starting"]
    if f.reward is not None:
        parts.append(f"reward {f.reward:.3f}")
    elif f.loss is not None:
        parts.append(f"loss {f.loss:.4g}")
    for bench, (v0, s0, v, s) in f.heldout.items():
        parts.append(f"held-out {bench} {s:.3f} at v{v}" + (f" (v{v0}: {s0:.3f})" if v != v0 else ""))
    if f.weights is not None:

        def versions(vs: list[int | None]) -> str:
            return ",".join("?" if v is None else str(v) for v in vs) or "none live"

        pools = f"rollout {versions(f.rollout_versions)}" + (
            f"; eval {versions(f.eval_versions)}" if f.eval_versions else ""
        )
        parts.append(f"weights v{f.weights} (workers: {pools})")
    if f.rate:
        parts.append(f.rate)
    if f.problem:
        parts.append(f.problem)
    return " | ".join(parts)


def elapsed(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


class ProgressLine:
    """Reads the run's figures every PROGRESS_POLL_S in a daemon thread and draws them on the console.
    A metrics read or Redis that fails shows its reason in the line; the next poll tries again."""

    def __init__(
        self, console: Console, run_dir: Path, steps: int, warmup_steps: int, live: Callable[[], LiveState]
    ) -> None:
        self.console, self.run_dir, self.steps, self.warmup_steps = console, run_dir, steps, warmup_steps
        self.live = live
        self._t0 = time.monotonic()
        self._cache = figures_cache(run_dir)
        self.polls, self.longest_gap_s, self._warned_slow = 0, 0.0, False
        self._figures = Figures(steps, warmup_steps)
        self._live: LiveState | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="progress line", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop polling and draw the run's final figures (the roles flushed their metrics at exit)."""
        self._stop.set()
        self._thread.join(timeout=10)
        if self.polls:  # how regularly the line was redrawn, for the run's log (tests read it)
            log.info(
                "progress line: %d reads, at most %.2fs apart (every %.0fs)",
                self.polls,
                self.longest_gap_s,
                PROGRESS_POLL_S,
                extra={"console": False},
            )
        self.poll(live=False)
        self.console.finish()

    def _loop(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(PROGRESS_POLL_S):
            start = time.monotonic()
            self.polls, self.longest_gap_s = self.polls + 1, max(self.longest_gap_s, start - last)
            self.poll(live=True)
            last = time.monotonic()
            if (took := last - start) > PROGRESS_POLL_S and not self._warned_slow:
                self._warned_slow = True
                log.warning(
                    "the progress line took %.1fs to read the run's figures (it reads every %.0fs)",
                    took,
                    PROGRESS_POLL_S,
                )

    def poll(self, live: bool) -> None:
        """Draw the figures; `live` asks Redis again (else the last answer is shown)."""
        figures = self._figures
        try:
            figures = self._figures = read_figures(self.run_dir, self.steps, self.warmup_steps, self._cache)
            problem = ""
        except (OSError, duckdb.Error) as exc:
            problem = f"metrics unreadable: {exc}"
        if live:
            self._live = self.live()
        shown = replace(figures, rollout_versions=[], eval_versions=[], problem=problem)
        if self._live is not None:
            add_live(shown, self._live)
        text = progress_text(shown)
        self.console.progress(f"[{elapsed(time.monotonic() - self._t0)}] {text}", key=text)
