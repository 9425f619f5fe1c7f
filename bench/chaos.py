"""Chaos benchmark: the demo (shortened) run N times, each time with a fault injected after RL has started,
against `--base-runs` runs of the same seed without a fault (3 by default: a run's held-out score varies by
several points from one run to the next without any fault, so one no-fault run is too noisy a baseline).

Fault kinds (`--kinds`; trials cycle over the (kind, role) pairs of PLAN, so 20 trials cover each twice):
- `kill`: one role (trainer, router, vllm: the rollout worker role, evaluator, redis) SIGKILLed at a random
  moment; the launcher (or, for redis-server, the rendezvous leader) starts it again.
- `kill_save`: the trainer SIGKILLed in the middle of a checkpoint save (every data file written, `.metadata`
  not), through the fault point SLIPSTREAM_FAULT=checkpoint_save:ARM (common/fault.py; a save of the demo's
  6 MB takes milliseconds, too fast to catch from outside). Checked: the half-written checkpoint is never
  taken: the restarted trainer resumes from an older, complete one.
- `kill_publish`: the trainer SIGKILLed in the middle of a weight publish (its first shard in place, the rest
  not; every trial runs with 1 MB shards so the 2 MB demo model has several), by SLIPSTREAM_FAULT=publish:ARM.
  Checked: that version never becomes current and no worker reports serving it.
- `enospc`: the run dir is a tmpfs of TMPFS_MB, filled by a file mid-run. Checked: the launcher exits non-zero
  with a line naming the full disk and no traceback; after the filler is removed `slipstream launch --resume`
  completes the run (the trial's other figures are the resumed run's).
- `double`: the trainer SIGKILLed, then redis-server once the restarted trainer trained a step.
- `stop`: the rollout worker's vLLM server (the child of the vllm role) SIGSTOPped for STOP_S, then SIGCONTed.
  The demo has one rollout worker: generation stalls while it is stopped. Checked: the router evicts it
  (its health checks time out) and admits it again after SIGCONT.

Per trial it records the kind, the role and after which step; whether the run completed (launcher exit 0);
`back_s`, seconds from the (last) fault until the role runs again (a new pid; for redis-server the leader's
restart line; for `stop` the router's admission; for `enospc` the resumed launch's first step); `next_step_s`,
seconds from the fault until the trainer logs its next step; prompts lost (admitted but neither trained nor left
in the saved flow state) and prompts trained twice (from the ledger, trained_prompts.jsonl); the held-out
accuracy (evaluator lines) of the last version and the mean over the last LAST versions (one version's score
on the held-out problems moves by 4-6 points between neighbours, tests/e2e/test_rl_e2e.py), against the
no-fault runs' mean; the processes of the run still alive 10 s after the launcher exited (every process carries
SLIPSTREAM_EXP); and `check`, the kind's own verdict (what the checked sentence above found).

    .venv/bin/python bench/chaos.py --trials 20 --steps 9 --seed 0

Runs are serial (this machine has 2 cores); each takes 2-5 minutes; `enospc` needs root (mount). Left out:
faults of the eval-pool vLLM worker (the same code as the rollout worker's restart) and faults during the
warm start (no RL yet).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from common.proc import experiment_processes

REPO = Path(__file__).resolve().parent.parent
ROLES = ("trainer", "router", "vllm", "evaluator", "redis")
KINDS = ("kill", "kill_save", "kill_publish", "enospc", "double", "stop")
# One cycle: every role and every kind once, the kinds that stress the trainer spread between the others.
PLAN: tuple[tuple[str, str], ...] = (
    ("kill", "trainer"),
    ("kill_save", "trainer"),
    ("kill", "router"),
    ("stop", "vllm"),
    ("kill", "vllm"),
    ("kill_publish", "trainer"),
    ("kill", "evaluator"),
    ("enospc", "disk"),
    ("kill", "redis"),
    ("double", "trainer+redis"),
)
STEP_LINE = re.compile(r"\| step (\d+): reward")
HELDOUT = re.compile(r"version (\d+) arithmetic: accuracy/mean = ([0-9.]+)")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
LAST = 3
STOP_S = 15.0
TMPFS_MB = 600
DISK_FULL = re.compile(r"the disk of the run dir \S+ is full")


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
    kind: str = "kill"
    check: str = ""
    """What the kind's own check found (empty for a plain kill)."""
    check_ok: bool = True
    notes: list[str] = field(default_factory=list)


