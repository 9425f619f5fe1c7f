"""Calibration and run comparison on synthetic runs: the simulator, run with a known timing model, writes a run
directory as a real trainer does (the metrics contract through MetricsWriter, flow_summary.json, config.toml),
with noise on every measured duration; calibration must recover the model, and `--compare` must rebuild the
run and predict it. A multi-turn run (episodes of several requests with tool calls between) is written with
the episode figures (gen/turns, gen/tool_s, gen/env_tokens) and must calibrate back to its turns and tool
calls too; a single-turn run is written without them, as runs from before episodes were."""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from common.config import Config, FlowConfig, RolloutConfig, to_toml
from common.metrics import MetricsWriter
from rollout.flow.sim.calibrate import CalibrationError, calibrate, describe, load_model, read_run, save_model
from rollout.flow.sim.cli import cli_main
from rollout.flow.sim.compare import measured_result, total_variation
from rollout.flow.sim.report import SimResult
from rollout.flow.sim.simulator import Costs, EpisodeModel, ThroughputModel, Workload, simulate
from rollout.flow.strategies import policy_from_config

TRUE_MODEL = ThroughputModel(peak_tokens_per_s=2000.0, half_concurrency=8.0, latency_s=0.2, workers=2)
TRUE_COSTS = Costs(train_s_per_token=1e-4, train_step_overhead_s=0.5, sync_s=0.4, pause_s=0.2)
# Episodes of 1 to 4 turns (shares 1/6, 1/3, 1/3, 1/6), tool calls of 1.5 s (sd 0.75 s) appending 40 tokens each.
TRUE_EPISODES = EpisodeModel(turns={1: 1, 2: 2, 3: 2, 4: 1}, tool_s=1.5, tool_sd=0.75, env_tokens=40)
STEPS = 16


def config(strategy: str) -> Config:
    flow = FlowConfig(
        strategy=strategy, prompts_per_step=8, samples_per_prompt=4, max_concurrent=32, max_untrained_prompts=16
    )
    return Config(flow=flow, rollout=RolloutConfig(max_tokens=2000, max_model_len=4096))


def simulated_run(strategy: str, episodes: EpisodeModel | None = None) -> tuple[Config, SimResult, Workload]:
    cfg = config(strategy)
    workload = Workload(num_prompts=STEPS * 8, median_tokens=100, sigma=1.0, prompt_tokens=20, max_tokens=2000, seed=1)
    policy = policy_from_config(cfg.flow, num_prompts=workload.num_prompts, max_steps=STEPS)
    return cfg, simulate(policy, workload, TRUE_MODEL, TRUE_COSTS, episodes=episodes), workload


def write_run(
    run_dir: Path, cfg: Config, r: SimResult, prompt_tokens: int, noise: float, seed: int = 0, episodes: bool = False
) -> Path:
    """The run directory a trainer would have left, every duration off by a lognormal factor of sigma `noise`;
    with `episodes`, the per-sample episode figures too (a multi-turn run), else without them (a run from
    before episodes)."""
    rng = random.Random(seed)

    def measured(seconds: float) -> float:
        return seconds * math.exp(rng.gauss(0.0, noise))

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.toml").write_text(to_toml(cfg))
    with MetricsWriter(run_dir, "synthetic", "trainer", batch_size=100_000) as metrics:
        for n, s in enumerate(sorted(r.samples, key=lambda s: s.start)):
            figures = {
                "gen/start_s": s.start,
                "gen/queue_s": 0.0,
                "gen/prompt_tokens": prompt_tokens,
                "gen/output_tokens": s.tokens,
                "gen/concurrency": s.concurrency,
                "gen/worker": s.worker,
            }
            if episodes:  # gen/generate_s spans the episode, its tool calls included
                tool = measured(s.tool_s)
                figures |= {"gen/generate_s": measured(s.end - s.start - s.tool_s) + tool, "gen/tool_s": tool}
                figures |= {"gen/turns": s.turns, "gen/env_tokens": s.env_tokens}
            else:
                figures["gen/generate_s"] = measured(s.end - s.start)
            metrics.log_many(n, figures)
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
    assert exact.episodes == EpisodeModel() and "episodes: one turn each, no tool calls" in describe(exact)
    assert [f.name for f in exact.fits] == ["generation", "train step", "publish (trainer)", "publish pause"]
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


def test_a_run_without_the_episode_figures_reads_as_single_turn(tmp_path):
    cfg, r, workload = simulated_run("on_policy")
    run = read_run(write_run(tmp_path / "run", cfg, r, workload.prompt_tokens, noise=0.0))
    assert {(g.turns, g.tool_s, g.env_tokens) for g in run.samples} == {(1, 0.0, 0)}


