"""`slipstream simulate`'s inputs and sweeps: the workload a whole config implies, the layers of config, model
file (its episode model too) and flags, and `--sweep` with its recommendation."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import load_config
from rollout.flow.events import FlowCounters
from rollout.flow.sim.calibrate import SimModel, save_model
from rollout.flow.sim.cli import build_parser, cli_main, load_inputs, task_workload
from rollout.flow.sim.report import SimResult
from rollout.flow.sim.simulator import Costs, EpisodeModel, ThroughputModel
from rollout.flow.sim.sweep import SweepRow, recommend

DEMO = str(Path(__file__).resolve().parents[2] / "configs" / "demo.toml")


def inputs(*argv: str):
    args = build_parser().parse_args(list(argv))
    return load_inputs(args, args.config, None, None)


def test_the_demo_config_simulates_completions_within_its_six_token_cap():
    cfg = load_config(DEMO)
    fields = task_workload(cfg)
    assert cfg.rollout.max_tokens == fields["max_tokens"] == 6
    assert max(fields["lengths"]) <= 6 and 3 <= fields["prompt_tokens"] <= 8  # "3+4=" is four characters
    demo = inputs("--config", DEMO, "--steps", "2")
    r = demo.simulate()
    assert len(r.steps) == 2 and r.samples and max(s.tokens for s in r.samples) <= 6
    assert inputs("--config", DEMO).steps == cfg.trainer.steps  # the config's steps unless --steps says otherwise


def test_workload_flags_override_the_config():
    w = inputs("--config", DEMO, "--median-tokens", "40", "--max-tokens", "5", "--prompt-tokens", "9").workload
    assert (w.lengths, w.median_tokens, w.max_tokens, w.prompt_tokens) == ((), 40.0, 5, 9)  # the lognormal, capped
    assert inputs().workload.max_tokens == 16384  # no config: the simulator's own defaults


def test_timing_flags_override_the_model_file(tmp_path, capsys):
    model = SimModel(ThroughputModel(900.0, 3.0, 0.01, 1), Costs(1e-4, 0.2, 0.3, 0.1))
    save_model(model, tmp_path / "m.json")
    assert (
        cli_main(["--model", str(tmp_path / "m.json"), "--workers", "3", "--steps", "1", "--median-tokens", "8"]) == 0
    )
    assert "model: 3 worker(s), peak 900 tokens/s, half 3, latency 10 ms" in capsys.readouterr().out


def test_episode_flags_override_the_model_files_episodes(tmp_path, capsys):
    episodes = EpisodeModel(turns={1: 1, 3: 1}, tool_s=0.5, tool_sd=0.1, env_tokens=12)
    save_model(
        SimModel(ThroughputModel(900.0, 3.0, 0.01, 1), Costs(1e-4, 0.2, 0.3, 0.1), episodes=episodes),
        tmp_path / "m.json",
    )
    base = ["--model", str(tmp_path / "m.json"), "--steps", "2", "--median-tokens", "8"]
    assert cli_main(base) == 0
    out = capsys.readouterr().out
    assert "episodes: 2 turns on average {1: 50%, 3: 50%}; a tool call 0.5 s (sd 0.1 s), appending 12 tokens" in out
    assert "episodes: " in out.split("strategy fully_async")[1]  # the run's summary counts its turns and calls
    args = build_parser().parse_args([*base, "--turns", "2", "--tool-s", "3", "--env-tokens", "0"])
    e = load_inputs(args, None, None, SimModel(ThroughputModel(), Costs(), episodes=episodes)).episodes
    assert e == EpisodeModel(turns={2: 1}, tool_s=3.0, tool_sd=0.1, env_tokens=0.0)
    assert inputs().episodes == EpisodeModel()  # no model file: single turn
    assert cli_main([*base, "--turns", "0"]) == 2
    assert "--turns 0: an episode has at least one turn" in capsys.readouterr().err
    assert cli_main([*base, "--tool-sd", "-1"]) == 2
    assert "--tool-sd -1.0: it must be >= 0" in capsys.readouterr().err


SMALL = ["--strategy", "fully_async", "--prompts-per-step", "4", "--samples-per-prompt", "2"]
SMALL += ["--max-untrained-prompts", "8", "--steps", "4", "--median-tokens", "64"]
# Generation-bound: a small worker, a trainer that takes 0.1 s a step and a publish.
SMALL += ["--peak-tokens-per-s", "1000", "--half-concurrency", "4", "--train-overhead-s", "0.1"]
SMALL += ["--train-s-per-token", "0", "--sync-s", "0.1"]


def table_rows(out: str) -> list[str]:
    return [line for line in out.splitlines() if line[2:].startswith(("workers=", "strategy=", "max_"))]


def test_sweep_prints_one_row_per_setting_and_marks_exactly_one_recommended(tmp_path, capsys):
    png = tmp_path / "sweep.png"
    argv = [*SMALL, "--sweep", "workers=1,2", "--sweep", "max_concurrent=4,16", "--png", str(png)]
    assert cli_main(argv) == 0
    out = capsys.readouterr().out
    rows = table_rows(out)
    assert [r[2:].split()[:2] for r in rows] == [
        ["workers=1", "max_concurrent=4"],
        ["workers=1", "max_concurrent=16"],
        ["workers=2", "max_concurrent=4"],
        ["workers=2", "max_concurrent=16"],
    ]
    assert sum(r.startswith("* ") for r in rows) == 1
    assert "recommended (*): workers=2 max_concurrent=16" in out  # more of each: faster, staleness within 1
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # More requests in flight are staler: a tighter bound picks the fastest of the less concurrent settings.
    assert cli_main([*argv, "--max-mean-staleness", "0.5"]) == 0
    assert "recommended (*): workers=2 max_concurrent=4," in capsys.readouterr().out


def test_a_sweep_setting_the_config_rejects_is_a_row_that_says_why(tmp_path, capsys):
    argv = [
        *SMALL,
        "--max-staleness",
        "0",
        "--sweep",
        "strategy=one_step_off,on_policy",
        "--png",
        str(tmp_path / "s.png"),
    ]
    assert cli_main(argv) == 0
    rows = table_rows(capsys.readouterr().out)
    assert "invalid: flow.strategy = 'one_step_off'" in rows[0] and "max_staleness >= 1" in rows[0]
    assert rows[1].startswith("* strategy=on_policy")


def result(samples_per_s: float, staleness: dict[int, int]) -> SimResult:
    counters = FlowCounters(trained_samples=round(samples_per_s * 10), staleness=staleness)
    return SimResult("fully_async", 1, 10.0, [], [], [], counters, 0.0, 0, 0.0, 1.0, "max_steps")


def test_the_recommendation_is_the_fastest_setting_within_the_staleness_bound_first_on_a_tie():
    rows = [
        SweepRow({"n": 0}, result(10, {0: 1})),
        SweepRow({"n": 1}, result(30, {2: 1})),  # fastest, but mean staleness 2
        SweepRow({"n": 2}, result(20, {1: 1})),
        SweepRow({"n": 3}, result(20, {0: 1, 1: 1})),
        SweepRow({"n": 4}, None, "invalid"),
    ]
    assert recommend(rows, 1.0) == 2
    assert recommend(rows, 0.0) == 0
    assert recommend(rows, 5.0) == 1
    assert recommend(rows, -1.0) is None


@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("bogus=1,2", "--sweep bogus: not a sweep key; sweep workers or a flow knob: strategy, prompts_per_step"),
        ("max_concurrent", "give KEY=V1,V2,..., e.g. --sweep max_concurrent=32,64,128"),
        ("workers=0,1", "a pool has at least one worker"),
        ("strategy=on_policy,lazy", "'lazy' is not one of"),
    ],
)
def test_sweep_specs_that_cannot_run_name_the_fix(capsys, spec, error):
    assert cli_main([*SMALL, "--sweep", spec]) == 2
    assert error in capsys.readouterr().err


def test_out_without_calibrate_and_compare_without_a_run_dir_are_refused(capsys):
    assert cli_main(["--out", "m.json"]) == 2
    assert "--out names the model file --calibrate writes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--compare"])  # --compare takes the run to compare; --strategies replaced the flag
    assert "--compare: expected one argument" in capsys.readouterr().err
