"""Calibration: the simulator's timing model learnt from a real run. `read_run` loads what a trainer run
recorded (per generated sample gen/*, per train step perf/*, per publish weights/*, and flow_summary.json)
into plain records; `calibrate` fits the simulator's `ThroughputModel`, `Costs` and `EpisodeModel` to them
and says how well each fit describes the run (`FitQuality`); the `SimModel` it returns is saved as a small
JSON file (`sim_model.json`) that `slipstream simulate --model` reads. A sample is an episode of
gen/turns requests (1 when not recorded) whose gen/generate_s spans its first request's send to its last
response, gen/tool_s of it in tool calls between turns (0 when not recorded). The fits, least squares
unless said:
- generation, per worker: a request of n tokens takes `latency_s` plus the time to decode n tokens at
  peak / (c(t) + half) tokens/s, where c(t) is the requests on its worker, rebuilt from every request's
  send and end times. An episode's turns are not timed one by one, so they are placed evenly in its span
  (T turns of (generate - tool) / T seconds, the tool calls of equal length between them) with its tokens
  split evenly over them, as the simulator splits them; its generation time, generate less tool, is then
  T latencies plus the sum over its turns of n_k / mean(1 / (c + half)) / peak. For a given half that is a
  linear fit in (T, sum n_k / mean(1 / (c + half))) with coefficients `latency_s` and 1 / peak (for a
  single-turn run, a line with intercept `latency_s`); half is searched on a log scale for the least
  squared error.
- a train step: `overhead + s_per_token * tokens`, a line over the steps.
- a publish: the mean trainer time (`sync_s`) and the mean generation pause (`pause_s`).
- episodes: the histogram of turns per episode; over the T - 1 tool calls of each multi-turn episode, the
  mean seconds of one call (all calls' seconds over their number), its standard deviation (from how the
  episodes' sums spread about calls * mean: each sum's variance is calls * sd^2) and the tokens one call
  appends (gen/env_tokens, 0 when not recorded).
Left out: waiting for a controller slot (gen/queue_s; the policy caps what is in flight itself), failed
and aborted requests (only completed ones are recorded, so c(t) misses them), the router's group affinity,
the prefill of the tool results (a later turn's latency is the first's) and how an episode's turns and
length go together (the simulator draws them apart).
"""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from common.metrics import has_metrics, step_series
from rollout.flow.events import FlowCounters
from rollout.flow.sim.simulator import Costs, EpisodeModel, ThroughputModel

MODEL_FILE = "sim_model.json"
FORMAT = 2  # 2: the episode model; a format 1 file (without it) is read as a single-turn model
READS = (1, 2)
_GOLDEN = (np.sqrt(5) - 1) / 2


class CalibrationError(ValueError):
    """A run's metrics or a model file cannot give a timing model; the message names the fix."""


# ----------------------------------------------------------------------------------------------
# What a run recorded
# ----------------------------------------------------------------------------------------------


@dataclass
class GenMeasure:
    """One generated sample (gen/*, step = its running number), an episode of `turns` requests: seconds since
    the flow started when it was sent, waiting for a controller slot, its first request sent to its last
    result; its first prompt's tokens and the policy's tokens over all its turns; requests in flight at the
    controller when it was sent (itself included); the worker that served it (-1: unknown); the seconds of
    its tool calls between turns and the tokens they appended."""

    start: float
    queue: float
    generate: float
    prompt_tokens: float
    output_tokens: int
    concurrency: int
    worker: int
    turns: int = 1
    tool_s: float = 0.0
    env_tokens: int = 0


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
GEN |= {"gen/turns": 1.0, "gen/tool_s": 0.0, "gen/env_tokens": 0.0}  # a run from before episodes: single-turn
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
        GenMeasure(start, queue, gen, prompt, int(out), int(conc), int(worker), max(1, int(turns)), tool, int(env))
        for _, (start, queue, gen, prompt, out, conc, worker, turns, tool, env) in rows(GEN, "gen/generate_s")
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
    """The simulator's timing model (its episodes: single-turn unless fitted to a multi-turn run) and where it
    came from."""

    throughput: ThroughputModel
    costs: Costs
    fits: list[FitQuality] = field(default_factory=list)
    source: str = ""
    episodes: EpisodeModel = field(default_factory=EpisodeModel)


