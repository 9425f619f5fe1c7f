"""Sweeps for flow studies: `--sweep KEY=V1,V2,...` axes over the generator pool's `workers` and any flow
knob a policy reads (max_concurrent, max_staleness, strategy, ...), run as the full grid of settings; a
table and a figure of throughput and mean staleness per setting, with one setting recommended. The rule:
the highest samples/s among the settings whose mean staleness is within a bound (`--max-mean-staleness`),
the first in sweep order on a tie; none when no setting is within it. A setting the config validation
rejects (one_step_off at max_staleness 0, say) is a row that says why, never recommended.
"""

from __future__ import annotations

import itertools
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from common.config import ConfigError, FlowConfig, parse_value
from rollout.flow.sim.report import SimResult

Setting = dict[str, Any]


@dataclass
class SweepRow:
    """One setting of the grid and what it gave: a result, or why the setting is not a valid config."""

    setting: Setting
    result: SimResult | None
    error: str = ""

    @property
    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.setting.items())


def parse_axes(specs: Sequence[str], flow_keys: Sequence[str]) -> list[tuple[str, list[Any]]]:
    """`KEY=V1,V2,...` specs as (key, typed values): `workers` a positive int, a flow knob typed by FlowConfig."""
    hints = typing.get_type_hints(FlowConfig)
    axes: list[tuple[str, list[Any]]] = []
    for spec in specs:
        key, sep, raw = spec.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not raw.strip():
            raise ValueError(f"--sweep {spec!r}: give KEY=V1,V2,..., e.g. --sweep max_concurrent=32,64,128")
        if key != "workers" and key not in flow_keys:
            raise ValueError(f"--sweep {key}: not a sweep key; sweep workers or a flow knob: {', '.join(flow_keys)}")
        if key in (k for k, _ in axes):
            raise ValueError(f"--sweep {key} is given twice; give its values once, comma-separated")
        if key == "workers":
            values: list[Any] = [parse_value(v.strip(), int, "workers") for v in raw.split(",")]
            if min(values) < 1:
                raise ValueError(f"--sweep workers={raw}: a pool has at least one worker")
        else:
            values = [parse_value(v.strip(), hints[key], f"flow.{key}") for v in raw.split(",")]
        axes.append((key, values))
    return axes


def run_sweep(axes: list[tuple[str, list[Any]]], run_one: Callable[[Setting], SimResult]) -> list[SweepRow]:
    """Every setting of the grid, in order (the last axis varies fastest); `run_one` simulates one and raises
    ConfigError for a setting that is not a valid config."""
    rows = []
    for values in itertools.product(*(vals for _, vals in axes)):
        setting = dict(zip((k for k, _ in axes), values, strict=True))
        try:
            rows.append(SweepRow(setting, run_one(setting)))
        except ConfigError as exc:
            rows.append(SweepRow(setting, None, str(exc)))
    return rows


def recommend(rows: Sequence[SweepRow], max_mean_staleness: float) -> int | None:
    """Index of the highest samples/s among rows whose mean staleness is within the bound (first on a tie)."""
    within = [
        (row.result.samples_per_s, -i)
        for i, row in enumerate(rows)
        if row.result is not None and row.result.staleness_mean <= max_mean_staleness
    ]
    return -max(within)[1] if within else None


def sweep_table(rows: Sequence[SweepRow], best: int | None, max_mean_staleness: float) -> str:
    width = max([len(r.label) for r in rows] + [7]) + 2
    head = f"  {'setting':<{width}}{'s/step':>8}{'samples/s':>11}{'staleness':>10}{'max':>5}{'trainer':>9}"
    lines = [head + f"{'generator':>11}{'wasted':>8}"]
    for i, row in enumerate(rows):
        mark = "* " if i == best else "  "
        r = row.result
        if r is None:
            lines.append(f"{mark}{row.label:<{width}}invalid: {row.error}")
            continue
        lines.append(
            f"{mark}{row.label:<{width}}{r.makespan / max(1, len(r.steps)):>8.2f}{r.samples_per_s:>11.3f}"
            f"{r.staleness_mean:>10.2f}{max(r.counters.staleness, default=0):>5}{r.trainer_utilisation:>9.0%}"
            f"{r.generator_utilisation:>11.0%}{r.wasted_fraction:>8.1%}"
        )
    bound = f"mean staleness <= {max_mean_staleness:g} (--max-mean-staleness)"
    if best is None:
        lines.append(f"recommended: none; no setting has {bound}")
    else:
        lines.append(f"recommended (*): {rows[best].label}, the highest samples/s with {bound}")
    return "\n".join(lines)


def save_sweep_png(rows: Sequence[SweepRow], best: int | None, max_mean_staleness: float, path: str) -> None:
    """Samples/s on the left, mean staleness (with the bound) on the right, one bar per valid setting, the
    recommended setting's bars in another colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    valid = [(i, row.label, row.result) for i, row in enumerate(rows) if row.result is not None]
    ys = list(range(len(valid)))
    colours = ["tab:red" if i == best else "tab:blue" for i, _, _ in valid]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.32 * len(valid) + 2.2), sharey=True)
    left.barh(ys, [r.samples_per_s for _, _, r in valid], color=colours)
    left.set_xlabel("trained samples/s")
    left.set_yticks(ys, [label for _, label, _ in valid], fontsize=8)
    left.set_ylabel("setting")
    left.invert_yaxis()  # sweep order, top to bottom, as the table prints it
    right.barh(ys, [r.staleness_mean for _, _, r in valid], color=colours)
    right.axvline(max_mean_staleness, color="black", ls="--", lw=1)
    right.set_xlabel("mean staleness (steps)")
    handles = [
        Patch(color="tab:blue", label="setting"),
        Patch(color="tab:red", label="recommended: most samples/s within the bound"),
        Line2D([], [], color="black", ls="--", lw=1, label=f"mean staleness bound {max_mean_staleness:g}"),
    ]
    fig.legend(handles=handles, loc="lower center", ncol=3, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0.0, 0.06, 1.0, 1.0))
    fig.savefig(path, dpi=110)
    plt.close(fig)
