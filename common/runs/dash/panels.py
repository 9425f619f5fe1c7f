"""The run page's panels: which metric tags each one reads and how it draws them. Pure: series in,
SVG out (common/runs/dash/charts.py). The tags are the ones the roles write: trainer/rl/driver.py (rl/*, perf/*,
loss/*, weights/*, flow/*), trainer/pretrain.py (router/layer<i>/*, train/*) and evaluator/watch_loop.py
(eval/<benchmark>/<metric>, logged at the policy version).

A panel whose tags the run has not written (yet) says which tags it waits for. Tags no panel draws are
listed under the charts, so nothing the run wrote is hidden."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from common.metrics import StepPoint
from common.runs.dash import charts
from common.runs.dash.charts import Series, Span

Tagged = Mapping[str, Mapping[int, StepPoint]]

_LAYER = re.compile(r"^router/layer(\d+)/load_cv$")
# Per-benchmark bookkeeping the evaluator logs beside the scores: not a score to plot.
_EVAL_COUNTS = ("cases", "samples")


@dataclass(frozen=True)
class Panel:
    id: str
    title: str
    svg: str
    # tag -> points drawn (the flow summary's staleness histogram counts bins)
    counts: dict[str, int]


def _series(series: Tagged, tags: list[str]) -> list[Series]:
    return [Series(t, t, [(p.step, p.value) for _, p in sorted(series[t].items())]) for t in tags if t in series]


def _lines(pid: str, title: str, series: Tagged, tags: list[str], x: str, y: str, waits_for: str) -> Panel:
    drawn = _series(series, tags)
    svg = charts.line_chart(drawn, x, y, f"no points yet of {waits_for}")
    return Panel(pid, title, svg, {s.tag: len(s.points) for s in drawn})


def _matching(series: Tagged, keep: Callable[[str], bool]) -> list[str]:
    return sorted(t for t in series if keep(t))


def eval_score_tags(tags: Iterable[str]) -> dict[str, list[str]]:
    """benchmark -> its score tags eval/<benchmark>/<metric>, sorted (std and counts left out)."""
    out: dict[str, list[str]] = {}
    for tag in sorted(tags):
        parts = tag.split("/")
        if parts[0] != "eval" or len(parts) < 3:
            continue
        metric = "/".join(parts[2:])
        if metric in _EVAL_COUNTS or metric.endswith("/std"):
            continue
        out.setdefault(parts[1], []).append(tag)
    return out


def _timeline(series: Tagged) -> Panel:
    """Train steps and publishes as spans ending at their points' timestamps (each is logged when it
    ends, its duration as value), evaluations as ticks; seconds since the run's first such point."""

    def spans(tag: str, what: str) -> list[tuple[float, float, str]]:
        return [
            ((p.ts_ms - p.value * 1000) / 1000, p.ts_ms / 1000, f"{what} {step}: {p.value:.3g} s")
            for step, p in sorted(series.get(tag, {}).items())
        ]

    lanes_raw: list[tuple[str, str, str, list[tuple[float, float, str]]]] = [
        ("perf/step_s", "training", "training steps (perf/step_s)", spans("perf/step_s", "step")),
        ("weights/publish_s", "publishes", "publishes (weights/publish_s)", spans("weights/publish_s", "version")),
    ]
    for bench in sorted({t.split("/")[1] for t in series if t.startswith("eval/") and t.endswith("/cases")}):
        tag = f"eval/{bench}/cases"
        ticks = [(p.ts_ms / 1000, p.ts_ms / 1000, f"{bench} version {v}") for v, p in sorted(series[tag].items())]
        lanes_raw.append((tag, bench, f"evaluations of {bench} ({tag})", ticks))
    starts = [s for *_, lane in lanes_raw for s, _, _ in lane]
    t0 = min(starts) if starts else 0.0
    lanes = [
        (tag, name, label, [Span(s - t0, e - t0, text) for s, e, text in lane]) for tag, name, label, lane in lanes_raw
    ]
    svg = charts.timeline(lanes, "seconds since the first step", "no points yet of perf/step_s, weights/publish_s")
    return Panel(
        "timeline",
        "Flow timeline: training, publishes, evaluations",
        svg,
        {tag: len(spans_) for tag, _, _, spans_ in lanes if spans_},
    )


