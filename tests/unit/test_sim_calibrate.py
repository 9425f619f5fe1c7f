"""Calibration and run comparison on synthetic runs: the simulator, run with a known timing model, writes a run
directory as a real trainer does (the metrics contract through MetricsWriter, flow_summary.json, config.toml),
with noise on every measured duration; calibration must recover the model, and `--compare` must rebuild the
run and predict it."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from common.config import Config, FlowConfig, RolloutConfig, to_toml
from common.metrics import MetricsWriter
from rollout.flow.sim.calibrate import CalibrationError, calibrate, load_model, read_run, save_model
from rollout.flow.sim.cli import cli_main
from rollout.flow.sim.compare import measured_result, total_variation
from rollout.flow.sim.report import SimResult
from rollout.flow.sim.simulator import Costs, ThroughputModel, Workload, simulate
from rollout.flow.strategies import policy_from_config

TRUE_MODEL = ThroughputModel(peak_tokens_per_s=2000.0, half_concurrency=8.0, latency_s=0.2, workers=2)
TRUE_COSTS = Costs(train_s_per_token=1e-4, train_step_overhead_s=0.5, sync_s=0.4, pause_s=0.2)
STEPS = 16


def config(strategy: str) -> Config:
    flow = FlowConfig(
        strategy=strategy, prompts_per_step=8, samples_per_prompt=4, max_concurrent=32, max_untrained_prompts=16
    )
    return Config(flow=flow, rollout=RolloutConfig(max_tokens=2000, max_model_len=4096))


def simulated_run(strategy: str) -> tuple[Config, SimResult, Workload]:
    cfg = config(strategy)
    workload = Workload(num_prompts=STEPS * 8, median_tokens=100, sigma=1.0, prompt_tokens=20, max_tokens=2000, seed=1)
    policy = policy_from_config(cfg.flow, num_prompts=workload.num_prompts, max_steps=STEPS)
    return cfg, simulate(policy, workload, TRUE_MODEL, TRUE_COSTS), workload


def write_run(run_dir: Path, cfg: Config, r: SimResult, prompt_tokens: int, noise: float, seed: int = 0) -> Path:
    """The run directory a trainer would have left, every duration off by a lognormal factor of sigma `noise`."""
    rng = random.Random(seed)

    def measured(seconds: float) -> float:
        return seconds * math.exp(rng.gauss(0.0, noise))

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    with MetricsWriter(run_dir, "synthetic", "trainer", batch_size=100_000) as metrics:
        for n, s in enumerate(sorted(r.samples, key=lambda s: s.start)):
            metrics.log_many(
                n,
                {
                    "gen/start_s": s.start,
                    "gen/queue_s": 0.0,
                    "gen/generate_s": measured(s.end - s.start),
                    "gen/prompt_tokens": prompt_tokens,
                    "gen/output_tokens": s.tokens,
                    "gen/concurrency": s.concurrency,
                    "gen/worker": s.worker,
                },
            )
        for step in r.steps:
            metrics.log_many(
                step.step,
                {
                    "perf/step_s": measured(step.end - step.start),
                    "perf/step_start_s": step.start,
                    "perf/step_tokens": step.tokens,
                },
            )
        for span in r.spans:
            if span.kind == "sync":
                figures = {"weights/publish_s": measured(span.end - span.start), "weights/publish_start_s": span.start}
                metrics.log_many(span.label, figures | {"weights/max_pause_s": measured(TRUE_COSTS.publish_pause_s)})
    summary = {"finish_reason": r.finish_reason, "counters": r.counters.state()}
    (run_dir / "flow_summary.json").write_text(json.dumps(summary))
    return run_dir


@pytest.mark.parametrize("strategy", ["on_policy", "fully_async"])
def test_calibration_recovers_the_model_the_metrics_were_made_with(tmp_path, strategy):
    cfg, r, workload = simulated_run(strategy)
    # Without noise the fits are exact; with 3% noise on every duration the generation curve and the publish
    # are within 15%, the train line (16 points) within 20%.
    exact = calibrate(read_run(write_run(tmp_path / "exact", cfg, r, workload.prompt_tokens, noise=0.0)))
    m, c = exact.throughput, exact.costs
    assert (m.peak_tokens_per_s, m.half_concurrency, m.latency_s) == pytest.approx((2000.0, 8.0, 0.2), rel=1e-3)
    assert (c.train_s_per_token, c.train_step_overhead_s, c.sync_s, c.pause_s) == pytest.approx(
        (1e-4, 0.5, 0.4, 0.2), rel=1e-3
    )
    assert m.workers == 2
    for seed in range(2):
        noisy = calibrate(read_run(write_run(tmp_path / f"noisy{seed}", cfg, r, workload.prompt_tokens, 0.03, seed)))
        m, c = noisy.throughput, noisy.costs
        assert (m.peak_tokens_per_s, m.half_concurrency, m.latency_s) == pytest.approx((2000.0, 8.0, 0.2), rel=0.15)
        assert (c.train_s_per_token, c.train_step_overhead_s) == pytest.approx((1e-4, 0.5), rel=0.2)
        assert (c.sync_s, c.pause_s) == pytest.approx((0.4, 0.2), rel=0.05)
        generation = noisy.fits[0]
        # Fitted on the requests sent after step 0 ended (calibrate leaves a real run's start out).
        steady = sum(1 for g in r.samples if g.start >= r.steps[0].end)
        assert generation.name == "generation" and generation.n == steady and generation.r2 > 0.98


def test_the_model_file_round_trips_and_a_missing_or_foreign_file_names_the_fix(tmp_path):
    cfg, r, workload = simulated_run("on_policy")
    model = calibrate(read_run(write_run(tmp_path / "run", cfg, r, workload.prompt_tokens, noise=0.0)))
    save_model(model, tmp_path / "m.json")
    assert load_model(tmp_path / "m.json") == model
    with pytest.raises(CalibrationError, match="--calibrate RUN_DIR"):
        load_model(tmp_path / "none.json")
    (tmp_path / "bad.json").write_text(json.dumps({"format": 1, "throughput": {"peak": 1}, "costs": {}}))
    with pytest.raises(CalibrationError, match="bad.json is not a timing model file.*--calibrate"):
        load_model(tmp_path / "bad.json")


def test_a_run_rebuilt_from_its_metrics_is_the_simulated_run(tmp_path):
    cfg, r, workload = simulated_run("fully_async")
    run = read_run(write_run(tmp_path / "run", cfg, r, workload.prompt_tokens, noise=0.0))
    rebuilt = measured_result(run, cfg.flow, TRUE_MODEL)
    assert rebuilt.makespan == pytest.approx(r.makespan)
    assert rebuilt.counters == r.counters and rebuilt.samples_per_s == pytest.approx(r.samples_per_s)
    assert rebuilt.trainer_utilisation == pytest.approx(r.trainer_utilisation)
    assert rebuilt.generated_tokens == sum(s.tokens for s in r.samples)
    # In flight over time: the simulator counts aborted requests too, the metrics only completed ones.
    assert max(p.concurrency for p in rebuilt.trace) == max(p.concurrency for p in r.trace) == 32
    assert sum(p.paused for p in rebuilt.trace) == sum(p.paused for p in r.trace) > 0


def test_total_variation_distance_is_half_the_l1_distance_of_the_shares():
    assert total_variation({0: 10, 1: 10}, {0: 5, 1: 5}) == 0.0
    assert total_variation({0: 3, 1: 1}, {1: 2, 2: 2}) == pytest.approx(0.5 * (0.75 + 0.25 + 0.5))
    assert total_variation({0: 1}, {2: 7}) == 1.0


def test_cli_calibrate_then_compare_predicts_the_run_and_draws_both(tmp_path, capsys):
    cfg, r, workload = simulated_run("fully_async")
    run_dir = write_run(tmp_path / "run", cfg, r, workload.prompt_tokens, noise=0.03)
    assert cli_main(["--calibrate", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "generation per worker" in out and "R^2" in out and f"model written to {run_dir / 'sim_model.json'}" in out
    assert cli_main(["--compare", str(run_dir)]) == 0
    out = capsys.readouterr().out
    lines = {line[:34].strip(): line[34:].split() for line in out.splitlines()}
    measured, predicted = (float(v) for v in lines["samples/s"][:2])
    assert measured == pytest.approx(r.samples_per_s, rel=0.01)  # the durations are measured with noise
    assert predicted == pytest.approx(measured, rel=0.15)  # the replay draws new lengths from the measured ones
    tvd = float(out.split("staleness total variation distance ")[1].split()[0])
    assert tvd < 0.15
    assert "generator utilisation" in out and "trainer utilisation" in out and "time per step (s)" in out
    assert (run_dir / "sim_compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_compare_without_a_model_file_tells_to_calibrate(tmp_path, capsys):
    cfg, r, workload = simulated_run("on_policy")
    run_dir = write_run(tmp_path / "run", cfg, r, workload.prompt_tokens, noise=0.0)
    assert cli_main(["--compare", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert f"no timing model at {run_dir / 'sim_model.json'}" in err
    assert f"make one with `slipstream simulate --calibrate {run_dir}`" in err and "or pass --model FILE" in err


@pytest.mark.parametrize("mode", ["--calibrate", "--compare"])
def test_cli_on_a_run_dir_without_metrics_names_what_to_give(tmp_path, capsys, mode):
    assert cli_main([mode, str(tmp_path / "missing")]) == 2
    assert "does not exist; give a run's directory" in capsys.readouterr().err
    (tmp_path / "config.toml").write_text(to_toml(config("on_policy")))
    assert cli_main([mode, str(tmp_path)]) == 2
    assert "has no trainer metrics" in capsys.readouterr().err
    with MetricsWriter(tmp_path, "old", "trainer") as metrics:
        metrics.log("perf/step_s", 0, 1.0)  # a run from before the per-sample metrics
    assert cli_main([mode, str(tmp_path)]) == 2
    assert "no gen/start_s" in capsys.readouterr().err
