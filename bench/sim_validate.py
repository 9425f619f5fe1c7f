"""Does the simulator predict real runs? Three real demo runs on this machine, the same config but the flow
strategy: on-policy (the calibration run), then fully-async and one-step-off. The simulator's timing model
is fitted on the on-policy run (`slipstream simulate --calibrate`) and each other run is replayed with it
(`slipstream simulate --compare`), which prints predicted against measured and draws both timelines.

    python bench/sim_validate.py [--config configs/demo.toml] [--steps 20] [--keep] [--set KEY=VALUE ...]
        [--strategies on_policy,fully_async,one_step_off] [--fixture DIR]

`--config configs/tools-demo.toml` does the same with multi-turn tool episodes: the model then also holds the
turns per episode and the tool calls' seconds the calibration run measured.

`--fixture DIR` also writes what tests/unit/test_sim_real.py checks the simulator against: the calibration
(DIR/sim_model.json, as --calibrate wrote it) and each run's measured figures and completion lengths
(DIR/runs.json, with this command).

`--set` goes to all three launches, after the CPU binding below (so it can change it).

The evaluator and its eval-pool worker are left out of all three runs (their load on this 2-core machine is
not part of the flow the simulator models). The trainer, the launcher and its Redis get CPU 0, the vLLM worker
and the router CPU 1 (launch.roles.<entry>.cpus): the simulator models a trainer and workers that do not slow
each other down, as on a GPU host where each has its own devices. On shared cores an overlapped train step
took 1.7-2.2x its on-policy time (bench/RESULTS.md, 2026-12-03), which no on-policy run can show. Run it on an
otherwise idle machine: the figures are timings.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STRATEGIES = ("on_policy", "fully_async", "one_step_off")
PINNED = ("launch.roles.trainer.cpus=0", "launch.roles.vllm.cpus=1", "launch.roles.router.cpus=1")
# The launcher and the Redis it starts run beside the trainer. On CPU 1 they slowed generation (one-step-off
# 2.03-2.19 s per step against 1.66-1.71 s on CPU 0); unbound they landed on either side from run to run,
# and identical runs spread over 1.48-1.99 s (bench/RESULTS.md, 2026-12-04).
LAUNCHER_CPUS = {0}


def overrides(steps: int, extra: list[str]) -> list[str]:
    """The config changes every run shares (the strategy and the run root aside)."""
    return [
        f"trainer.steps={steps}",
        "launch.roles.evaluator.replicas=0",
        "launch.roles.vllm_eval.replicas=0",
        *PINNED,
        *extra,
    ]


def launch(root: Path, strategy: str, steps: int, extra: list[str], config: str = "configs/demo.toml") -> Path:
    """One real run of `config` with `strategy`; its run dir."""
    exp = f"sv-{strategy.replace('_', '-')}"
    sets = [f"run.root={root / 'runs'}", f"flow.strategy={strategy}", *overrides(steps, extra)]
    cmd = [sys.executable, "-m", "common.runs.cli", "launch", config]
    for s in sets:
        cmd += ["--set", s]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": exp}
    with (root / f"{exp}.log").open("wb") as out:
        code = subprocess.run(
            cmd,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            timeout=1800,
            preexec_fn=lambda: os.sched_setaffinity(0, LAUNCHER_CPUS),
        ).returncode
    if code != 0:
        raise SystemExit(f"{exp}: launch exited {code}; its console is {root / f'{exp}.log'}")
    return root / "runs" / exp


def simulate(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "common.runs.cli", "simulate", *args], cwd=REPO, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"slipstream simulate {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
    return done.stdout


def write_fixture(out: Path, runs: dict[str, Path], shared: list[str], command: str) -> None:
    """The calibration and each run's measured figures and completion lengths, for tests/unit/test_sim_real.py."""
    from collections import Counter

    from common.config import load_config
    from rollout.flow.sim.calibrate import MODEL_FILE, load_model, read_run
    from rollout.flow.sim.cli import run_workload
    from rollout.flow.sim.compare import judged, measured_result

    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(runs["on_policy"] / MODEL_FILE, out / MODEL_FILE)
    model = load_model(out / MODEL_FILE)
    data: dict = {"made_by": command, "config": "configs/demo.toml", "overrides": shared, "runs": {}}
    for strategy, run_dir in runs.items():
        run, cfg = read_run(run_dir), load_config(run_dir / "config.toml")
        workload = run_workload(run, cfg)
        data["runs"][strategy] = {
            "prompt_tokens": workload["prompt_tokens"],
            "lengths": {str(n): k for n, k in sorted(Counter(workload["lengths"]).items())},
            "measured": judged(measured_result(run, cfg.flow, model.throughput)),
        }
    (out / "runs.json").write_text(json.dumps(data, indent=1) + "\n")
    print(f"fixture written to {out}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/demo.toml", help="the config every run launches")
    ap.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        help="the runs, comma-separated, the first the calibration run (on_policy, fully_async, one_step_off)",
    )
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--keep", action="store_true", help="keep the run dirs (printed)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of every run")
    ap.add_argument(
        "--fixture", type=Path, help="write the calibration and measured figures here (tests/support/fixtures/…)"
    )
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ss-sv-"))
    try:
        strategies = args.strategies.split(",")
        unknown = sorted(set(strategies) - set(STRATEGIES))
        if unknown or not strategies:
            raise SystemExit(f"--strategies {args.strategies!r}: choose from {', '.join(STRATEGIES)}")
        if args.fixture and (args.config != "configs/demo.toml" or strategies != list(STRATEGIES)):
            raise SystemExit(
                "--fixture records the demo's three runs: leave --config and --strategies at their defaults"
            )
        runs = {s: launch(root, s, args.steps, args.set, args.config) for s in strategies}
        base = strategies[0]
        model = runs[base] / "sim_model.json"
        print(f"## {args.config}: calibration on the {base} run ({args.steps} steps)\n")
        print(simulate("--calibrate", str(runs[base])))
        for strategy in strategies:
            print(f"## {strategy}: predicted from the {base} model against measured\n")
            print(simulate("--compare", str(runs[strategy]), "--model", str(model)))
        if args.fixture:
            command = f"python bench/sim_validate.py {' '.join(sys.argv[1:])} ({time.strftime('%Y-%m-%d')})"
            write_fixture(args.fixture, runs, overrides(args.steps, args.set), command)
    finally:
        if args.keep:
            print(f"run dirs under {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
