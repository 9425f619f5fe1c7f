"""Chaos benchmark: the demo (shortened) run N times, each time with one role SIGKILLed at a random moment
after RL has started, against one run of the same seed without a fault.

Per trial it records: the role killed and after which step; whether the run completed (launcher exit 0);
`back_s`, seconds from the kill until the launcher reports the role running again (a new pid; for
redis-server the leader's restart line); `next_step_s`, seconds from the kill until the trainer logs its
next step; prompts lost (admitted but neither trained nor left in the saved flow state) and prompts trained
twice (from the ledger, trained_prompts.jsonl); the held-out accuracy (evaluator lines) of the last version
and the mean over the last LAST versions (one version's score on the 200 held-out problems moves by 4-6
points between neighbours, tests/e2e/test_rl_e2e.py), against the no-fault run's; and the processes of the
run still alive 10 s after the launcher exited
(every process carries SLIPSTREAM_EXP). Roles cycle through trainer, router, vllm (the rollout worker),
evaluator and redis, so 10 trials cover each twice.

    .venv/bin/python bench/chaos.py --trials 10 --steps 12 --seed 0

Runs are serial (this machine has 2 cores); each takes 3-5 minutes. Left out: faults of the eval-pool vLLM
worker (the same code as the rollout worker's restart) and faults during the warm start (no RL yet).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

from common.proc import experiment_processes

REPO = Path(__file__).resolve().parent.parent
ROLES = ("trainer", "router", "vllm", "evaluator", "redis")
STEP_LINE = re.compile(r"\| step (\d+): reward")
HELDOUT = re.compile(r"version (\d+) arithmetic: accuracy/mean = ([0-9.]+)")
LAST = 3


@dataclass
class Trial:
    role: str
    killed_after_step: int | None
    completed: bool
    exit_code: int | None
    back_s: float | None
    next_step_s: float | None
    prompts_lost: int | None
    trained_twice: int | None
    final_version: int | None
    final_heldout: float | None
    last_mean: float | None
    """Mean held-out accuracy of the last LAST evaluated versions."""
    leftover: int
    wall_s: float


class Run:
    """One `slipstream launch configs/demo.toml` with the chaos overrides, its log in a file."""

    def __init__(self, root: Path, exp: str, steps: int, seed: int, extra: Sequence[str] = ()) -> None:
        """`extra`: more --set overrides (after this benchmark's own)."""
        self.exp, self.run_dir, self.log_path = exp, root / "runs" / exp, root / f"{exp}.log"
        sets = [
            f"run.root={root / 'runs'}",
            f"run.seed={seed}",
            f"trainer.steps={steps}",
            "trainer.checkpoint.interval_steps=3",
            "rendezvous.heartbeat_period_s=0.5",
            "rendezvous.heartbeat_ttl_s=2.0",
            "trainer.final_eval_wait_s=300",
            *extra,
        ]
        # --verbose: the figures below are read from every role's lines in one file.
        cmd = [sys.executable, "-m", "common.runs.cli", "launch", "--verbose", "configs/demo.toml"]
        for s in sets:
            cmd += ["--set", s]
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")} | {"SLIPSTREAM_EXP": exp}
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, pattern: str | re.Pattern[str], timeout_s: float, start: int = 0) -> re.Match[str] | None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.compile(pattern).search(self.log(), start)
            if found or self.proc.poll() is not None:
                return found
            time.sleep(0.1)
        return None


def victim_pid(run: Run, role: str) -> int:
    if role == "redis":
        return int(json.loads((run.run_dir / "meet" / "redis.json").read_text())["pid"])
    starts = re.findall(rf"started {role}/0 \(role \w+, pid (\d+)\)", run.log())
    return int(starts[-1])


def back_pattern(role: str, pid: int) -> str:
    if role == "redis":
        return rf"redis-server pid {pid} died \(exit code -9\): started it again"
    return rf"started {role}/0 \(role \w+, pid (?!{pid}\b)\d+\)"


def ledger_figures(run_dir: Path) -> tuple[int | None, int | None]:
    """(prompts lost, prompts trained twice) from the ledger and the flow summary; None if missing."""
    ledger, summary = run_dir / "trained_prompts.jsonl", run_dir / "flow_summary.json"
    if not ledger.exists() or not summary.exists():
        return None, None
    trained = [p for line in ledger.read_text().splitlines() for p in json.loads(line)["prompt_ids"]]
    s = json.loads(summary.read_text())
    # Filtered by dynamic sampling (never trained, listed) counts as accounted for, like untrained prompts.
    accounted = set(trained) | set(s["untrained_prompts"]) | set(s.get("filtered_prompts", []))
    lost = s["admitted_prompts"] - len(accounted) - s["counters"]["dropped_prompts"]
    return lost, len(trained) - len(set(trained))


