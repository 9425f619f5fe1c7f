"""A real run set beside its prediction: `measured_result` turns what a run recorded (calibrate.py's
`RunMetrics`) into the simulator's own `SimResult` (steps, trainer spans, the requests in flight and the
pauses over time, the staleness histogram), so one table (`comparison_table`) and one figure (report.py's
`save_png`) show measured and predicted alike. `slipstream simulate --compare RUN_DIR` is the command.
Generator utilisation is measured against the timing model's capacity at max_concurrent, as it is
predicted, so the two are comparable; the trained completion tokens of a run are its trained tokens less
its prompts' and tool results' (mean prompt length and tool-result tokens per sample), an estimate. A
multi-turn run's episodes are compared as wholes (turns per episode, seconds in tool calls, sent to done):
its metrics do not time the turns, so its generator busy counts an episode's tool calls as busy (an upper
bound), where the prediction counts only decoding.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from common.config import FlowConfig
from rollout.flow.sim.calibrate import CalibrationError, RunMetrics
from rollout.flow.sim.report import SampleRecord, SimResult, Span, StepRecord, TracePoint
from rollout.flow.sim.simulator import ThroughputModel


def measured_result(run: RunMetrics, flow: FlowConfig, throughput: ThroughputModel) -> SimResult:
    """The run as a SimResult; needs its flow_summary.json and the start times of its steps and publishes."""
    if run.counters is None:
        raise CalibrationError(
            f"{run.run_dir} has no flow_summary.json (the trainer writes it when the flow finishes); compare a "
            "finished run"
        )
    if any(math.isnan(s.start) for s in run.steps) or any(math.isnan(p.start) for p in run.publishes):
        raise CalibrationError(
            f"{run.run_dir}'s metrics have no perf/step_start_s or weights/publish_start_s for some steps or "
            "publishes: the timeline needs them; compare a run made with this version"
        )
    steps = [StepRecord(s.step, s.start, s.start + s.duration, (), s.tokens) for s in run.steps]
    spans = [Span(s.start, s.end, "train", s.step) for s in steps]
    # The metrics number publishes by version, taken here as the weights step: the two are equal unless the run resumed.
    spans += [Span(p.start, p.start + p.duration, "sync", p.version) for p in run.publishes]
    spans.sort(key=lambda s: s.start)
    samples = [
        SampleRecord(-1, i, 0, g.start, g.start + g.generate, g.output_tokens, g.worker, g.concurrency, g.turns)
        for i, g in enumerate(run.samples)
    ]
    for record, g in zip(samples, run.samples, strict=True):  # what its episode spent in tool calls
        record.tool_s, record.env_tokens = g.tool_s, g.env_tokens
    trace = _trace(samples, [(p.start + p.duration - p.pause, p.start + p.duration, p.version) for p in run.publishes])
    makespan = max([s.end for s in spans] + [s.end for s in samples] + [0.0])
    prompts = [g.prompt_tokens for g in run.samples if not math.isnan(g.prompt_tokens)]
    prompt_tokens = sum(prompts) / len(prompts) if prompts else 0.0
    env_tokens = sum(g.env_tokens for g in run.samples) / len(run.samples) if run.samples else 0.0
    trained = sum(s.tokens for s in steps) - round(run.counters.trained_samples * (prompt_tokens + env_tokens))
    busy = sum(
        b.t - a.t
        for a, b in zip(trace, trace[1:] + [TracePoint(makespan, 0, 0, False)], strict=True)
        if a.concurrency and not a.paused
    )
    return SimResult(
        strategy=flow.strategy,
        max_concurrent=flow.max_concurrent,
        makespan=makespan,
        steps=steps,
        spans=spans,
        trace=trace,
        counters=run.counters,
        generated_tokens=float(sum(s.tokens for s in samples)),
        trained_completion_tokens=max(0, trained),
        generator_busy_s=busy,
        peak_tokens_per_s=throughput.pool_tokens_per_s(flow.max_concurrent),
        finish_reason=run.finish_reason or "unknown",
        samples=samples,
    )


def _trace(samples: list[SampleRecord], pauses: list[tuple[float, float, int]]) -> list[TracePoint]:
    """Requests in flight, the weights step served and the pauses over time, from the requests' send and end times
    and the publishes' (pause start, end, weights step)."""
    events: list[tuple[float, int, int, int]] = []  # (t, in flight change, pause change, weights step or -1)
    events += [(s.start, 1, 0, -1) for s in samples] + [(s.end, -1, 0, -1) for s in samples]
    events += [(a, 0, 1, -1) for a, _, _ in pauses] + [(b, 0, -1, v) for _, b, v in pauses]
    events = sorted((max(0.0, t), dc, dp, v) for t, dc, dp, v in events)  # a publish before the flow: at 0
    trace = [TracePoint(0.0, 0, 0, False)]
    conc = paused = served = 0
    for i, (t, d_conc, d_paused, v) in enumerate(events):
        conc, paused, served = conc + d_conc, paused + d_paused, max(served, v)
        if i + 1 < len(events) and events[i + 1][0] == t:
            continue  # one point per instant
        last = trace[-1]
        if (last.concurrency, last.weights_step, last.paused) != (conc, served, paused > 0):
            trace.append(TracePoint(t, conc, served, paused > 0))
    return trace


