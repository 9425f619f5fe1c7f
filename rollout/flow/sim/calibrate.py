"""Calibration: the simulator's timing model learnt from a real run. `read_run` loads what a trainer run
recorded (per generated sample gen/*, per train step perf/*, per publish weights/*, and flow_summary.json)
into plain records; `calibrate` fits the simulator's `ThroughputModel` and `Costs` to them and says how
well each fit describes the run (`FitQuality`); the `SimModel` it returns is saved as a small JSON file
(`sim_model.json`) that `slipstream simulate --model` reads. The fits, all least squares:
- generation, per worker: a request of n tokens takes `latency_s` plus the time to decode n tokens at
  peak / (c(t) + half) tokens/s, where c(t) is the requests on its worker, rebuilt from every request's
  send and end times. For a given half that is a line in n / mean(1 / (c + half)) with intercept
  `latency_s` and slope 1 / peak; half is searched on a log scale for the least squared error.
- a train step: `overhead + s_per_token * tokens`, a line over the steps.
- a publish: the mean trainer time (`sync_s`) and the mean generation pause (`pause_s`).
Left out: waiting for a controller slot (gen/queue_s; the policy caps what is in flight itself), failed
and aborted requests (only completed ones are recorded, so c(t) misses them) and the router's group affinity.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from common.metrics import has_metrics, step_series
from rollout.flow.events import FlowCounters
from rollout.flow.sim.simulator import Costs, ThroughputModel

MODEL_FILE = "sim_model.json"
FORMAT = 1
_GOLDEN = (np.sqrt(5) - 1) / 2


class CalibrationError(ValueError):
    """A run's metrics or a model file cannot give a timing model; the message names the fix."""


# ----------------------------------------------------------------------------------------------
# What a run recorded
# ----------------------------------------------------------------------------------------------


@dataclass
class GenMeasure:
    """One generated sample (gen/*, step = its running number): seconds since the flow started when it was
    sent, waiting for a controller slot, sent to result; its tokens; requests in flight at the controller
    when it was sent (itself included); the worker that served it (-1: unknown)."""

    start: float
    queue: float
    generate: float
    prompt_tokens: float
    output_tokens: int
    concurrency: int
    worker: int


@dataclass
class StepMeasure:
    """One train step: its start (seconds since the flow started; nan if not recorded), duration and tokens."""

    step: int
    start: float
    duration: float
    tokens: int


@dataclass
class PublishMeasure:
    """One publish: its start (nan if not recorded), the trainer's time and the longest generation pause."""

    version: int
    start: float
    duration: float
    pause: float


@dataclass
class RunMetrics:
    """What a trainer run recorded, as the simulator needs it; `counters` is None without flow_summary.json."""

    run_dir: Path
    samples: list[GenMeasure]
    steps: list[StepMeasure]
    publishes: list[PublishMeasure]
    counters: FlowCounters | None
    finish_reason: str


# Per tag, the value a point that was not recorded stands for (nan: the point is unusable without it).
GEN = {"gen/start_s": np.nan, "gen/queue_s": 0.0, "gen/generate_s": np.nan, "gen/prompt_tokens": np.nan}
GEN |= {"gen/output_tokens": 0.0, "gen/concurrency": 0.0, "gen/worker": -1.0}
STEP = {"perf/step_start_s": np.nan, "perf/step_s": np.nan, "perf/step_tokens": 0.0}
PUBLISH = {"weights/publish_start_s": np.nan, "weights/publish_s": np.nan, "weights/max_pause_s": 0.0}
REQUIRED = ["gen/start_s", "gen/generate_s", "gen/output_tokens", "perf/step_s", "perf/step_tokens"]
REQUIRED += ["weights/publish_s", "weights/max_pause_s"]


