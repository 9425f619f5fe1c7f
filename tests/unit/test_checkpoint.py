"""Checkpoints: exact resume (2N steps == N + resume + N, bitwise on CPU), identity refusal, and a save killed
midway that no resume takes."""

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from common.config import Config
from trainer.checkpoint import CheckpointMismatch, TrainState, list_checkpoints, load_checkpoint, save_checkpoint
from trainer.optim import Optimizer
from trainer.pretrain import PretrainData, Pretrainer


def _cfg(muon: bool = False) -> Config:
    cfg = Config()
    cfg.trainer.optim.muon = muon
    # With Muon the biases happen to be back at exactly 0 after step 6; at step 7 they are not.
    cfg.trainer.steps = 7 if muon else 6
    cfg.trainer.optim.grad_accum = 2
    cfg.trainer.optim.seq_aux_loss_coef = 0.01
    cfg.trainer.optim.bias_update_rate = 0.01
    cfg.trainer.optim.warmup_tokens = 200
    return cfg


@pytest.fixture
def data(tmp_path) -> PretrainData:
    stream = np.random.default_rng(0).integers(0, 128, 3000)
    np.save(tmp_path / "tokens.npy", stream)
    return PretrainData(str(tmp_path / "tokens.npy"), seq_len=16, batch_size=3)


@pytest.mark.parametrize("muon", [False, True])
def test_resume_is_bitwise_exact(tmp_path, data, muon):
    straight = Pretrainer(_cfg(muon), data, tmp_path / "straight")
    straight.run()
    first = Pretrainer(_cfg(muon), data, tmp_path / "resumed")
    first.run(3)
    second = Pretrainer(_cfg(muon), data, tmp_path / "resumed")
    assert second.state.step == 3 and second.state.data_cursor == {"epoch": 0, "position": 18}
    second.run()
    a, b = straight.model.state_dict(), second.model.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert any(m.gate.e_score_correction_bias.abs().sum() > 0 for m in second.model.moe_layers())
    sa, sb = straight.optimizer.adamw.state_dict()["state"], second.optimizer.adamw.state_dict()["state"]
    assert all(torch.equal(sa[i]["exp_avg_sq"], sb[i]["exp_avg_sq"]) for i in sa)
    assert len(second.optimizer.optimizers) == (2 if muon else 1)
    if muon:
        ma, mb = (o.optimizer.optimizers[1].state_dict()["state"] for o in (straight, second))
        assert ma and all(torch.equal(ma[i]["momentum_buffer"], mb[i]["momentum_buffer"]) for i in ma)


def test_resume_refuses_a_different_identity(tmp_path, data):
    Pretrainer(_cfg(), data, tmp_path).run(2)
    cfg = _cfg()
    cfg.trainer.model.num_layers = 3
    with pytest.raises(CheckpointMismatch, match="trainer.model.num_layers"):
        Pretrainer(cfg, data, tmp_path)
    runtime_change = _cfg()
    runtime_change.trainer.steps = 9  # runtime fields may change
    assert Pretrainer(runtime_change, data, tmp_path).state.step == 2


def test_flow_state_rng_and_keep(tmp_path):
    cfg = Config()
    model = torch.nn.Linear(3, 3)
    opt = Optimizer(model, cfg.trainer.optim)
    flow = {"queued": [1, 2, 3], "in_flight": {"p7": 2}}
    for step in (1, 2, 3):
        torch.manual_seed(step)
        save_checkpoint(tmp_path, model, opt, TrainState(step=step, flow_state=flow), cfg, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    expected = torch.rand(4)  # what the RNG gives right after the last save
    torch.manual_seed(99)
    state = load_checkpoint(list_checkpoints(tmp_path)[-1], model, opt, cfg)
    assert state.flow_state == flow and state.step == 3
    torch.testing.assert_close(torch.rand(4), expected)


# A process that saves step 2, then is SIGKILLed by the fault point in the middle of saving step 2 again (the
# end of a run saves the step an interval save may have saved): data files written, `.metadata` not.
_KILLED_MID_SAVE = """
import sys, torch
from pathlib import Path
from common.config import Config
from trainer.checkpoint import TrainState, save_checkpoint
from trainer.optim import Optimizer
root, arm = Path(sys.argv[1]), Path(sys.argv[2])
cfg = Config()
torch.manual_seed(0)
model = torch.nn.Linear(3, 3)
opt = Optimizer(model, cfg.trainer.optim)
save_checkpoint(root, model, opt, TrainState(step=2, flow_state={"saved": "first"}), cfg)
torch.save(model.state_dict(), root / "first.pt")
with torch.no_grad():
    model.weight.add_(1.0)
arm.touch()
save_checkpoint(root, model, opt, TrainState(step=2, flow_state={"saved": "second"}), cfg)
print("the fault point did not fire")
"""


def test_a_save_killed_midway_leaves_the_complete_checkpoint_of_that_step_and_is_never_resumed_from(tmp_path):
    arm = tmp_path / "arm"
    env = {**os.environ, "SLIPSTREAM_FAULT": f"checkpoint_save:{arm}"}
    done = subprocess.run(
        [sys.executable, "-c", _KILLED_MID_SAVE, str(tmp_path), str(arm)], env=env, capture_output=True, timeout=120
    )
    assert done.returncode == -signal.SIGKILL, done.stderr.decode()[-2000:]
    assert not arm.exists(), "the fault fires once per arming: it removes the arming file"
    partial = tmp_path / ".step_00000002.partial"
    assert any(partial.glob("*.distcp")) and not (partial / ".metadata").exists(), "killed after the data files"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    cfg = Config()
    model = torch.nn.Linear(3, 3)
    opt = Optimizer(model, cfg.trainer.optim)
    state = load_checkpoint(list_checkpoints(tmp_path)[-1], model, opt, cfg)
    assert state.flow_state == {"saved": "first"}
    first = torch.load(tmp_path / "first.pt")
    assert all(torch.equal(model.state_dict()[k], first[k]) for k in first)
    # The next save of this process's successor clears what the dead one left and replaces step 2 whole.
    save_checkpoint(tmp_path, model, opt, TrainState(step=2, flow_state={"saved": "third"}), cfg)
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step_00000002"]
    assert load_checkpoint(tmp_path / "step_00000002", model, opt, cfg).flow_state == {"saved": "third"}