def run_trial(root: Path, exp: str, role: str | None, steps: int, seed: int, rng: random.Random) -> Trial:
    run = Run(root, exp, steps, seed)
    killed_after = back_s = next_step_s = None
    try:
        if role is not None:
            killed_after = rng.randint(2, steps - 4)
            seen = run.wait_for(rf"\| step {killed_after}: reward", 1200)
            if seen is None:
                raise RuntimeError(f"{exp}: never reached step {killed_after}:\n{run.log()[-3000:]}")
            time.sleep(rng.uniform(0.0, 3.0))
            pid = victim_pid(run, role)
            offset = len(run.log())
            os.kill(pid, signal.SIGKILL)
            t_kill = time.monotonic()
            # Both clocks run from the kill: the role back, and the trainer's next step.
            pending = {"back": back_pattern(role, pid), "step": STEP_LINE.pattern}
            while pending and time.monotonic() - t_kill < 900 and run.proc.poll() is None:
                text = run.log()
                for what, pattern in list(pending.items()):
                    if re.search(pattern, text[offset:]):
                        took = time.monotonic() - t_kill
                        back_s, next_step_s = (took, next_step_s) if what == "back" else (back_s, took)
                        del pending[what]
                time.sleep(0.1)
        code = run.proc.wait(timeout=1800)
    finally:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGINT)
            run.proc.wait(timeout=120)
    wall = time.monotonic() - run.t0
    time.sleep(10)
    leftover = experiment_processes(exp)
    for p in leftover:
        with contextlib.suppress(psutil.Error):
            p.kill()
    lost, twice = ledger_figures(run.run_dir)
    final, final_score, last_mean = heldout_figures(run.log())
    return Trial(
        role or "none",
        killed_after,
        code == 0,
        code,
        back_s,
        next_step_s,
        lost,
        twice,
        final,
        final_score,
        last_mean,
        len(leftover),
        wall,
    )


def heldout_figures(log: str) -> tuple[int | None, float | None, float | None]:
    """(last evaluated version, its score, mean score of the last LAST evaluated versions) from a run's log."""
    scores = {int(v): float(a) for v, a in HELDOUT.findall(log)}
    if not scores:
        return None, None, None
    tail = sorted(scores)[-LAST:]
    return tail[-1], scores[tail[-1]], sum(scores[v] for v in tail) / len(tail)


def fmt(v: object, spec: str = "") -> str:
    return "-" if v is None else format(v, spec)


def delta(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None else 100 * (value - base)


def report(trials: list[Trial]) -> str:
    """The table of the trials (the first is the no-fault run) and the summary line."""
    base, base_mean = trials[0].final_heldout, trials[0].last_mean
    lines = [
        f"{'role':<10} {'after':>5} {'done':>4} {'back_s':>7} {'step_s':>7} {'lost':>4} {'twice':>5} {'version':>7} "
        f"{'held-out':>8} {'vs base':>7} {f'last {LAST}':>7} {'vs base':>7} {'left':>4} {'wall_s':>6}"
    ]
    for t in trials:
        lines.append(
            f"{t.role:<10} {fmt(t.killed_after_step):>5} {'y' if t.completed else 'n':>4} {fmt(t.back_s, '.1f'):>7} "
            f"{fmt(t.next_step_s, '.1f'):>7} {fmt(t.prompts_lost):>4} {fmt(t.trained_twice):>5} {fmt(t.final_version):>7} "
            f"{fmt(t.final_heldout, '.3f'):>8} {fmt(delta(t.final_heldout, base), '+.1f'):>7} "
            f"{fmt(t.last_mean, '.3f'):>7} {fmt(delta(t.last_mean, base_mean), '+.1f'):>7} {t.leftover:>4} {t.wall_s:>6.0f}"
        )
    faults = trials[1:]
    ok = [t for t in faults if t.completed]

    def within(value: float | None, ref: float | None) -> bool:
        return value is not None and ref is not None and abs(value - ref) <= 0.05 + 1e-9

    lines.append(
        f"\ncompleted {len(ok)}/{len(faults)}; prompts lost {sum(t.prompts_lost or 0 for t in faults)}; trained twice "
        f"{sum(t.trained_twice or 0 for t in faults)}; leftover processes {sum(t.leftover for t in trials)}; held-out "
        f"within 5 points of the no-fault run: last version {sum(within(t.final_heldout, base) for t in ok)}/"
        f"{len(faults)}, mean of the last {LAST} {sum(within(t.last_mean, base_mean) for t in ok)}/{len(faults)}"
    )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=10)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--root", default="", help="where runs go (default: a fresh short temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--out", default="", help="also write the trials as JSON lines here")
    ap.add_argument(
        "--report",
        default="",
        help="print the table of trials recorded by --out (no runs); held-out "
        "figures missing there are read from the run logs under --root",
    )
    args = ap.parse_args()
    if args.report:
        trials = []
        for i, line in enumerate(Path(args.report).read_text().splitlines()):
            fields = json.loads(line)
            if "last_mean" not in fields:
                log = Path(args.root) / f"chaos{i}-{fields['role']}.log"
                _, _, fields["last_mean"] = heldout_figures(log.read_text(errors="replace"))
            trials.append(Trial(**fields))
        print(report(trials))
        return 0
    # vLLM's IPC socket paths under the run dir must stay short (docs/vllm-cpu.md): a short root.
    root = Path(args.root or tempfile.mkdtemp(prefix="ss-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    plan: list[str | None] = [None] + [ROLES[i % len(ROLES)] for i in range(args.trials)]
    trials: list[Trial] = []
    for i, role in enumerate(plan):
        trial = run_trial(root, f"chaos{i}-{role or 'none'}", role, args.steps, args.seed, rng)
        trials.append(trial)
        print(json.dumps(asdict(trial)), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(asdict(trial)) + "\n")
    print()
    print(report(trials))
    if not args.keep and not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(t.completed for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