def read_run(run_dir: str | Path) -> RunMetrics:
    """The trainer metrics and flow summary of a run directory; raises CalibrationError naming what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise CalibrationError(f"run dir {run_dir} does not exist; give a run's directory (runs/<experiment>)")
    if not has_metrics(run_dir, "trainer"):
        raise CalibrationError(
            f"{run_dir} has no trainer metrics ({run_dir / 'metrics'}/trainer-*/); give the directory of a "
            "run whose trainer ran flow steps"
        )
    series = step_series(run_dir, [*GEN, *STEP, *PUBLISH], role="trainer")
    for tag in REQUIRED:
        if not series.get(tag):
            raise CalibrationError(
                f"{run_dir}'s trainer metrics have no {tag}: the run predates the per-sample and per-step timing "
                "metrics (gen/*, perf/step_tokens, weights/*); calibrate from a run made with this version"
            )

    def rows(tags: dict[str, float], by: str) -> list[tuple[int, list[float]]]:
        keys = sorted(series[by])
        return [(k, [series.get(tag, {}).get(k, default) for tag, default in tags.items()]) for k in keys]

    samples = [
        GenMeasure(start, queue, gen, prompt, int(out), int(conc), int(worker))
        for _, (start, queue, gen, prompt, out, conc, worker) in rows(GEN, "gen/generate_s")
        if not (np.isnan(start) or np.isnan(gen))
    ]
    steps = [StepMeasure(k, start, dur, int(tokens)) for k, (start, dur, tokens) in rows(STEP, "perf/step_s")]
    publishes = [PublishMeasure(k, *values) for k, values in rows(PUBLISH, "weights/publish_s")]
    counters, finish = None, ""
    summary = run_dir / "flow_summary.json"
    if summary.is_file():
        data = json.loads(summary.read_text())
        known = {f.name for f in dataclasses.fields(FlowCounters)}
        saved = {k: v for k, v in data.get("counters", {}).items() if k in known}
        counters = FlowCounters.from_state({"staleness": {}, **saved})
        finish = data.get("finish_reason", "")
    return RunMetrics(run_dir, samples, steps, publishes, counters, finish)


# ----------------------------------------------------------------------------------------------
# The fits
# ----------------------------------------------------------------------------------------------


@dataclass
class FitQuality:
    """How well a fit describes what it was fitted to: points used, R^2 (None where a mean is the whole
    model), the median relative error of a point's prediction, and a note on what the fit could not see."""

    name: str
    n: int
    r2: float | None
    rel_error: float
    note: str = ""


@dataclass
class SimModel:
    """The simulator's timing model and where it came from."""

    throughput: ThroughputModel
    costs: Costs
    fits: list[FitQuality] = field(default_factory=list)
    source: str = ""


