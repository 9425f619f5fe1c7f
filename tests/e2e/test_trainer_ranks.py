"""The trainer role as W real processes (gloo on CPU), started by `slipstream launch` with
`[launch.roles.trainer] replicas = W` (ranks find rank 0's store through Redis) or with torchrun-style
variables: next-token pretraining through the training core gives W = 1's losses and final weights
(W = 2 with EP = 2, W = 4 with EP = 2 and two data-parallel replicas), checkpoints written by W ranks
load at W = 1, and a rank killed with SIGKILL ends the others promptly with a message naming it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import load_config
from common.metrics import has_metrics, read_metrics
from trainer.checkpoint import list_checkpoints, load_model_weights
from trainer.model import build_model

REPO = Path(__file__).resolve().parents[2]
STEPS = 20

MODEL = """
[trainer.model]
vocab_size = 64
hidden_size = 32
num_layers = 3
first_k_dense = 1
intermediate_size = 64
moe_intermediate_size = 16
n_routed_experts = 8
num_experts_per_tok = 2
num_heads = 2
kv_lora_rank = 16
qk_nope_head_dim = 8
qk_rope_head_dim = 8
v_head_dim = 8
max_seq_len = 32
"""


def pretrain_config(
    tmp_path: Path, name: str, world: int, ep: int, steps: int = STEPS, run_dir: str = "", muon: bool = False
) -> Path:
    data = tmp_path / "tokens.npy"
    if not data.exists():
        # A learnable stream: mostly a fixed cycle, with some noise, so the loss visibly falls.
        rng = np.random.default_rng(0)
        cycle = (np.arange(4000) * 7) % 64
        np.save(data, np.where(rng.random(4000) < 0.2, rng.integers(0, 64, 4000), cycle))
    text = f"""
[run]
name = "{name}"
root = "{tmp_path / "runs"}"
dir = "{run_dir}"

[trainer]
mode = "pretrain"
steps = {steps}
device = "cpu"

[trainer.data]
path = "{data}"
seq_len = 16
batch_size = 8

[trainer.parallel]
ep = {ep}

[trainer.optim]
grad_accum = 2
lr = 3e-3
router_lr = 3e-3
expert_lr = 3e-3
bias_update_rate = 0.01
seq_aux_loss_coef = 0.01
muon = {str(muon).lower()}
{MODEL}
[launch]
stop_timeout_s = 5.0