class Run:
    """One `slipstream launch configs/demo.toml` with the chaos overrides (or `--resume` of its run dir), its log
    in a file."""

    def __init__(
        self,
        root: Path,
        exp: str,
        steps: int,
        seed: int,
        extra: Sequence[str] = (),
        env: dict[str, str] | None = None,
        resume: bool = False,
        log_name: str = "",
    ) -> None:
        """`extra`: more --set overrides (after this benchmark's own); `env`: more environment for every role."""
        self.exp, self.run_dir, self.log_path = exp, root / "runs" / exp, root / (log_name or f"{exp}.log")
        sets = [
            f"run.root={root / 'runs'}",
            f"run.seed={seed}",
            f"trainer.steps={steps}",
            "trainer.checkpoint.interval_steps=3",
            "rendezvous.heartbeat_period_s=0.5",
            "rendezvous.heartbeat_ttl_s=2.0",
            "trainer.final_eval_wait_s=300",
            "rollout.weight_shard_mb=1",
            *extra,
        ]
        # --verbose: the figures below are read from every role's lines in one file.
        cmd = [sys.executable, "-m", "common.runs.cli", "launch", "--verbose"]
        if resume:
            cmd += ["--resume", str(self.run_dir)]
        else:
            cmd += ["configs/demo.toml"]
            for s in sets:
                cmd += ["--set", s]
        base = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM")}
        full_env = base | {"SLIPSTREAM_EXP": exp} | (env or {})
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=full_env, stdout=self.log_path.open("wb"), stderr=subprocess.STDOUT
        )

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

    def end(self, timeout_s: float = 1800) -> int | None:
        """Wait for the launcher; interrupt it (and wait) if it outlives `timeout_s`."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=120)
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


class Clocks:
    """Seconds from a fault until patterns appear in the run's log after it (the role back, the next step)."""

    def __init__(self, run: Run, patterns: dict[str, str]) -> None:
        self.run, self.offset, self.t0 = run, len(run.log()), time.monotonic()
        self.pending, self.took = dict(patterns), dict.fromkeys(patterns, None)

    def wait(self, timeout_s: float = 900) -> None:
        while self.pending and time.monotonic() - self.t0 < timeout_s and self.run.proc.poll() is None:
            text = self.run.log()[self.offset :]
            for what, pattern in list(self.pending.items()):
                if re.search(pattern, text):
                    self.took[what] = time.monotonic() - self.t0
                    del self.pending[what]
            time.sleep(0.1)


def kill_role(run: Run, role: str) -> Clocks:
    pid = victim_pid(run, role)
    clocks = Clocks(run, {"back": back_pattern(role, pid), "step": STEP_LINE.pattern})
    os.kill(pid, signal.SIGKILL)
    clocks.wait()
    return clocks


def wait_step(run: Run, step: int, what: str) -> None:
    if run.wait_for(rf"\| step {step}: reward", 1200) is None:
        raise RuntimeError(f"{run.exp}: never reached step {step} ({what}):\n{run.log()[-3000:]}")


def armed_kill(run: Run, arm: Path, point: str) -> tuple[Clocks, list[str]]:
    """Arm the trainer's fault point; wait until it fired (the arming file gone); the unfinished directories
    it left (checkpoint `.partial` or version `.tmp`) seen at that moment."""
    pid = victim_pid(run, "trainer")
    arm.touch()
    deadline = time.monotonic() + 600
    while arm.exists():
        if time.monotonic() > deadline or run.proc.poll() is not None:
            raise RuntimeError(f"{run.exp}: the {point} fault point never fired:\n{run.log()[-3000:]}")
        time.sleep(0.02)
    clocks = Clocks(run, {"back": back_pattern("trainer", pid), "step": STEP_LINE.pattern})
    where = run.run_dir / ("checkpoints" if point == "checkpoint_save" else "weights")
    left = sorted(p.name for p in where.glob(".step_*.partial" if point == "checkpoint_save" else ".v*.tmp"))
    clocks.wait()
    return clocks, left


def check_kill_save(run: Run, left: list[str]) -> tuple[str, bool]:
    """The restarted trainer resumed from a complete checkpoint older than the one whose save was killed."""
    if len(left) != 1:
        return f"unfinished checkpoint dirs at the kill: {left}", False
    killed = int(re.findall(r"\d+", left[0])[0])
    resumed = [(Path(p).name, int(s)) for p, s in RESUMED.findall(run.log())]
    if not resumed:
        return f"killed saving step {killed}; the restarted trainer logged no resume", False
    name, step = resumed[-1]
    ok = step < killed and name == f"step_{step:08d}"
    return f"killed saving step {killed}; resumed from {name}", ok