def _line(x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Least-squares a + b * x with a, b >= 0 (a time and a cost per unit cannot be negative)."""
    if np.ptp(x) > 0:
        a, b = np.linalg.lstsq(np.vstack([np.ones_like(x), x]).T, y, rcond=None)[0]
        if a >= 0 and b >= 0:
            return float(a), float(b)
    b = float(x @ y / (x @ x)) if x @ x > 0 else 0.0
    if b < 0:
        return float(y.mean()), 0.0
    return 0.0, b


def _quality(name: str, predicted: np.ndarray, y: np.ndarray, note: str = "") -> FitQuality:
    sst = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / sst if sst > 0 else None
    pos = y > 0
    rel = float(np.median(np.abs(predicted[pos] - y[pos]) / y[pos])) if pos.any() else 0.0
    return FitQuality(name, len(y), r2, rel, note)


class _Worker:
    """One worker's requests over time, cut into segments at every send, end and pause edge: on each, the
    requests on the worker and whether generation was paused. `features(latency, half)` turns each request
    into the line's (x, y): y its time less its paused time, x its tokens times its unpaused decoding time
    over the integral of 1 / (c + half) across that time (so x / peak is the time it decoded)."""

    def __init__(self, start: np.ndarray, end: np.ndarray, tokens: np.ndarray, pauses: np.ndarray) -> None:
        self.start, self.end, self.tokens = start, end, tokens
        p0, p1 = np.sort(pauses[:, 0]), np.sort(pauses[:, 1])
        self.t = np.unique(np.concatenate([start, end, p0, p1]))
        on = np.searchsorted(np.sort(start), self.t[:-1], "right") - np.searchsorted(np.sort(end), self.t[:-1], "right")
        mid = (self.t[:-1] + self.t[1:]) / 2
        paused = np.searchsorted(p0, mid, "right") - np.searchsorted(p1, mid, "right") > 0
        self.c = np.maximum(on, 1)
        self.run_dt = np.diff(self.t) * ~paused
        self.paused_at = self._at(np.concatenate([[0.0], np.cumsum(np.diff(self.t) * paused)]))
        self.paused = self.paused_at(end) - self.paused_at(start)

    def _at(self, prefix: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        return lambda x: np.interp(x, self.t, prefix)

    def features(self, latency: float, half: float) -> tuple[np.ndarray, np.ndarray]:
        # A request shorter than twice the latency (noise) is taken to decode over its second half.
        decode_from = self.start + np.minimum(latency, (self.end - self.start) / 2)
        integral = self._at(np.concatenate([[0.0], np.cumsum(self.run_dt / (self.c + half))]))
        share = integral(self.end) - integral(decode_from)
        running = self.end - decode_from - (self.paused_at(self.end) - self.paused_at(decode_from))
        x = self.tokens * running / np.maximum(share, 1e-12)
        return x, self.end - self.start - self.paused


def fit_generation(
    samples: list[GenMeasure], pauses: Sequence[tuple[float, float]] = (), fit_from: float = -np.inf
) -> tuple[ThroughputModel, FitQuality]:
    """The per-worker throughput curve and request latency that best predict the time of each request sent at
    or after `fit_from`, given the generation pauses (start, end) of the run's publishes; every request counts
    in the workers' load."""
    done = [s for s in samples if s.generate > 0]
    if len(done) < 3:
        raise CalibrationError(f"{len(done)} generated samples with a duration; the generation fit needs at least 3")
    by_worker: dict[int, list[GenMeasure]] = {}
    for s in done:
        by_worker.setdefault(s.worker, []).append(s)
    windows = np.array(pauses, dtype=float).reshape(-1, 2)
    workers = [
        _Worker(
            np.array([s.start for s in g]),
            np.array([s.start + s.generate for s in g]),
            np.array([float(s.output_tokens) for s in g]),
            windows,
        )
        for g in by_worker.values()
    ]
    fitted = np.concatenate([w.start >= fit_from for w in workers])
    if fitted.sum() < 3:
        fitted[:] = True  # too few requests after the start: fit them all
    paused = np.concatenate([w.paused for w in workers])[fitted]

    def fit(latency: float, log_half: float) -> tuple[float, float, float, np.ndarray, np.ndarray]:
        xs, ys = zip(*(w.features(latency, float(np.exp(log_half))) for w in workers), strict=True)
        x, y = np.concatenate(xs)[fitted], np.concatenate(ys)[fitted]
        a, b = _line(x, y)
        return float(((y - a - b * x) ** 2).sum()), a, b, paused + a + b * x, paused + y

    # The latency moves where decoding starts, so it is found by fixed-point iteration around the half search.
    latency, grid = 0.0, np.linspace(np.log(1e-2), np.log(1e5), 57)
    for _ in range(4):
        k = int(np.argmin([fit(latency, h)[0] for h in grid]))
        lo, hi = grid[max(0, k - 1)], grid[min(len(grid) - 1, k + 1)]
        for _ in range(30):  # golden-section search between the best grid point's neighbours
            m1, m2 = hi - _GOLDEN * (hi - lo), lo + _GOLDEN * (hi - lo)
            lo, hi = (lo, m2) if fit(latency, m1)[0] < fit(latency, m2)[0] else (m1, hi)
        log_half = (lo + hi) / 2
        _, latency, slope, predicted, measured = fit(latency, log_half)
    if slope <= 0:
        raise CalibrationError("generation time does not grow with tokens in this run; no throughput to fit")
    on = np.concatenate([w.c for w in workers])
    note = f"{len(workers)} worker(s), fitted over {on.min()}..{on.max()} requests on a worker"
    if -1 in by_worker:
        note += "; requests without a worker index fitted as one worker"
    model = ThroughputModel(1.0 / slope, float(np.exp(log_half)), latency, len(workers))
    return model, _quality("generation", predicted, measured, note)


def fit_train(steps: list[StepMeasure]) -> tuple[float, float, FitQuality]:
    """(overhead_s, s_per_token, quality) of train step time against trained tokens."""
    if len(steps) < 2:
        raise CalibrationError(f"{len(steps)} train step(s) recorded; the train fit needs at least 2")
    x = np.array([float(s.tokens) for s in steps])
    y = np.array([s.duration for s in steps])
    overhead, per_token = _line(x, y)
    spread = float(x.std() / x.mean()) if x.mean() > 0 else 0.0
    note = ""
    if spread < 0.05:  # the line's two terms cannot be told apart; their sum at the run's step size still holds
        note = f"step tokens vary by {spread:.1%} only: the split of overhead and per-token cost is uncertain"
    return overhead, per_token, _quality("train step", overhead + per_token * x, y, note)


def fit_publish(publishes: list[PublishMeasure]) -> tuple[float, float, FitQuality, FitQuality]:
    """(sync_s, pause_s) as means, with how far single publishes are from them."""
    if not publishes:
        raise CalibrationError("no publish recorded (weights/publish_s); calibrate from a run that published")
    sync = np.array([p.duration for p in publishes])
    pause = np.array([p.pause for p in publishes])
    # R^2 is left out: a mean explains none of the spread by construction.
    sync_q = _quality("publish (trainer)", np.full_like(sync, sync.mean()), sync)
    pause_q = _quality("publish pause", np.full_like(pause, pause.mean()), pause)
    return float(sync.mean()), float(pause.mean()), replace(sync_q, r2=None), replace(pause_q, r2=None)


def calibrate(run: RunMetrics) -> SimModel:
    """The timing model of a run, with the quality of each of its fits."""
    pauses = [(p.start + p.duration - p.pause, p.start + p.duration) for p in run.publishes if not np.isnan(p.start)]
    # Requests sent before step 0 ended are left out of the fit (not of the load): a real run's first batch waits for its workers and meets
    # vLLM's first (slow) batches, which is not the steady state the model describes (compare.py judges
    # predictions after step 0 for the same reason).
    warm = run.steps[0].start + run.steps[0].duration if run.steps and not np.isnan(run.steps[0].start) else -np.inf
    throughput, gen_q = fit_generation(run.samples, pauses, fit_from=warm)
    overhead, per_token, train_q = fit_train(run.steps)
    sync_s, pause_s, sync_q, pause_q = fit_publish(run.publishes)
    costs = Costs(per_token, overhead, sync_s, pause_s)
    return SimModel(throughput, costs, [gen_q, train_q, sync_q, pause_q], str(run.run_dir))


def describe(model: SimModel) -> str:
    """The fitted numbers and their fit quality, one line each."""
    m, c = model.throughput, model.costs
    lines = [
        f"generation per worker: {m.latency_s * 1e3:.1f} ms + tokens / (peak / (c + half)) with peak "
        f"{m.peak_tokens_per_s:.4g} tokens/s, half {m.half_concurrency:.3g} (one request alone "
        f"{m.tokens_per_s(1):.4g} tokens/s); {m.workers} worker(s)",
        f"train step: {c.train_step_overhead_s:.4g} s + {c.train_s_per_token:.4g} s/token",
        f"publish: {c.sync_s:.4g} s of the trainer, generation paused {c.publish_pause_s:.4g} s",
        "fit quality:",
    ]
    for q in model.fits:
        r2 = "   -  " if q.r2 is None else f"{q.r2:6.3f}"
        lines.append(f"  {q.name:<20} n {q.n:>7}  R^2 {r2}  median rel. error {q.rel_error:6.1%}  {q.note}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# The model file
# ----------------------------------------------------------------------------------------------


def save_model(model: SimModel, path: str | Path) -> None:
    data = {
        "format": FORMAT,
        "source": model.source,
        "throughput": dataclasses.asdict(model.throughput),
        "costs": dataclasses.asdict(model.costs),
        "fits": [dataclasses.asdict(q) for q in model.fits],
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_model(path: str | Path, run_dir: str | Path = "RUN_DIR") -> SimModel:
    """A model file written by `save_model`; CalibrationError names the fix (calibrating `run_dir`) when it is
    missing or unreadable."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(
            f"no timing model at {p}: make one with `slipstream simulate --calibrate {run_dir}` (it writes "
            f"{Path(run_dir) / MODEL_FILE}), or pass --model FILE"
        )
    try:
        data: dict[str, Any] = json.loads(p.read_text())
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        return SimModel(
            ThroughputModel(**data["throughput"]),
            Costs(**data["costs"]),
            [FitQuality(**q) for q in data.get("fits", [])],
            data.get("source", ""),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(
            f"{p} is not a timing model file ({exc}); write it again with `slipstream simulate --calibrate {run_dir}`"
        ) from None