[launch.roles.trainer]
replicas = {world}
critical = true
"""
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def launch(cfg: Path, exp: str, timeout_s: float = 150) -> tuple[int, str]:
    """Run `slipstream launch --verbose CFG`; (exit code, output: every line of every rank). A run still going
    after timeout_s (well inside the test's own limit) is stopped with SIGINT and fails the test with what it
    printed."""
    env = {**os.environ, "SLIPSTREAM_EXP": exp, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.runs.cli", "launch", "--verbose", str(cfg)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        pytest.fail(f"launch of {exp} still running after {timeout_s:.0f}s; its output:\n{out[-8000:]}")
    return proc.returncode, out


def losses(run_dir: Path) -> list[float]:
    points = [p for p in read_metrics(run_dir, ["train/loss"]) if p.rank == 0]
    return [p.value for p in sorted(points, key=lambda p: p.step)]


def final_weights(cfg_path: Path, run_dir: Path) -> dict[str, torch.Tensor]:
    """The last checkpoint, loaded into one unsharded model (DCP reshards whatever wrote it)."""
    cfg = load_config(cfg_path)
    model = build_model(cfg.trainer.model, seed=None)
    load_model_weights(list_checkpoints(run_dir / "checkpoints")[-1], model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    state.update({f"bias{i}": m.gate.e_score_correction_bias.clone() for i, m in enumerate(model.moe_layers())})
    return state


@pytest.fixture(scope="module")
def single_rank(tmp_path_factory) -> tuple[list[float], dict[str, torch.Tensor]]:
    tmp = tmp_path_factory.mktemp("w1")
    cfg = pretrain_config(tmp, "w1", 1, 1)
    code, out = launch(cfg, "pt-w1")
    assert code == 0, out
    run_dir = tmp / "runs" / "pt-w1"
    return losses(run_dir), final_weights(cfg, run_dir)


def assert_same_run(
    reference: tuple[list[float], dict[str, torch.Tensor]],
    run_dir: Path,
    cfg: Path,
    steps: int = STEPS,
    min_drop: float = 0.5,
    max_weight_error: float = 1e-5,
) -> None:
    ref_losses, ref_weights = reference
    got = losses(run_dir)
    assert len(got) == len(ref_losses) == steps
    np.testing.assert_allclose(got, ref_losses, rtol=1e-5, atol=0)
    weights = final_weights(cfg, run_dir)
    assert ref_losses[-1] < ref_losses[0] - min_drop  # it trained
    # Per tensor: the norm of the difference within 1e-5 of the norm (ranks sum partial gradients in another
    # order; Adam's normalisation magnifies rounding on elements whose gradients are near zero).
    errors = {n: float((weights[n] - ref).norm() / ref.norm().clamp_min(1e-12)) for n, ref in ref_weights.items()}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] < max_weight_error, (worst, sorted(errors.values())[-5:])


@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_ranks_with_expert_parallelism_train_exactly_what_one_rank_trains(tmp_path, single_rank, world, ep):
    cfg = pretrain_config(tmp_path, f"w{world}", world, ep)
    code, out = launch(cfg, f"pt-w{world}-ep{ep}")
    assert code == 0, out
    assert f"{world // ep} data-parallel replica(s) x expert-parallel {ep}" in out
    assert_same_run(single_rank, tmp_path / "runs" / f"pt-w{world}-ep{ep}", cfg)


def test_muon_on_two_expert_parallel_ranks_trains_what_one_rank_trains(tmp_path):
    """Muon orthogonalises each replicated matrix's momentum on every rank after the gradient all-reduce, so
    the ranks take one rank's step, up to the rounding of the cross-rank gradient sum (~1e-8). torch's Muon
    runs its Newton-Schulz iteration in bf16, which magnifies such differences: at ONE rank, a 1e-7 relative
    perturbation of the gradients moves the weights by 5e-3 (relative norm) after 8 steps, against 4e-7 with
    AdamW (measured with trainer/optim.py's Optimizer on the default model). So: the losses agree within
    1e-5 over 8 steps (they drift apart later: 3e-5 at step 10), the weights within 1e-2."""
    steps = 8
    one = pretrain_config(tmp_path, "m1", 1, 1, steps=steps, muon=True)
    code, out = launch(one, "pt-muon-w1")
    assert code == 0, out
    reference = losses(tmp_path / "runs" / "pt-muon-w1"), final_weights(one, tmp_path / "runs" / "pt-muon-w1")
    two = pretrain_config(tmp_path, "m2", 2, 2, steps=steps, muon=True)
    code, out = launch(two, "pt-muon-w2")
    assert code == 0, out
    assert_same_run(reference, tmp_path / "runs" / "pt-muon-w2", two, steps=steps, min_drop=0.3, max_weight_error=1e-2)


def test_a_two_rank_checkpoint_resumes_on_one_rank_and_continues_the_same_run(tmp_path, single_rank):
    run_dir = tmp_path / "runs" / "split"
    first = pretrain_config(tmp_path, "split2", 2, 2, steps=STEPS // 2, run_dir=str(run_dir))
    code, out = launch(first, "pt-split-w2")
    assert code == 0, out
    second = pretrain_config(tmp_path, "split1", 1, 1, steps=STEPS, run_dir=str(run_dir))
    code, out = launch(second, "pt-split-w1")
    assert code == 0, out
    assert f"at step {STEPS // 2}" in out
    assert_same_run(single_rank, run_dir, second)


def test_a_killed_rank_restarts_the_whole_trainer_which_resumes_exactly(tmp_path, single_rank):
    """Launcher-started W = 2 (EP = 2), checkpoints every 10 steps: SIGKILL of rank 1 after step 11 ends rank 0
    (dead rank), the launcher restarts both ranks together, they resume at step 10 and finish with W = 1's
    losses and weights (each re-trained step's loss equals the first one's: the resume is exact)."""
    cfg = pretrain_config(tmp_path, "gang", 2, 2)
    env = {**os.environ, "SLIPSTREAM_EXP": "pt-gang", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "common.runs.cli", "launch", "--verbose", str(cfg)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    out: list[str] = []
    try:
        assert proc.stdout is not None
        rank1 = None
        for line in proc.stdout:
            out.append(line)
            if rank1 is None and (m := re.search(r"started trainer/1 \(role trainer, pid (\d+)\)", line)):
                rank1 = int(m.group(1))
            if "step 11 loss" in line:
                assert rank1 is not None
                os.kill(rank1, signal.SIGKILL)
                break
        out.append(proc.communicate(timeout=300)[0])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = "".join(out)
    assert proc.returncode == 0, text
    assert "trainer/1 exited with code 137: restarting all 2 replicas of trainer (1/3)" in text, text
    assert text.count("at step 10") >= 2, text  # both ranks resumed from step 10's checkpoint
    run_dir = tmp_path / "runs" / "pt-gang"
    points = [p for p in read_metrics(run_dir, ["train/loss"]) if p.rank == 0]
    by_step: dict[int, list[float]] = {}
    for p in sorted(points, key=lambda p: p.ts_ms):
        by_step.setdefault(p.step, []).append(p.value)
    assert sorted(by_step) == list(range(1, STEPS + 1))
    # Steps the first group logged after the checkpoint (those its writer flushed before it died) were trained
    # again from the same state and data: the same losses.
    for s in (s for s, values in by_step.items() if len(values) > 1):
        assert s > 10 and np.allclose(by_step[s], by_step[s][0], rtol=1e-6, atol=0), (s, by_step[s])
    ref_losses, ref_weights = single_rank
    np.testing.assert_allclose([by_step[s][-1] for s in sorted(by_step)], ref_losses, rtol=1e-5, atol=0)
    weights = final_weights(cfg, run_dir)
    errors = {n: float((weights[n] - ref).norm() / ref.norm().clamp_min(1e-12)) for n, ref in ref_weights.items()}
    assert max(errors.values()) < 1e-5, sorted(errors.values())[-5:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_rank(cfg: Path, exp: str, rank: int, world: int, port: int) -> subprocess.Popen[str]:
    """`slipstream run` of one trainer rank with torchrun-style variables, as torchrun or Slurm would start it."""
    env = {
        **os.environ,
        "ROLE": "trainer",
        "SLIPSTREAM_EXP": exp,
        "OMP_NUM_THREADS": "1",
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }
    return subprocess.Popen(
        [sys.executable, "-m", "common.runs.cli", "run", str(cfg)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_torchrun_variables_start_the_same_ranks_without_the_launcher(tmp_path, single_rank):
    cfg = pretrain_config(tmp_path, "tr", 2, 2)
    port = _free_port()
    procs = [start_rank(cfg, "pt-torchrun", rank, 2, port) for rank in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert_same_run(single_rank, tmp_path / "runs" / "pt-torchrun", cfg)


def test_a_rank_killed_with_sigkill_ends_the_trainer_within_15_s_naming_the_rank(tmp_path):
    """No launcher here: the surviving rank must notice by itself (rank 0 holds the experiment's Redis)."""
    cfg = pretrain_config(tmp_path, "kill", 2, 2, steps=100_000)
    run_dir = tmp_path / "runs" / "pt-kill"
    port = _free_port()
    survivor = start_rank(cfg, "pt-kill", 0, 2, port)
    victim = None
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "meet" / "redis.json").exists():
            assert time.monotonic() < deadline and survivor.poll() is None, "rank 0 did not start Redis"
            time.sleep(0.2)
        victim = start_rank(cfg, "pt-kill", 1, 2, port)
        while not has_metrics(run_dir, "trainer") or _losses_so_far(run_dir) < 3:
            assert time.monotonic() < deadline + 120 and survivor.poll() is None, "training did not start"
            time.sleep(0.5)
        victim.kill()
        killed_at = time.monotonic()
        out, _ = survivor.communicate(timeout=60)
        took = time.monotonic() - killed_at
        assert survivor.returncode != 0, out
        assert took < 15, out
        assert "trainer rank 1 died" in out, out
    finally:
        for p in (survivor, victim):
            if p is not None and p.poll() is None:
                p.kill()
                p.communicate()


def _losses_so_far(run_dir: Path) -> int:
    try:
        return len(losses(run_dir))
    except Exception:  # the file is being written; try again
        return 0