def _line(x: np.ndarray, y: np.ndarray, w: np.ndarray | None = None) -> tuple[float, float]:
    """Least-squares a * w + b * x with a, b >= 0 (a time and a cost per unit cannot be negative); `w` is all
    ones unless given (a line with intercept a), positive."""
    w = np.ones_like(x) if w is None else w
    if np.ptp(x / w) > 0:
        a, b = np.linalg.lstsq(np.vstack([w, x]).T, y, rcond=None)[0]
        if a >= 0 and b >= 0:
            return float(a), float(b)
    b = float(x @ y / (x @ x)) if x @ x > 0 else 0.0
    if b < 0:
        return float((w * y).sum() / (w * w).sum()), 0.0
    return 0.0, b


def _quality(name: str, predicted: np.ndarray, y: np.ndarray, note: str = "") -> FitQuality:
    sst = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - predicted) ** 2).sum()) / sst if sst > 0 else None
    pos = y > 0
    rel = float(np.median(np.abs(predicted[pos] - y[pos]) / y[pos])) if pos.any() else 0.0
    return FitQuality(name, len(y), r2, rel, note)


class _Worker:
    """One worker's episodes as requests over time: an episode of T turns is T requests placed evenly in its
    span (each (generate - tool) / T seconds, the T - 1 tool calls of equal length between them), its tokens
    split as `split_tokens` splits them; time is cut into segments at every send, end and pause edge: on each,
    the requests on the worker and whether generation was paused. `features(latency, half)` turns each
    episode into the fit's (x, y): y the time of its turns less their paused time, x the sum over its turns of
    the turn's tokens times its unpaused decoding time over the integral of 1 / (c + half) across that time
    (so x / peak is the time it decoded); `turns` counts the latencies in y."""

    def __init__(self, episodes: Sequence[GenMeasure], pauses: np.ndarray) -> None:
        self.first = np.array([g.start for g in episodes])
        self.turns = np.array([g.turns for g in episodes])
        generating = np.array([g.generate - g.tool_s for g in episodes]) / self.turns
        gap = np.array([g.tool_s for g in episodes]) / np.maximum(self.turns - 1, 1)
        out = np.array([g.output_tokens for g in episodes])
        self.episode = np.repeat(np.arange(len(episodes)), self.turns)  # each request's episode
        k = np.arange(len(self.episode)) - np.repeat(np.cumsum(self.turns) - self.turns, self.turns)  # its turn
        start = self.first[self.episode] + k * (generating + gap)[self.episode]
        end = start + generating[self.episode]
        tokens = (out // self.turns)[self.episode] + (k < (out % self.turns)[self.episode])
        self.start, self.end, self.tokens = start, end, tokens.astype(float)
        p0, p1 = np.sort(pauses[:, 0]), np.sort(pauses[:, 1])
        self.t = np.unique(np.concatenate([start, end, p0, p1]))
        on = np.searchsorted(np.sort(start), self.t[:-1], "right") - np.searchsorted(np.sort(end), self.t[:-1], "right")
        mid = (self.t[:-1] + self.t[1:]) / 2
        paused = np.searchsorted(p0, mid, "right") - np.searchsorted(p1, mid, "right") > 0
        self.c = np.maximum(on, 1)
        self.run_dt = np.diff(self.t) * ~paused
        self.paused_at = self._at(np.concatenate([[0.0], np.cumsum(np.diff(self.t) * paused)]))
        self.paused = self._sum(self.paused_at(end) - self.paused_at(start))  # per episode, its turns' paused time
        self.y = self._sum(end - start) - self.paused

    def _at(self, prefix: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
        return lambda x: np.interp(x, self.t, prefix)

    def _sum(self, per_request: np.ndarray) -> np.ndarray:
        """Per episode, the sum over its requests."""
        return np.bincount(self.episode, weights=per_request, minlength=len(self.first))

    def features(self, latency: float, half: float) -> tuple[np.ndarray, np.ndarray]:
        # A request shorter than twice the latency (noise) is taken to decode over its second half.
        decode_from = self.start + np.minimum(latency, (self.end - self.start) / 2)
        integral = self._at(np.concatenate([[0.0], np.cumsum(self.run_dt / (self.c + half))]))
        share = integral(self.end) - integral(decode_from)
        running = self.end - decode_from - (self.paused_at(self.end) - self.paused_at(decode_from))
        x = self.tokens * running / np.maximum(share, 1e-12)
        return self._sum(x), self.y


def fit_generation(
    samples: list[GenMeasure], pauses: Sequence[tuple[float, float]] = (), fit_from: float = -np.inf
) -> tuple[ThroughputModel, FitQuality]:
    """The per-worker throughput curve and request latency that best predict the generation time (generate less
    tool calls) of each episode sent at or after `fit_from`, given the generation pauses (start, end) of the
    run's publishes; every episode counts in the workers' load."""
    done = [s for s in samples if s.generate - s.tool_s > 0]
    if len(done) < 3:
        raise CalibrationError(
            f"{len(done)} generated samples with a generation time (gen/generate_s less gen/tool_s); the generation "
            "fit needs at least 3"
        )
    by_worker: dict[int, list[GenMeasure]] = {}
    for s in done:
        by_worker.setdefault(s.worker, []).append(s)
    windows = np.array(pauses, dtype=float).reshape(-1, 2)
    workers = [_Worker(g, windows) for g in by_worker.values()]
    fitted = np.concatenate([w.first >= fit_from for w in workers])
    if fitted.sum() < 3:
        fitted[:] = True  # too few episodes after the start: fit them all
    paused = np.concatenate([w.paused for w in workers])[fitted]
    turns = np.concatenate([w.turns for w in workers])[fitted].astype(float)

    def fit(latency: float, log_half: float) -> tuple[float, float, float, np.ndarray, np.ndarray]:
        xs, ys = zip(*(w.features(latency, float(np.exp(log_half))) for w in workers), strict=True)
        x, y = np.concatenate(xs)[fitted], np.concatenate(ys)[fitted]
        a, b = _line(x, y, turns)
        return float(((y - a * turns - b * x) ** 2).sum()), a, b, paused + a * turns + b * x, paused + y

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
    if (many := int((turns > 1).sum())) > 0:
        note += f"; {many} multi-turn episode(s), their turns placed evenly in their span"
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


def turns_histogram(samples: list[GenMeasure]) -> dict[int, int]:
    """Turns per episode -> episodes of the run; {} for a single-turn run (the single-turn model's)."""
    if all(s.turns == 1 for s in samples):
        return {}
    return dict(sorted(Counter(s.turns for s in samples).items()))


def fit_episodes(samples: list[GenMeasure]) -> tuple[EpisodeModel, list[FitQuality]]:
    """The episode model of a run's samples: its histogram of turns per episode and, over the T - 1 tool calls
    of each multi-turn episode, the mean seconds of one call, their standard deviation and the tokens a call
    appends, with how well calls * mean predicts each episode's sum. A single-turn run gives the
    single-turn model and no fits."""
    calls = np.array([float(s.turns - 1) for s in samples])
    if not (calls > 0).any():
        return EpisodeModel(), []
    multi = calls > 0
    m = calls[multi]
    tool = np.array([s.tool_s for s in samples])[multi]
    env = np.array([float(s.env_tokens) for s in samples])[multi]
    total = float(m.sum())
    mean = float(tool.sum()) / total
    # Each sum of m calls has variance m * sd^2; with the mean estimated from the same sums, the expected
    # squared residuals add up to sd^2 * (total - sum(m^2) / total).
    dof = total - float(m @ m) / total
    residual = tool - m * mean
    sd = float(np.sqrt(residual @ residual / dof)) if dof > 0 else 0.0
    per_call = float(env.sum()) / total
    model = EpisodeModel(turns_histogram(samples), mean, sd, per_call)
    note = f"{int(total)} calls over {int(multi.sum())} episodes; sd from the spread of the episodes' sums"
    tool_q = _quality("tool calls", m * mean, tool, note)
    env_q = _quality("tool result tokens", m * per_call, env)
    if np.ptp(m) == 0:  # every episode made as many calls: a mean per call explains none of the spread
        tool_q, env_q = replace(tool_q, r2=None), replace(env_q, r2=None)
    return model, [tool_q, env_q]


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
    episodes, episode_q = fit_episodes(run.samples)
    return SimModel(throughput, costs, [gen_q, train_q, sync_q, pause_q, *episode_q], str(run.run_dir), episodes)


def describe(model: SimModel) -> str:
    """The fitted numbers and their fit quality, one line each."""
    m, c = model.throughput, model.costs
    lines = [
        f"generation per worker: {m.latency_s * 1e3:.1f} ms + tokens / (peak / (c + half)) with peak "
        f"{m.peak_tokens_per_s:.4g} tokens/s, half {m.half_concurrency:.3g} (one request alone "
        f"{m.tokens_per_s(1):.4g} tokens/s); {m.workers} worker(s)",
        f"train step: {c.train_step_overhead_s:.4g} s + {c.train_s_per_token:.4g} s/token",
        f"publish: {c.sync_s:.4g} s of the trainer, generation paused {c.publish_pause_s:.4g} s",
        describe_episodes(model.episodes),
        "fit quality:",
    ]
    for q in model.fits:
        r2 = "   -  " if q.r2 is None else f"{q.r2:6.3f}"
        lines.append(f"  {q.name:<20} n {q.n:>7}  R^2 {r2}  median rel. error {q.rel_error:6.1%}  {q.note}")
    return "\n".join(lines)


def describe_episodes(e: EpisodeModel) -> str:
    """The episode model in one line: turns per episode (their shares) and what a tool call costs."""
    if not e.multi_turn:
        return "episodes: one turn each, no tool calls"
    n = sum(e.turns.values())
    shares = ", ".join(f"{k}: {v / n:.0%}" for k, v in sorted(e.turns.items()))
    return (
        f"episodes: {e.mean_turns:.3g} turns on average {{{shares}}}; a tool call {e.tool_s:.4g} s "
        f"(sd {e.tool_sd:.3g} s), appending {e.env_tokens:.4g} tokens"
    )


# ----------------------------------------------------------------------------------------------
# The model file
# ----------------------------------------------------------------------------------------------


def save_model(model: SimModel, path: str | Path) -> None:
    data = {
        "format": FORMAT,
        "source": model.source,
        "throughput": dataclasses.asdict(model.throughput),
        "costs": dataclasses.asdict(model.costs),
        "episodes": dataclasses.asdict(model.episodes),  # turns' keys become strings in JSON
        "fits": [dataclasses.asdict(q) for q in model.fits],
    }
    Path(path).write_text(json.dumps(data, indent=1) + "\n")


def load_model(path: str | Path, run_dir: str | Path = "RUN_DIR") -> SimModel:
    """A model file written by `save_model` (a format 1 file, from before episodes, as a single-turn model);
    CalibrationError names the fix (calibrating `run_dir`) when it is missing or unreadable."""
    p = Path(path)
    if not p.is_file():
        raise CalibrationError(
            f"no timing model at {p}: make one with `slipstream simulate --calibrate {run_dir}` (it writes "
            f"{Path(run_dir) / MODEL_FILE}), or pass --model FILE"
        )
    try:
        data: dict[str, Any] = json.loads(p.read_text())
        if data.get("format") not in READS:
            raise ValueError(f"format {data.get('format')!r}, expected one of {READS}")
        episodes = dict(data["episodes"]) if data["format"] >= 2 else {}
        episodes["turns"] = {int(k): int(v) for k, v in episodes.get("turns", {}).items()}
        return SimModel(
            ThroughputModel(**data["throughput"]),
            Costs(**data["costs"]),
            [FitQuality(**q) for q in data.get("fits", [])],
            data.get("source", ""),
            EpisodeModel(**episodes),
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise CalibrationError(
            f"{p} is not a timing model file ({exc}); write it again with `slipstream simulate --calibrate {run_dir}`"
        ) from None