def build_panels(series: Tagged, flow_summary: dict | None, summary_problem: str = "") -> list[Panel]:
    """Every panel of a run page; `summary_problem` says why flow_summary.json could not be read."""
    panels = [
        _lines(
            "reward",
            "Reward and train accuracy",
            series,
            ["rl/reward_mean", "rl/accuracy"],
            "step",
            "fraction",
            "rl/reward_mean, rl/accuracy",
        ),
    ]
    evals = eval_score_tags(series)
    for bench, tags in evals.items():
        panels.append(
            _lines(
                f"heldout-{bench}",
                f"Held-out {bench} per policy version",
                series,
                tags,
                "policy version",
                "score",
                f"eval/{bench}/*",
            )
        )
    if not evals:
        panels.append(
            _lines(
                "heldout",
                "Held-out score per policy version",
                series,
                [],
                "policy version",
                "score",
                "eval/<benchmark>/<metric> (evaluator)",
            )
        )
    panels.append(
        _lines(
            "staleness",
            "Staleness of trained samples (steps)",
            series,
            ["rl/staleness_mean", "rl/staleness_max"],
            "step",
            "steps",
            "rl/staleness_mean, rl/staleness_max",
        )
    )
    hist = {int(k): int(v) for k, v in ((flow_summary or {}).get("counters", {}).get("staleness") or {}).items()}
    waits = summary_problem or "flow_summary.json not written yet (the trainer writes it at the end)"
    panels.append(
        Panel(
            "staleness-hist",
            "Staleness histogram (flow_summary.json, end of run)",
            charts.histogram("flow_summary/staleness", hist, "staleness (steps)", "trained samples", waits),
            {"flow_summary/staleness": len(hist)} if hist else {},
        )
    )
    throughput = _matching(
        series, lambda t: t == "perf/samples_per_s" or (t.endswith("tokens_per_s") and not t.startswith("engine/"))
    )
    panels.append(
        _lines(
            "throughput", "Throughput", series, throughput, "step", "per second", "perf/samples_per_s, */tokens_per_s"
        )
    )
    parts = _matching(series, lambda t: t.startswith("perf/") and t.endswith("_s") and not t.endswith("_per_s"))
    panels.append(_lines("step-time", "Train step time and its parts", series, parts, "step", "seconds", "perf/step_s"))
    weights = _matching(series, lambda t: t.startswith("weights/") and t.endswith("_s"))
    panels.append(
        _lines(
            "publish",
            "Weight publish and pause times",
            series,
            weights,
            "policy version",
            "seconds",
            "weights/publish_s, weights/max_pause_s",
        )
    )
    mismatch = _matching(series, lambda t: t == "loss/fresh_logprob_mismatch" or t.startswith("loss/behaviour_"))
    panels.append(
        _lines(
            "mismatch",
            "Trainer vs vLLM log-prob mismatch",
            series,
            mismatch,
            "step",
            "|Δ log p|",
            "loss/fresh_logprob_mismatch, loss/behaviour_*",
        )
    )
    layers = sorted((int(m.group(1)), t) for t in series if (m := _LAYER.match(t)))
    rows = [Series(t, f"layer {i}", [(p.step, p.value) for _, p in sorted(series[t].items())]) for i, t in layers]
    panels.append(
        Panel(
            "expert-load",
            "MoE expert load per layer (coefficient of variation)",
            charts.heatmap(rows, "step", "layer", "load_cv", "no points yet of router/layer<i>/load_cv"),
            {r.tag: len(r.points) for r in rows},
        )
    )
    panels += _serving(series)
    panels.append(_timeline(series))
    return panels


def _serving(series: Tagged) -> list[Panel]:
    """The router's stored telemetry (router/telemetry.py): its own figures and each engine's, per period."""
    x = "seconds since the router started"
    engine = {
        kind: sorted(t for t in series if t.startswith("engine/") and t.endswith(kind))
        for kind in ("/running", "/waiting", "/kv_cache_usage", "tokens_per_s")
    }
    return [
        _lines(
            "serving",
            "Router: requests, errors, retries per second; outstanding; healthy workers",
            series,
            _matching(series, lambda t: t.startswith("serve/") and not t.endswith("latency_mean_s")),
            x,
            "per second / count",
            "serve/* (router telemetry)",
        ),
        _lines(
            "serving-latency",
            "Router: mean time to the last byte of the requests that finished",
            series,
            ["serve/latency_mean_s"],
            x,
            "seconds",
            "serve/latency_mean_s",
        ),
        _lines(
            "engine-queue",
            "Engines: requests running and waiting",
            series,
            engine["/running"] + engine["/waiting"],
            x,
            "requests",
            "engine/<worker>/running, engine/<worker>/waiting",
        ),
        _lines(
            "engine-kv",
            "Engines: KV-cache use",
            series,
            engine["/kv_cache_usage"],
            x,
            "fraction",
            "engine/<worker>/kv_cache_usage",
        ),
        _lines(
            "engine-tokens",
            "Engines: prompt and generated tokens per second",
            series,
            engine["tokens_per_s"],
            x,
            "tokens per second",
            "engine/<worker>/*_tokens_per_s",
        ),
    ]


def drawn_tags(panels: list[Panel]) -> set[str]:
    return {t for p in panels for t in p.counts}


def flow_counters(series: Tagged) -> dict[str, float]:
    """The flow counters the trainer logs once at the end (flow/<counter> at the last step)."""
    return {
        t.removeprefix("flow/"): max(s.items())[1].value for t, s in sorted(series.items()) if t.startswith("flow/")
    }