@pytest.mark.parametrize("strategy", ["on_policy", "fully_async"])
def test_a_multi_turn_run_calibrates_back_to_its_turns_tool_calls_and_generation(tmp_path, strategy):
    cfg, r, workload = simulated_run(strategy, TRUE_EPISODES)
    calls = sum(s.turns - 1 for s in r.samples)
    assert 2.3 < r.turns_per_episode < 2.7 and calls > 700
    exact = calibrate(read_run(write_run(tmp_path / "exact", cfg, r, workload.prompt_tokens, 0.0, episodes=True)))
    e = exact.episodes
    # The histogram and the per-call means are those of the run's episodes, exactly; the drawn calls' spread
    # is the model's within 10%, the drawn histogram its shares within 6 points (3 sd of a share of 500-odd).
    assert e.turns == dict(sorted(Counter(s.turns for s in r.samples).items()))
    assert e.tool_s == pytest.approx(sum(s.tool_s for s in r.samples) / calls) == pytest.approx(1.5, rel=0.03)
    assert e.tool_sd == pytest.approx(0.75, rel=0.1) and e.env_tokens == pytest.approx(40.0)
    n = len(r.samples)
    assert [e.turns[k] / n for k in (1, 2, 3, 4)] == pytest.approx([1 / 6, 1 / 3, 1 / 3, 1 / 6], abs=0.06)
    # The turns are not timed one by one and are placed evenly in their episode: the generation curve comes
    # back within 10% without noise; the train line (its tokens count the tool results) exactly.
    m, c = exact.throughput, exact.costs
    assert (m.peak_tokens_per_s, m.half_concurrency, m.latency_s) == pytest.approx((2000.0, 8.0, 0.2), rel=0.1)
    assert (c.train_s_per_token, c.train_step_overhead_s) == pytest.approx((1e-4, 0.5), rel=1e-3)
    names = [f.name for f in exact.fits]
    assert names == [
        "generation",
        "train step",
        "publish (trainer)",
        "publish pause",
        "tool calls",
        "tool result tokens",
    ]
    assert exact.fits[0].r2 > 0.98 and exact.fits[4].n == sum(s.turns > 1 for s in r.samples)
    text = describe(exact)
    assert "episodes: 2.5" in text and "a tool call 1.4" in text and "appending 40 tokens" in text
    assert "multi-turn episode(s), their turns placed evenly in their span" in text
    # With 3% noise on every duration (the tool calls' too): the generation curve within 15%, the calls within 5%.
    for seed in range(2):
        run_dir = write_run(tmp_path / f"noisy{seed}", cfg, r, workload.prompt_tokens, 0.03, seed, episodes=True)
        noisy = calibrate(read_run(run_dir))
        m, e = noisy.throughput, noisy.episodes
        assert (m.peak_tokens_per_s, m.half_concurrency, m.latency_s) == pytest.approx((2000.0, 8.0, 0.2), rel=0.15)
        assert (e.tool_s, e.tool_sd) == pytest.approx((exact.episodes.tool_s, exact.episodes.tool_sd), rel=0.05)
        assert noisy.fits[0].r2 > 0.98


def test_the_model_file_round_trips_and_a_missing_or_foreign_file_names_the_fix(tmp_path):
    cfg, r, workload = simulated_run("on_policy")
    model = calibrate(read_run(write_run(tmp_path / "run", cfg, r, workload.prompt_tokens, noise=0.0)))
    save_model(model, tmp_path / "m.json")
    assert load_model(tmp_path / "m.json") == model
    cfg, r, workload = simulated_run("on_policy", TRUE_EPISODES)
    multi = calibrate(read_run(write_run(tmp_path / "multi", cfg, r, workload.prompt_tokens, 0.0, episodes=True)))
    save_model(multi, tmp_path / "multi.json")
    assert json.loads((tmp_path / "multi.json").read_text())["format"] == 2
    assert load_model(tmp_path / "multi.json") == multi and multi.episodes.multi_turn
    # A file from before episodes (format 1) is a single-turn model.
    old = json.loads((tmp_path / "m.json").read_text())
    del old["episodes"]
    (tmp_path / "old.json").write_text(json.dumps(old | {"format": 1}))
    assert load_model(tmp_path / "old.json") == model and model.episodes == EpisodeModel()
    (tmp_path / "no_episodes.json").write_text(json.dumps(old | {"format": 2}))
    with pytest.raises(CalibrationError, match="no_episodes.json is not a timing model file"):
        load_model(tmp_path / "no_episodes.json")
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


@pytest.mark.parametrize("strategy", ["on_policy", "fully_async"])
def test_cli_compare_of_a_multi_turn_run_predicts_its_turns_tool_calls_and_step_time(tmp_path, capsys, strategy):
    cfg, r, workload = simulated_run(strategy, TRUE_EPISODES)
    run_dir = write_run(tmp_path / "run", cfg, r, workload.prompt_tokens, noise=0.03, episodes=True)
    assert cli_main(["--calibrate", str(run_dir)]) == 0
    assert "episodes: 2.5" in capsys.readouterr().out
    assert cli_main(["--compare", str(run_dir)]) == 0
    out = capsys.readouterr().out
    lines = {line[:34].strip(): line[34:].split() for line in out.splitlines()}
    # The replay draws new lengths, turns and tool calls from the measured ones: turns within 5%, tool seconds
    # within 10%, time per step and samples/s after step 0 within 10%.
    for row, bound in [
        ("turns per episode (mean)", 0.05),
        ("tool calls per episode (s, mean)", 0.1),
        ("time per step after step 0 (s)", 0.1),
        ("samples/s after step 0", 0.1),
    ]:
        measured, predicted = (float(v) for v in lines[row][:2])
        assert predicted == pytest.approx(measured, rel=bound), f"{row}: measured {measured}, predicted {predicted}"
    turns = float(lines["turns per episode (mean)"][0])
    assert turns == pytest.approx(r.turns_per_episode, rel=1e-3)  # the run's own, as its metrics record it
    assert "episodes: 2.5" in out.split("measured against predicted")[0]  # the model the prediction used


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