def check_kill_publish(run: Run, left: list[str]) -> tuple[str, bool]:
    """The version whose publish was killed never became anyone's: not current, not a worker's, not evaluated."""
    if len(left) != 1:
        return f"unfinished version dirs at the kill: {left}", False
    version = int(re.findall(r"\d+", left[0])[0])
    log = run.log()
    evaluated = {int(v) for v, _ in HELDOUT.findall(log)}
    committed = (run.run_dir / "weights" / f"v{version}").exists()
    served = re.search(rf"(serving|loaded|now at|updated to) (weight )?version {version}\b", log)
    ok = version not in evaluated and not committed and served is None
    what = f"killed publishing v{version}; committed {committed}, evaluated {version in evaluated}"
    return what + (f", served: {served.group(0)!r}" if served else ""), ok


def router_lines(log: str, what: str) -> list[int]:
    return [m.start() for m in re.finditer(rf"worker \S+ at \S+ {what}", log)]


def stop_worker(run: Run) -> tuple[Clocks, str, bool]:
    """SIGSTOP the rollout worker's vLLM server for STOP_S, then SIGCONT; the router must evict and readmit it."""
    role = psutil.Process(victim_pid(run, "vllm"))
    server = role.children()[0]
    offset = len(run.log())
    clocks = Clocks(run, {"step": STEP_LINE.pattern})
    server.send_signal(signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        server.send_signal(signal.SIGCONT)
    t_cont = time.monotonic()
    admitted = run.wait_for(r"worker \S+ at \S+ admitted", 120, offset)
    clocks.took["back"] = None if admitted is None else time.monotonic() - clocks.t0
    clocks.wait()
    log = run.log()
    evicted = [p for p in router_lines(log, "evicted") if p >= offset]
    readmitted = [p for p in router_lines(log, "admitted") if evicted and p > evicted[0]]
    ok = bool(evicted and readmitted)
    return (
        clocks,
        f"vLLM pid {server.pid} stopped {STOP_S:.0f}s: evicted {len(evicted)}x, readmitted {len(readmitted)}x ({time.monotonic() - t_cont:.0f}s after SIGCONT)",
        ok,
    )


def mount_tmpfs(path: Path, mb: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", str(path)], check=True)


def unmount(path: Path) -> None:
    for _ in range(20):
        if subprocess.run(["umount", str(path)], capture_output=True).returncode == 0:
            return
        time.sleep(0.5)
    subprocess.run(["umount", "-l", str(path)], check=False)


def fill(path: Path) -> Path:
    """Fill the file system of `path` with one file, to the last byte."""
    filler = path / "filler"
    with open(filler, "wb", buffering=0) as fh:
        chunk = b"\0" * (1 << 20)
        with contextlib.suppress(OSError):
            while True:
                fh.write(chunk)
        with contextlib.suppress(OSError):
            while True:
                fh.write(b"\0" * 4096)
    return filler


def check_enospc(log: str) -> tuple[str, bool]:
    """The failed launch named the full disk and printed no traceback."""
    named = DISK_FULL.findall(log)
    tracebacks = log.count("Traceback (most recent call last)")
    first = next((line for line in log.splitlines() if DISK_FULL.search(line)), "")
    return f"disk-full lines {len(named)}, tracebacks {tracebacks}; first: {first.strip()[:160]!r}", bool(
        named
    ) and tracebacks == 0


def run_trial(
    root: Path, exp: str, kind: str, role: str, steps: int, seed: int, rng: random.Random, sets: Sequence[str] = ()
) -> Trial:
    """One run of the demo with the fault `kind` ("none": a no-fault run); `sets`: --set overrides of every run."""
    arm = root / f"{exp}.arm"
    point = {"kill_save": "checkpoint_save", "kill_publish": "publish"}.get(kind, "")
    env = {"SLIPSTREAM_FAULT": f"{point}:{arm}"} if point else {}
    killed_after = None
    clocks: Clocks | None = None
    check, check_ok, notes = "", True, []
    mounted = False
    run_dir = root / "runs" / exp
    if kind == "enospc":
        mount_tmpfs(run_dir, TMPFS_MB)
        mounted = True
    t0 = time.monotonic()
    run = Run(root, exp, steps, seed, extra=sets, env=env)
    code: int | None = None
    try:
        if kind != "none":
            killed_after = rng.randint(2, steps - 4)
            wait_step(run, killed_after, kind)
            time.sleep(rng.uniform(0.0, 3.0))
            if kind == "kill":
                clocks = kill_role(run, role)
            elif kind in ("kill_save", "kill_publish"):
                clocks, left = armed_kill(run, arm, point)
                check, check_ok = (check_kill_save if kind == "kill_save" else check_kill_publish)(run, left)
            elif kind == "double":
                kill_role(run, "trainer")
                time.sleep(rng.uniform(0.0, 3.0))
                clocks = kill_role(run, "redis")
            elif kind == "stop":
                clocks, check, check_ok = stop_worker(run)
            elif kind == "enospc":
                filler = fill(run_dir)
                t_fill = time.monotonic()
                code = run.end(900)
                failed_log = run.log()
                check, check_ok = check_enospc(failed_log[failed_log.find("| step") :])
                check = f"first launch exit {code}; " + check
                check_ok = check_ok and code not in (0, None)
                filler.unlink()
                run = Run(root, exp, steps, seed, resume=True, log_name=f"{exp}.resume.log")
                clocks = Clocks(run, {"back": STEP_LINE.pattern, "step": STEP_LINE.pattern})
                clocks.t0 = t_fill
                clocks.wait()
            else:
                raise ValueError(f"unknown fault kind {kind!r}; pick from {KINDS}")
        code = run.end()
    finally:
        if run.proc.poll() is None:
            run.proc.send_signal(signal.SIGINT)
            run.proc.wait(timeout=120)
        wall = time.monotonic() - t0
        time.sleep(10)
        leftover = experiment_processes(exp)
        for p in leftover:
            with contextlib.suppress(psutil.Error):
                p.kill()
        lost, twice = ledger_figures(run_dir)
        final, final_score, last_mean = heldout_figures(run.log())
        if mounted:
            keep = root / "runs" / f"{exp}.kept"
            with contextlib.suppress(OSError):
                shutil.copytree(run_dir, keep, ignore=shutil.ignore_patterns("cache", "weights", "checkpoints"))
            unmount(run_dir)
    back = None if clocks is None else clocks.took.get("back")
    next_step = None if clocks is None else clocks.took.get("step")
    return Trial(
        role if kind != "none" else "none",
        killed_after,
        code == 0,
        code,
        back,
        next_step,
        lost,
        twice,
        final,
        final_score,
        last_mean,
        len(leftover),
        wall,
        kind,
        check,
        check_ok,
        notes,
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


def mean_sd(values: Sequence[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (0 for one value)."""
    mean = sum(values) / len(values)
    var = sum((v - mean) ** 2 for v in values) / (len(values) - 1) if len(values) > 1 else 0.0
    return mean, var**0.5


def report(trials: list[Trial]) -> str:
    """The table of the trials (the no-fault runs, kind `none`, first), the kinds' checks and the summary: the
    faulted runs' held-out scores against the mean of the no-fault runs, next to the no-fault runs' own spread
    (each against the mean of the others), which is the noise floor of the comparison."""
    bases = [t for t in trials if t.kind == "none" and t.last_mean is not None]
    base = mean_sd([t.final_heldout for t in bases if t.final_heldout is not None])[0] if bases else None
    base_mean = mean_sd([t.last_mean for t in bases])[0] if bases else None
    lines = [
        f"{'kind':<12} {'role':<13} {'after':>5} {'done':>4} {'back_s':>7} {'step_s':>7} {'lost':>4} {'twice':>5} "
        f"{'version':>7} {'held-out':>8} {'vs base':>7} {f'last {LAST}':>7} {'vs base':>7} {'left':>4} {'wall_s':>6} "
        f"{'check':>5}"
    ]
    for t in trials:
        lines.append(
            f"{t.kind:<12} {t.role:<13} {fmt(t.killed_after_step):>5} {'y' if t.completed else 'n':>4} "
            f"{fmt(t.back_s, '.1f'):>7} {fmt(t.next_step_s, '.1f'):>7} {fmt(t.prompts_lost):>4} "
            f"{fmt(t.trained_twice):>5} {fmt(t.final_version):>7} {fmt(t.final_heldout, '.3f'):>8} "
            f"{fmt(delta(t.final_heldout, base), '+.1f'):>7} {fmt(t.last_mean, '.3f'):>7} "
            f"{fmt(delta(t.last_mean, base_mean), '+.1f'):>7} {t.leftover:>4} {t.wall_s:>6.0f} "
            f"{('-' if not t.check else 'ok' if t.check_ok else 'FAIL'):>5}"
        )
    checks = [f"{i:>2} {t.kind}: {t.check}" for i, t in enumerate(trials) if t.check]
    if checks:
        lines += ["", "checks:", *checks]
    faults = [t for t in trials if t.kind != "none"]
    ok = [t for t in faults if t.completed]

    def within(value: float | None, ref: float | None) -> bool:
        return value is not None and ref is not None and abs(value - ref) <= 0.05 + 1e-9

    not_below = (
        None
        if base_mean is None
        else sum(t.last_mean is not None and t.last_mean >= base_mean - 0.05 - 1e-9 for t in ok)
    )
    lines.append(
        f"\ncompleted {len(ok)}/{len(faults)}; checks passed {sum(t.check_ok for t in faults)}/{len(faults)}; "
        f"prompts lost {sum(t.prompts_lost or 0 for t in faults)}; trained twice "
        f"{sum(t.trained_twice or 0 for t in faults)}; leftover processes {sum(t.leftover for t in trials)}; held-out "
        f"within 5 points of the no-fault runs' mean: last version {sum(within(t.final_heldout, base) for t in ok)}/"
        f"{len(faults)}, mean of the last {LAST} {sum(within(t.last_mean, base_mean) for t in ok)}/{len(faults)}, "
        f"not more than 5 points below it {fmt(not_below)}/{len(faults)}"
    )
    scored = [t.last_mean for t in ok if t.last_mean is not None]
    if len(bases) > 1 and scored:
        # Each no-fault run against the mean of the other no-fault runs: how often the same test fails without a fault.
        alone = [within(t.last_mean, mean_sd([o.last_mean for o in bases if o is not t])[0]) for t in bases]
        (bm, bsd), (fm, fsd) = mean_sd([t.last_mean for t in bases]), mean_sd(scored)
        half = 1.96 * (bsd**2 / len(bases) + fsd**2 / len(scored)) ** 0.5
        lines.append(
            f"mean of the last {LAST}: no-fault {bm:.3f} +- {bsd:.3f} (n={len(bases)}, each within 5 points of the "
            f"others' mean: {sum(alone)}/{len(bases)}), faulted {fm:.3f} +- {fsd:.3f} (n={len(scored)}); faulted minus "
            f"no-fault {100 * (fm - bm):+.1f} points, 95% interval [{100 * (fm - bm - half):+.1f}, {100 * (fm - bm + half):+.1f}]"
        )
    kinds = sorted({t.kind for t in faults})
    for k in kinds:
        of = [t for t in faults if t.kind == k]
        lines.append(
            f"  {k}: {len(of)} trials, completed {sum(t.completed for t in of)}, checks {sum(t.check_ok for t in of)}, "
            f"last-{LAST} mean within 5 points {sum(within(t.last_mean, base_mean) for t in of if t.completed)}"
        )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--steps", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated fault kinds of {', '.join(KINDS)}")
    ap.add_argument(
        "--base-runs",
        type=int,
        default=3,
        help="no-fault runs first, the baseline of the held-out comparison (0: none, a pilot of some kinds)",
    )
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override of every run (repeatable)"
    )
    ap.add_argument("--root", default="", help="where runs go (default: a fresh short temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--out", default="", help="also write the trials as JSON lines here")
    ap.add_argument("--report", default="", help="print the table of trials recorded by --out (no runs)")
    args = ap.parse_args()
    if args.report:
        trials = [Trial(**json.loads(line)) for line in Path(args.report).read_text().splitlines()]
        print(report(trials))
        return 0
    if args.base_runs < 0:
        ap.error(f"--base-runs {args.base_runs}: 0 or more")
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if unknown := sorted(set(kinds) - set(KINDS)):
        ap.error(f"--kinds: unknown {unknown}; pick from {', '.join(KINDS)}")
    if args.steps < 7:
        ap.error(f"--steps {args.steps}: at least 7 (a fault after step 2..steps-4, checkpoints every 3 steps)")
    pairs = [p for p in PLAN if p[0] in kinds]
    # vLLM's IPC socket paths under the run dir must stay short (docs/vllm-cpu.md): a short root.
    root = Path(args.root or tempfile.mkdtemp(prefix="ss-chaos-"))
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    plan = [("none", "none")] * args.base_runs + [pairs[i % len(pairs)] for i in range(args.trials)]
    trials: list[Trial] = []
    for i, (kind, role) in enumerate(plan):
        trial = run_trial(root, f"chaos{i}-{kind}", kind, role, args.steps, args.seed, rng, args.set)
        trials.append(trial)
        print(json.dumps(asdict(trial)), flush=True)
        if args.out:
            with open(args.out, "a") as fh:
                fh.write(json.dumps(asdict(trial)) + "\n")
    print()
    print(report(trials))
    if not args.keep and not args.root:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if all(t.completed and t.check_ok for t in trials) else 1


if __name__ == "__main__":
    sys.exit(main())
