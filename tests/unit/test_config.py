"""The config schema: strict loading, typed overrides, identity fields, show and diff."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from common.config import (
    Config,
    ConfigError,
    field_docs,
    from_dict,
    identity_diff,
    identity_fingerprint,
    leaves,
    load_config,
    to_toml,
)
from common.runs import cli

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.toml"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cfg.toml"
    path.write_text(text)
    return path


def test_unknown_key_names_full_path_and_suggests(tmp_path):
    path = write(tmp_path, "[trainer.optim]\nlearning_rate = 1e-3\n")
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.optim\.learning_rate'"):
        load_config(path, environ={})
    path = write(tmp_path, "[flow]\nmax_stalenes = 1\n")
    with pytest.raises(ConfigError, match=r"did you mean 'max_staleness'"):
        load_config(path, environ={})


def test_unknown_section_suggests_the_close_one(tmp_path):
    with pytest.raises(ConfigError, match=r"unknown key 'routr'.*did you mean 'router'"):
        load_config(write(tmp_path, "[routr]\nport = 1\n"), environ={})


def test_wrong_type_is_rejected_with_path(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer\.steps: expected an integer, got '10'"):
        load_config(write(tmp_path, '[trainer]\nsteps = "10"\n'), environ={})
    with pytest.raises(ConfigError, match=r"flow\.strategy: 'sync' is not one of"):
        load_config(write(tmp_path, '[flow]\nstrategy = "sync"\n'), environ={})
    with pytest.raises(ConfigError, match=r"rollout\.enforce_eager: expected true or false"):
        load_config(write(tmp_path, "[rollout]\nenforce_eager = 1\n"), environ={})


def test_integer_is_accepted_for_float_fields(tmp_path):
    cfg = load_config(write(tmp_path, "[trainer.optim]\nlr = 1\n"), environ={})
    assert cfg.trainer.optim.lr == 1.0 and isinstance(cfg.trainer.optim.lr, float)


def test_set_overrides_are_typed_by_the_schema():
    cfg = load_config(
        DEMO,
        [
            "trainer.optim.lr=3e-4",
            "flow.strategy=on_policy",
            "rollout.enforce_eager=false",
            "trainer.optim.betas=[0.8, 0.9]",
        ],
        environ={},
    )
    assert cfg.trainer.optim.lr == 3e-4
    assert cfg.flow.strategy == "on_policy"
    assert cfg.rollout.enforce_eager is False
    assert cfg.trainer.optim.betas == [0.8, 0.9]


def test_bad_override_values_are_errors():
    with pytest.raises(ConfigError, match=r"trainer\.steps: cannot read 'ten' as int"):
        load_config(DEMO, ["trainer.steps=ten"], environ={})
    with pytest.raises(ConfigError, match=r"expected KEY=VALUE"):
        load_config(DEMO, ["trainer.steps"], environ={})
    with pytest.raises(ConfigError, match=r"unknown key 'trainer\.stepz'.*did you mean 'steps'"):
        load_config(DEMO, ["trainer.stepz=3"], environ={})
    with pytest.raises(ConfigError, match=r"is a section"):
        load_config(DEMO, ["trainer.optim=3"], environ={})


def test_environment_overrides_apply_before_set():
    env = {"SLIPSTREAM__trainer__steps": "7", "SLIPSTREAM__flow__max_staleness": "3", "UNRELATED": "x"}
    cfg = load_config(DEMO, [], environ=env)
    assert (cfg.trainer.steps, cfg.flow.max_staleness) == (7, 3)
    cfg = load_config(DEMO, ["trainer.steps=9"], environ=env)
    assert cfg.trainer.steps == 9
    with pytest.raises(ConfigError, match=r"environment variable SLIPSTREAM__trainer__steps: .*cannot read 'many'"):
        load_config(DEMO, [], environ={"SLIPSTREAM__trainer__steps": "many"})


def test_impossible_combinations_are_rejected():
    with pytest.raises(ConfigError, match=r"max_untrained_prompts \(4\) is below flow\.prompts_per_step \(8\)"):
        load_config(None, ["flow.max_untrained_prompts=4", "flow.prompts_per_step=8"], environ={})
    with pytest.raises(ConfigError, match=r"partial_rollout = true needs rollout\.pause_mode = 'keep'"):
        load_config(None, ["rollout.pause_mode=abort"], environ={})
    with pytest.raises(ConfigError, match=r"num_experts_per_tok \(9\)"):
        load_config(None, ["trainer.model.num_experts_per_tok=9"], environ={})
    with pytest.raises(ConfigError, match=r"no entry is critical"):
        load_config(None, ["launch.roles.router.replicas=1"], environ={})
    fp8 = ["trainer.experts.precision=fp8", "trainer.dtype=bfloat16"]
    with pytest.raises(ConfigError, match=r"fp8' runs on the cutedsl backend only, not 'grouped_mm'"):
        load_config(None, [*fp8, "trainer.experts.backend=grouped_mm"], environ={})
    with pytest.raises(ConfigError, match=r"set trainer\.dtype = 'bfloat16' \(is 'float32'\)"):
        load_config(None, ["trainer.experts.precision=fp8"], environ={})
    with pytest.raises(ConfigError, match=r"hidden_size \(72\) and moe_intermediate_size .* divisible by 16"):
        load_config(None, [*fp8, "trainer.model.hidden_size=72"], environ={})
    load_config(None, [*fp8, "trainer.experts.backend=cutedsl"], environ={})


def test_identity_and_runtime_fields_are_classified():
    base = load_config(DEMO, [], environ={})
    runtime_change = load_config(
        DEMO, ["trainer.steps=99", "rollout.temperature=0.7", "run.root=/elsewhere"], environ={}
    )
    identity_change = load_config(DEMO, ["trainer.model.hidden_size=128", "run.seed=1"], environ={})
    assert identity_diff(base, runtime_change) == []
    assert identity_fingerprint(base) == identity_fingerprint(runtime_change)
    assert sorted(identity_diff(base, identity_change)) == ["run.seed", "trainer.model.hidden_size"]
    assert identity_fingerprint(base) != identity_fingerprint(identity_change)


def test_every_field_has_a_docstring():
    missing = [leaf.path for leaf in leaves(Config()) if not leaf.doc]
    assert missing == []
    assert "oldest token" in field_docs(type(Config().flow))["max_staleness"]


def test_toml_round_trip_reproduces_the_config():
    cfg = load_config(DEMO, ["launch.roles.vllm.replicas=2", 'launch.roles.vllm.env={A = "1"}'], environ={})
    again = from_dict(tomllib.loads(to_toml(cfg)))
    assert again == cfg
    assert again.launch.roles["vllm"].env == {"A": "1"}


def test_show_prints_docstrings_and_values(capsys):
    assert cli.main(["show", str(DEMO), "--set", "trainer.steps=5"]) == 0
    out = capsys.readouterr().out
    assert "[trainer]\n" in out and "steps = 5" in out
    assert "# Steps of the run: optimizer steps when pretraining" in out
    assert "(identity)" in out


def test_show_of_two_configs_prints_only_differences(tmp_path, capsys):
    steps = load_config(DEMO, environ={}).trainer.steps
    text = DEMO.read_text()
    assert f"[trainer]\nsteps = {steps}\n" in text
    other = write(tmp_path, text.replace(f"[trainer]\nsteps = {steps}\n", f"[trainer]\nsteps = {steps + 10}\n"))
    assert cli.main(["show", str(DEMO), str(other)]) == 0
    assert capsys.readouterr().out.strip().splitlines() == [f"trainer.steps: {steps} -> {steps + 10}"]
    assert cli.main(["show", str(DEMO), str(DEMO)]) == 0
    assert "no differences" in capsys.readouterr().out


def test_show_reports_config_errors_with_exit_code_2(tmp_path, capsys):
    assert cli.main(["show", str(write(tmp_path, "[trainer]\nstep = 1\n"))]) == 2
    assert "did you mean 'steps'" in capsys.readouterr().err


def test_console_script_help_and_show_work_in_the_installed_environment():
    exe = Path(sys.executable).parent / "slipstream"
    assert exe.exists(), "the slipstream console script is not installed in this environment (pip install -e .)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")}
    help_out = subprocess.run([exe, "--help"], capture_output=True, text=True, check=True, env=env).stdout
    for command in ("run", "launch", "scripts", "show", "simulate"):
        assert command in help_out
    show = subprocess.run([exe, "show", "configs/demo.toml"], capture_output=True, text=True, cwd=REPO, env=env)
    assert show.returncode == 0, show.stderr
    assert "[flow]" in show.stdout


def test_defaults_equal_an_empty_file(tmp_path):
    assert load_config(write(tmp_path, ""), environ={}) == dataclasses.replace(Config())


def test_a_list_of_tables_added_later_stays_out_of_the_fingerprint_until_it_is_set():
    """Checkpoints written before trainer.data.sources / rollout.task.sources existed keep resuming: those
    fields, at their default (empty), are not fingerprinted; a set one is."""
    from common.config import identity_fingerprint, leaves

    cfg = load_config(REPO / "configs" / "demo.toml")
    printed = {leaf.path for leaf in leaves(cfg) if leaf.fingerprinted}
    assert "trainer.data.sources" not in printed and "rollout.task.sources" not in printed
    assert "trainer.rl.token_mask_band" in printed  # an identity list without `added` always is
    mixed = load_config(REPO / "configs" / "demo.toml", ['trainer.data.sources=[{name = "web", path = "w.jsonl"}]'])
    assert identity_fingerprint(mixed) != identity_fingerprint(cfg)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.temperature=0", r"rollout\.temperature = 0\.0: RL needs sampling"),
        ("rollout.top_p=0", r"rollout\.top_p = 0\.0 must be in \(0, 1\]"),
        ("rollout.top_p=1.5", r"rollout\.top_p = 1\.5 must be in \(0, 1\]"),
        ("rollout.top_k=-2", r"rollout\.top_k = -2 must be >= 1, or 0 / -1"),
        ('rollout.extra_args=["--logprobs-mode=raw_logprobs"]', r"rollout\.extra_args sets --logprobs-mode"),
        ('rollout.extra_args=["--logits-processors", "m:P"]', r"rollout\.extra_args sets --logits-processors"),
    ],
)
def test_sampling_the_trainer_cannot_reproduce_is_refused_naming_the_field(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_tempered_and_truncated_sampling_is_accepted_and_greedy_is_fine_outside_rl():
    cfg = load_config(None, ["rollout.temperature=0.7", "rollout.top_k=-1", "rollout.top_p=0.9"])
    assert (cfg.rollout.temperature, cfg.rollout.top_k, cfg.rollout.top_p) == (0.7, -1, 0.9)
    load_config(None, ["rollout.temperature=0", "trainer.mode=pretrain", "trainer.data.path=x.jsonl"])