def total_variation(a: dict[int, int], b: dict[int, int]) -> float:
    """Total variation distance between two histograms as distributions: half the L1 distance, 0 to 1."""
    na, nb = sum(a.values()), sum(b.values())
    if not na or not nb:
        return 0.0 if na == nb else 1.0
    return 0.5 * sum(abs(a.get(k, 0) / na - b.get(k, 0) / nb) for k in set(a) | set(b))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _request_s(r: SimResult) -> float:
    return _mean([s.end - s.start for s in r.samples])


def _train_s(r: SimResult) -> float:
    return _mean([s.end - s.start for s in r.steps])


def _step_s(r: SimResult) -> float:
    return r.makespan / max(1, len(r.steps))


def steady_step_s(r: SimResult) -> float:
    """Time per step from the end of step 0 to the end of the last: a real run's start (waiting for its first
    worker, vLLM's first batches) is not the flow the simulator models, so predictions are judged on this."""
    if len(r.steps) < 2:
        return math.nan
    return (r.steps[-1].end - r.steps[0].end) / (len(r.steps) - 1)


def steady_samples_s(r: SimResult) -> float:
    """Trained samples per second after step 0 (every step trains the same number of samples)."""
    return r.counters.trained_samples / max(1, len(r.steps)) / steady_step_s(r)


def judged(r: SimResult) -> dict[str, Any]:
    """What a prediction is judged on, as JSON values: time per step and samples/s after step 0, the
    staleness histogram (bench/sim_validate.py records a real run's; tests/unit/test_sim_real.py checks against
    them), and the episodes' turns and seconds in tool calls (1 and 0 for a single-turn run)."""
    return {
        "steps": len(r.steps),
        "step_s": steady_step_s(r),
        "samples_per_s": steady_samples_s(r),
        "staleness": {str(k): n for k, n in sorted(r.counters.staleness.items())},
        "turns_per_episode": r.turns_per_episode,
        "tool_s_per_episode": r.tool_s_per_episode,
    }


Row = tuple[str, Callable[[SimResult], float], bool]  # (name, figure, a fraction: compared in points)

ROWS: list[Row] = [
    ("makespan (s)", lambda r: r.makespan, False),
    ("time per step (s)", _step_s, False),
    ("time per step after step 0 (s)", steady_step_s, False),
    ("train step (s, mean)", _train_s, False),
    ("episode, sent to done (s, mean)", _request_s, False),
    ("turns per episode (mean)", lambda r: r.turns_per_episode, False),
    ("tool calls per episode (s, mean)", lambda r: r.tool_s_per_episode, False),
    ("samples/s", lambda r: r.samples_per_s, False),
    ("samples/s after step 0", steady_samples_s, False),
    ("staleness (mean)", lambda r: r.staleness_mean, False),
    ("trainer utilisation", lambda r: r.trainer_utilisation, True),
    ("generator utilisation", lambda r: r.generator_utilisation, True),
    ("generator busy", lambda r: r.generator_busy, True),
]


def comparison_table(measured: SimResult, predicted: SimResult) -> str:
    """Measured against predicted, with the error of the prediction (relative, or in points for fractions),
    and the staleness histograms with their total variation distance."""
    lines = [f"{'':<34}{'measured':>10}{'predicted':>11}{'error':>10}"]
    for name, figure, fraction in ROWS:
        m, p = figure(measured), figure(predicted)
        if fraction:
            lines.append(f"{name:<34}{m:>10.0%}{p:>11.0%}{(p - m) * 100:>+7.0f} pts")
        else:
            error = f"{(p - m) / m:>+10.1%}" if m else f"{'-':>10}"
            lines.append(f"{name:<34}{m:>10.4g}{p:>11.4g}{error}")
    hm, hp = measured.counters.staleness, predicted.counters.staleness
    lines.append(f"staleness histogram: measured {_shares(hm)}, predicted {_shares(hp)}")
    lines.append(f"staleness total variation distance {total_variation(hm, hp):.3f}")
    return "\n".join(lines)


def _shares(hist: dict[int, int]) -> str:
    n = max(1, sum(hist.values()))
    return "{" + ", ".join(f"{k}: {v / n:.0%}" for k, v in sorted(hist.items())) + "}"
