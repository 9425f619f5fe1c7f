"""RL your own checkpoint, end to end with real processes: `slipstream launch configs/byo-<family>.toml --set
rollout.model=DIR` where DIR is a tiny Qwen3-MoE, or a tiny DeepSeek-V3 with YaRN RoPE as the released
DeepSeek-V3 / Kimi-K2 / Moonlight checkpoints have it, written by transformers with the tiny kit's tokenizer
and its chat template (what a user brings). The vLLM worker serves DIR, the trainer takes its shape from DIR's
config.json and streams its weights, every published version carries the config, tokenizer and chat template,
and the run ends with exit code 0. (That prompts go through a tokenizer's chat template is
tests/unit/test_chat_template.py's.)"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import launch_env

from tests.support.hf_dirs import tiny_deepseek_v3_dir, tiny_qwen3_dir
from trainer.tinykit import CHAT_TEMPLATE

REPO = Path(__file__).resolve().parents[2]
STEPS = 2


FAMILIES = {
    "qwen3-moe": lambda out: tiny_qwen3_dir(out),
    "deepseek-v3-yarn": lambda out: tiny_deepseek_v3_dir(out, yarn=True),
}


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_rl_runs_from_an_hf_directory_with_its_chat_template(short_root, family):
    model_dir = FAMILIES[family](short_root / f"my-{family}")
    config = "configs/byo-qwen3-moe.toml" if family == "qwen3-moe" else "configs/byo-deepseek-v3.toml"
    exp = f"byo-{family}"
    sets = [
        f"run.root={short_root / 'runs'}",
        f"rollout.model={model_dir}",
        f"trainer.steps={STEPS}",
        "flow.prompts_per_step=8",
        "evaluator.limit=16",
        "rendezvous.heartbeat_period_s=0.5",
        "rendezvous.heartbeat_ttl_s=2.0",
        "trainer.final_eval_wait_s=300",
    ]
    cmd = [sys.executable, "-m", "common.runs.cli", "launch", config]
    for s in sets:
        cmd += ["--set", s]
    env = launch_env(SLIPSTREAM_EXP=exp)
    log_path = short_root / "launch.log"
    with log_path.open("wb") as out:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=840).returncode
    run_dir = short_root / "runs" / exp
    logs = "\n".join(p.read_text(errors="replace") for p in [log_path, *sorted((run_dir / "logs").glob("*.log"))])
    assert code == 0, logs[-6000:]
    # The trainer streamed DIR (trainer/hf_stream.py's log line) into a model of its shape, YaRN included.
    assert f"of {model_dir}; 0 expert entries of other ranks left unread" in logs
    shape = {"qwen3-moe": "qwen3_moe, 2 layers (0 dense)", "deepseek-v3-yarn": "deepseek_v3, 2 layers (1 dense)"}
    rope = {"qwen3-moe": "rope default", "deepseek-v3-yarn": "rope yarn x8 over 64"}
    line = f"trainer.model from {model_dir}/config.json: {shape[family]}"
    assert re.search(f"{re.escape(line)}.*{re.escape(rope[family])}", logs), [
        x for x in logs.splitlines() if "trainer.model from" in x
    ]
    versions = sorted((run_dir / "weights").glob("v*"))
    assert [v.name for v in versions] == [f"v{i}" for i in range(STEPS + 1)]
    for v in versions:
        assert json.loads((v / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
        assert (v / "config.json").read_bytes() == (model_dir / "config.json").read_bytes()
