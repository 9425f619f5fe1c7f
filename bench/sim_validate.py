"""Does the simulator predict real runs? Three real demo runs on this machine, the same config but the flow
strategy: on-policy (the calibration run), then fully-async and one-step-off. The simulator's timing model
is fitted on the on-policy run (`slipstream simulate --calibrate`) and each other run is replayed with it
(`slipstream simulate --compare`), which prints predicted against measured and draws both timelines.

    python bench/sim_validate.py [--steps 20] [--keep]

The evaluator and its eval-pool worker are left out of all three runs (their load on this 2-core machine is
not part of the flow the simulator models). Run it on an otherwise idle machine: the figures are timings.
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
STRATEGIES = ("on_policy", "fully_async", "one_step_off")


def launch(root: Path, strategy: str, steps: int) -> Path:
    """One real demo run of `strategy`; its run dir."""
    exp = f"sv-{strategy.replace('_', '-')}"
    sets = [
        f"run.root={root / 'runs'}",
        f"trainer.steps={steps}",
        f"flow.strategy={strategy}",
        "launch.roles.evaluator.replicas=0",
        "launch.roles.vllm_eval.replicas=0",
    ]
    cmd = [sys.executable, "-m", "common.cli", "launch", "configs/demo.toml"]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": exp}
    with (root / f"{exp}.log").open("wb") as out:
        code = subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=1800).returncode
    if code != 0:
        raise SystemExit(f"{exp}: launch exited {code}; its console is {root / f'{exp}.log'}")
    return root / "runs" / exp


def simulate(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "common.cli", "simulate", *args], cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"slipstream simulate {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--keep", action="store_true", help="keep the run dirs (printed)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ss-sv-"))
    try:
        runs = {s: launch(root, s, args.steps) for s in STRATEGIES}
        model = runs["on_policy"] / "sim_model.json"
        print(f"## calibration on the on-policy run ({args.steps} steps)\n")
        print(simulate("--calibrate", str(runs["on_policy"])))
        for strategy in STRATEGIES:
            print(f"## {strategy}: predicted from the on-policy model against measured\n")
            print(simulate("--compare", str(runs[strategy]), "--model", str(model)))
    finally:
        if args.keep:
            print(f"run dirs under {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
