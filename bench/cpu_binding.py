"""What binding roles to CPUs (launch.roles.<entry>.cpus) does to the demo on this machine: real demo runs
of 20 RL steps (evaluator and eval-pool worker left out, so that only the trainer and the rollout worker
compete), each strategy run unbound and then bound (trainer on CPU 0; the vLLM worker and the router on
CPU 1), one after the other in one invocation. Prints time per step after step 0, the mean train step and
the mean request time, and the ratios unbound / bound.

    python bench/cpu_binding.py [--steps 20] [--strategies on_policy,fully_async]

Run it on an otherwise idle machine: the figures are timings.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from rollout.flow.sim.calibrate import read_run  # noqa: E402

BOUND = ("launch.roles.trainer.cpus=0", "launch.roles.vllm.cpus=1", "launch.roles.router.cpus=1")
UNBOUND = ("launch.roles.trainer.cpus=", "launch.roles.vllm.cpus=", "launch.roles.router.cpus=")


def launch(root: Path, exp: str, sets: list[str]) -> Path:
    cmd = [sys.executable, "-m", "common.runs.cli", "launch", "configs/demo.toml"]
    for s in [f"run.root={root / 'runs'}", *sets]:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": exp}
    with (root / f"{exp}.log").open("wb") as out:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800).returncode
    if code != 0:
        raise SystemExit(f"{exp}: launch exited {code}; its console is {root / f'{exp}.log'}")
    return root / "runs" / exp


def figures(run_dir: Path) -> tuple[float, float, float]:
    """(time per step after step 0, mean train step, mean request time after step 0) in seconds."""
    run = read_run(run_dir)
    steps = run.steps
    warm = steps[0].start + steps[0].duration
    per_step = (steps[-1].start + steps[-1].duration - warm) / (len(steps) - 1)
    train = sum(s.duration for s in steps) / len(steps)
    requests = [s.generate for s in run.samples if s.start >= warm]
    return per_step, train, sum(requests) / len(requests)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--strategies", default="on_policy,fully_async")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ss-cpu-"))
    rows = []
    try:
        for strategy in args.strategies.split(","):
            shared = [
                f"trainer.steps={args.steps}",
                f"flow.strategy={strategy}",
                "launch.roles.evaluator.replicas=0",
                "launch.roles.vllm_eval.replicas=0",
            ]
            name = strategy.replace("_", "-")
            unbound = figures(launch(root, f"cpu-{name}-unbound", [*shared, *UNBOUND]))
            bound = figures(launch(root, f"cpu-{name}-bound", [*shared, *BOUND]))
            rows.append((strategy, unbound, bound))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{'':<14}{'':<26}{'unbound':>9}{'bound':>9}{'unbound/bound':>15}")
    for strategy, unbound, bound in rows:
        for i, what in enumerate(("time per step after step 0", "train step (mean)", "request (mean)")):
            print(
                f"{strategy if i == 0 else '':<14}{what + ' (s)':<26}{unbound[i]:>9.3f}{bound[i]:>9.3f}"
                f"{unbound[i] / bound[i]:>14.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
