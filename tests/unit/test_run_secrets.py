"""A run's generated tokens (common/run_secrets.py): one 0600 file in the meet dir, the same for every process
that starts on it at once, and a token set in the config wins."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.config import load_config
from common.roles import context_for
from common.run_secrets import SECRETS_FILE, SecretsError, ensure_secrets, read_secrets, without_tokens
from common.runs.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]

# Each process says it is ready, waits for the start file, then makes (or reads) the secrets and prints them.
RACER = """
import os, sys, time
from pathlib import Path
from common.run_secrets import ensure_secrets
go = Path(sys.argv[2])
(go.parent / f"ready-{os.getpid()}").touch()
while not go.exists():
    time.sleep(0.001)
print(ensure_secrets(Path(sys.argv[1])).router)
"""


def test_processes_starting_at_once_on_one_meet_dir_all_get_the_same_secrets(tmp_path):
    meet, go = tmp_path / "meet", tmp_path / "go"
    env = os.environ | {"PYTHONPATH": str(REPO)}
    racers = [
        subprocess.Popen([sys.executable, "-c", RACER, str(meet), str(go)], stdout=subprocess.PIPE, text=True, env=env)
        for _ in range(8)
    ]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("ready-*"))) < len(racers):  # all at the line, then one start for all
        assert time.monotonic() < deadline, "racers did not start within 60 s"
        time.sleep(0.01)
    go.touch()
    tokens = {racer.communicate(timeout=60)[0].strip() for racer in racers}
    assert all(racer.returncode == 0 for racer in racers)
    assert len(tokens) == 1 and len(tokens.pop()) >= 32
    assert stat.S_IMODE((meet / SECRETS_FILE).stat().st_mode) == 0o600
    assert [p.name for p in meet.iterdir()] == [SECRETS_FILE]  # no candidate file left behind


def test_secrets_are_distinct_per_service_and_per_run(tmp_path):
    a, b = ensure_secrets(tmp_path / "a"), ensure_secrets(tmp_path / "b")
    assert len({a.router, a.workers, a.dash, b.router}) == 4
    assert ensure_secrets(tmp_path / "a") == a == read_secrets(tmp_path / "a")
    assert read_secrets(tmp_path / "c") is None


def test_a_secrets_file_open_to_others_or_malformed_is_refused_naming_the_fix(tmp_path):
    ensure_secrets(tmp_path)
    path = tmp_path / SECRETS_FILE
    path.chmod(0o644)
    with pytest.raises(SecretsError, match=f"readable by other users .*chmod 600 {path}"):
        read_secrets(tmp_path)
    path.chmod(0o600)
    path.write_text(json.dumps({"router": "x"}))
    with pytest.raises(SecretsError, match="must hold the non-empty strings"):
        read_secrets(tmp_path)


def test_a_role_gets_the_generated_tokens_unless_its_config_sets_them(tmp_path):
    base = [f"run.root={tmp_path}", f"rendezvous.meet_dir={tmp_path / 'meet'}"]
    ctx = context_for(load_config(None, base, environ={}), "router", environ={"SLIPSTREAM_EXP": "s"}, connect=False)
    run = read_secrets(tmp_path / "meet")
    assert run is not None
    assert (ctx.cfg.router.auth_token, ctx.cfg.rollout.api_key) == (run.router, run.workers)
    # A checkpoint records the config without them.
    blank = without_tokens(ctx.cfg)
    assert (blank.router.auth_token, blank.rollout.api_key) == ("", "")
    set_ = load_config(None, [*base, "router.auth_token=mine"], environ={"SLIPSTREAM__rollout__api_key": "k"})
    ctx = context_for(set_, "router", environ={"SLIPSTREAM_EXP": "s"}, connect=False)
    assert (ctx.cfg.router.auth_token, ctx.cfg.rollout.api_key) == ("mine", "k")


def test_slipstream_token_prints_the_asked_token_of_a_meet_or_run_dir(tmp_path, capsys):
    run = ensure_secrets(tmp_path / "meet")
    assert cli_main(["token", str(tmp_path)]) == 0
    assert cli_main(["token", str(tmp_path / "meet"), "dash"]) == 0
    assert capsys.readouterr().out.split() == [run.router, run.dash]
    assert cli_main(["token", str(tmp_path / "meet" / "nowhere")]) == 2
    assert "no secrets.json in" in capsys.readouterr().err
