"""Starting a run on this machine: the local launcher (`slipstream launch`).

The launcher prepares the run (common/runs/prepare.py: ids, directories, the resolved config in the run
dir, each replica's command and environment), records it in the registry, becomes the rendezvous leader
(so Redis outlives any role restart), and starts every replica of every `launch.roles` entry as a child
process (trainer replicas are its ranks). Each replica's output goes to <run dir>/logs/<entry>-<i>.log; the console (common/runs/console.py)
shows the launcher's own lines, the roles' warnings and errors and one progress line, or with `verbose`
every child line prefixed with `entry/replica`. A replica that fails is restarted when its entry says so
(by default the router, vLLM workers and the evaluator, which rejoin the experiment by themselves), after
a doubling backoff and up to max_restarts. The run ends when every critical entry exited 0, or at the
first failure not restarted (whose exit code the launcher returns), or on SIGINT/SIGTERM; in every case
the whole process tree is torn down: SIGTERM to each child's process group and every descendant, then
SIGKILL after the grace period. Children also get SIGTERM from the kernel if the launcher itself is
killed. The same processes for several machines are written by common/runs/scripts.py.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO

from common import log as logsetup
from common.config import to_toml
from common.proc import bind_to_cpus, die_with_parent, stop_process_trees
from common.rendezvous import Rendezvous
from common.roles import REPORT_FILE
from common.run_secrets import ensure_secrets
from common.runs.console import LOGS, Console, ConsoleHandler, ProgressLine, Shown, elapsed, log_path
from common.runs.dash.server import DashServer
from common.runs.dash.sources import read_live
from common.runs.prepare import LaunchError, Prepared, Replica, command_of, cpus_of, env_of, prepare, replicas_of
from common.runs.registry import Registry

log = logging.getLogger(__name__)

# What of a failed replica's log the console shows when nothing of its last life reached it.
TAIL_LINES = 12
TAIL_BYTES = 16384

# Put into the exit queue by a restart timer: start that replica again.
RESTART = -(10**6)
# The run dir's file system is full (its free bytes under MIN_FREE_BYTES, or a log write failed with ENOSPC):
# the launcher stops the run with one error line and returns this code (errno ENOSPC's number).
DISK_FULL = errno.ENOSPC
MIN_FREE_BYTES = 4 << 20
DISK_POLL_S = 1.0


def restarts_on_failure(rep: Replica) -> bool:
    """Whether a replica that failed is restarted: its restart setting; `auto` restarts every role started
    by `slipstream run` (not an entry with a command of its own, whose behaviour the launcher cannot know)."""
    if rep.spec.restart == "auto":
        return not rep.spec.command
    return rep.spec.restart == "on-failure"


def restarts_together(rep: Replica) -> bool:
    """Trainer ranks form one process group: when one fails, all of them restart (and resume) together."""
    return rep.role == "trainer" and rep.spec.replicas > 1


class Launcher:
    """Runs the replicas of a prepared run as children and tears them all down at the end."""

    def __init__(self, prep: Prepared, console: Console, verbose: bool = False) -> None:
        self.prep = prep
        self.replicas = replicas_of(prep.cfg)
        self.console = console
        self.verbose = verbose
        self._exits: queue.Queue[tuple[Replica | None, int]] = queue.Queue()
        self._signal: int | None = None
        self._stopped: set[str] = set()  # replicas this launcher stopped for a restart: their exit is no failure
        self._shown: dict[str, Shown] = {}  # per replica: what its current life put on the console
        self._full = threading.Event()  # the run dir's disk is full: role output goes nowhere from then on
        self._done = threading.Event()

    def log_of(self, rep: Replica) -> Path:
        return log_path(self.prep.run_dir, f"{rep.entry}-{rep.index}")

    def _start(self, rep: Replica) -> None:
        """Start one replica; call it from the main thread only (see `preexec_fn`)."""
        if rep.proc is not None and rep.proc.poll() is None:
            # A rank stopped for its group's restart that has not ended yet: it must not meet its successor.
            stop_process_trees([rep.proc], self.prep.cfg.launch.stop_timeout_s)
        env = {**os.environ, **env_of(rep, self.prep)}
        cpus = cpus_of(rep)

        def before_exec() -> None:
            die_with_parent()
            if cpus is not None:
                bind_to_cpus(cpus)

        rep.proc = subprocess.Popen(
            command_of(rep, self.prep),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a terminal's Ctrl-C reaches only the launcher
            # SIGTERM from the kernel if the launcher dies, even by SIGKILL: roles stop as on a teardown.
            # (Started from the main thread only, which lives as long as the launcher.)
            preexec_fn=before_exec,
        )
        # Appended: a restarted replica (or a resumed run) continues the log of the ones before it.
        logfile = self.log_of(rep).open("ab", buffering=0)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        logfile.write(f"---- {stamp} {rep.label} started by the launcher (pid {rep.proc.pid}) ----\n".encode())
        self._shown[rep.label] = Shown(self.log_of(rep))
        log.info("started %s (role %s, pid %d)", rep.label, rep.role, rep.proc.pid)
        threading.Thread(
            target=self._pump, args=(rep, rep.proc, logfile), daemon=True, name=f"pump {rep.label}"
        ).start()

    def _pump(self, rep: Replica, proc: subprocess.Popen[bytes], logfile: BinaryIO) -> None:
        assert proc.stdout is not None
        prefix = f"[{rep.label}] "
        shown = self._shown[rep.label]
        with logfile:
            for raw in proc.stdout:
                if self._full.is_set():
                    continue  # drained, so the role is not blocked on its pipe; neither file nor console takes it
                try:
                    logfile.write(raw)
                except OSError as exc:
                    if exc.errno != errno.ENOSPC:
                        raise
                    self._disk_full(f"writing {self.log_of(rep)} failed: {exc.strerror}")
                    continue
                line = raw.decode(errors="replace").rstrip("\n")
                if self.verbose:
                    self.console.line(prefix + line)
                elif (text := shown(line)) is not None:
                    self.console.line(prefix + text)
        code = proc.wait()
        self._exits.put((rep, code))

    def _disk_full(self, why: str) -> None:
        """Stop the run (once): the run dir's file system is full. The roles' output after this is dropped:
        it cannot be logged, and it would be the same failure told by every role."""
        if self._full.is_set():
            return
        self._full.set()
        self._exits.put((None, DISK_FULL))
        log.error(
            "the disk of the run dir %s is full (%s): stopping the run. Its checkpoints and weight versions are "
            "written whole or not at all; free space there, then continue with `slipstream launch --resume %s`",
            self.prep.run_dir,
            why,
            self.prep.run_dir,
        )

    def _watch_disk(self) -> None:
        while not self._done.wait(DISK_POLL_S):
            free = shutil.disk_usage(self.prep.run_dir).free
            if free < MIN_FREE_BYTES:
                self._disk_full(f"{free} bytes free, under the {MIN_FREE_BYTES >> 20} MiB a run needs")
                return

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = signum
        self._exits.put((None, 128 + signum))

    def run(self) -> int:
        """Start everything, wait for the outcome, tear down; returns the run's exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        threading.Thread(target=self._watch_disk, daemon=True, name="disk watch").start()
        try:
            for rep in self.replicas:
                self._start(rep)
            return self._wait()
        finally:
            self._done.set()
            self.teardown()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _wait(self) -> int:
        critical = {rep.label for rep in self.replicas if rep.spec.critical}
        while True:
            rep, code = self._exits.get()
            if rep is not None and code == RESTART:
                self._start(rep)
                continue
            if rep is None:
                if code != DISK_FULL:
                    log.info("received %s: stopping the run", signal.Signals(code - 128).name)
                return code
            if rep.label in self._stopped:
                self._stopped.discard(rep.label)
                log.info("%s stopped (exit code %d) for its group's restart", rep.label, code)
                continue
            if code < 0:
                code = 128 - code  # killed by a signal: report it the way a shell does
            if code == 0:
                log.info("%s exited successfully", rep.label)
                critical.discard(rep.label)
                if not critical:
                    log.info("all critical roles finished: run succeeded")
                    return 0
                continue
            if restarts_on_failure(rep) and rep.restarts < rep.spec.max_restarts:
                delay = rep.spec.restart_backoff_s * 2**rep.restarts
                group = [r for r in self.replicas if r.entry == rep.entry] if restarts_together(rep) else [rep]
                for member in group:
                    member.restarts = rep.restarts + 1
                    if member is not rep and member.proc is not None and member.proc.poll() is None:
                        self._stopped.add(member.label)
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(member.proc.pid, signal.SIGTERM)
                log.warning(
                    "%s exited with code %d: restarting%s (%d/%d) in %.1fs",
                    rep.label,
                    code,
                    "" if len(group) == 1 else f" all {len(group)} replicas of {rep.entry}",
                    rep.restarts,
                    rep.spec.max_restarts,
                    delay,
                )
                self._show_tail(rep, code)
                # Started by this (main) thread when the timer says so: the parent-death signal of a child is
                # tied to the thread that forked it.
                for member in group:
                    timer = threading.Timer(delay, self._exits.put, args=((member, RESTART),))
                    timer.daemon = True
                    timer.start()
                continue
            spent = (
                f" after {rep.restarts} restart(s), the most launch.roles.{rep.entry}.max_restarts allows"
                if (restarts_on_failure(rep))
                else ""
            )
            log.error(
                "%s failed with exit code %d%s: stopping the run (its log: %s)",
                rep.label,
                code,
                spent,
                self.log_of(rep),
            )
            self._show_tail(rep, code)
            return code

    def _show_tail(self, rep: Replica, code: int) -> None:
        """A replica that exited with an error code but put no warning or error on the console: its last
        lines say why (one killed by a signal, code >= 128, has nothing to say about it)."""
        if self.verbose or self._shown[rep.label].count or not 0 < code < 128:
            return
        lines = self.log_of(rep).read_bytes()[-TAIL_BYTES:].decode(errors="replace").splitlines()[-TAIL_LINES:]
        self.console.line(f"[{rep.label}] the last lines of its log:")
        for line in lines:
            self.console.line(f"[{rep.label}]   {line.rsplit(chr(13), 1)[-1]}")

    def teardown(self) -> None:
        """SIGTERM every child's group and descendants, SIGKILL what survives the grace period: in stages
        (TEARDOWN_STAGES), callers before the servers they call."""
        for stage in range(len(TEARDOWN_STAGES) + 1):
            procs = [rep.proc for rep in self.replicas if rep.proc is not None and _teardown_stage(rep.role) == stage]
            if procs:
                stop_process_trees(procs, self.prep.cfg.launch.stop_timeout_s)


# The roles stopped after the first stage, in order: whatever calls the router and the workers (the trainer, the
# evaluator, a command of one's own) stops first, so that none of them sees its server go away mid-request and
# retries into a dying one (the end of a demo used to log the evaluator's retries against a vLLM shutting down);
# then the router, then the workers.
TEARDOWN_STAGES = ("router", "vllm")


def _teardown_stage(role: str) -> int:
    return TEARDOWN_STAGES.index(role) + 1 if role in TEARDOWN_STAGES else 0


def launch(
    config_path: str | None, overrides: Sequence[str] = (), resume: str | None = None, verbose: bool = False
) -> int:
    """`slipstream launch`: run every role of the config on this machine (or continue the run of the run dir
    `resume`); returns the exit code. `verbose` prints every line of every role instead of the quiet console."""
    prep = prepare(config_path, overrides, resume=resume)
    console = Console(sys.stdout)
    (prep.run_dir / LOGS).mkdir(exist_ok=True)
    own_log = RunDirLog(log_path(prep.run_dir, "launch"))
    logsetup.setup("launch", prep.exp, prep.cfg.run.log_level, handlers=[ConsoleHandler(console), own_log])
    if not prep.cfg.launch.roles:
        raise ValueError(f"{config_path}: [launch.roles] is empty; add e.g. [launch.roles.trainer] critical = true")
    for rep in replicas_of(prep.cfg):
        try:
            cpus_of(rep)
        except ValueError as exc:
            raise LaunchError(str(exc)) from None
    registry = Registry.for_root(prep.cfg.run.root)
    rendezvous = Rendezvous(prep.meet_dir, prep.cfg.rendezvous)
    if resume is not None:
        if (live := rendezvous.live_server()) is not None:
            raise LaunchError(
                f"--resume {resume}: experiment {prep.exp} is still running (its Redis answers at "
                f"{live.host}:{live.port}, pid {live.pid}); stop that launch first"
            )
        try:
            registry.resume(prep.exp, to_toml(prep.cfg))
        except KeyError:  # a run dir from another run root (or a registry since removed): record it here
            registry.start(prep.exp, prep.cfg.run.name, to_toml(prep.cfg))
        log.info("resuming experiment %s in %s", prep.exp, prep.run_dir)
    else:
        try:
            registry.start(prep.exp, prep.cfg.run.name, to_toml(prep.cfg))
        except ValueError:
            raise LaunchError(
                f"experiment {prep.exp} (SLIPSTREAM_EXP) exists already in {registry.path}; continue it with "
                f"`slipstream launch --resume {prep.run_dir}`, or unset SLIPSTREAM_EXP for a new one"
            ) from None
        log.info("experiment %s, run dir %s", prep.exp, prep.run_dir)
    log.info(
        "each role's whole output is in %s%s",
        prep.run_dir / LOGS,
        "" if verbose else " (the console shows warnings, errors and progress; --verbose shows every line)",
    )
    started = time.time()
    code = 1
    dash = None
    progress = None
    try:
        rendezvous.connect()
        if prep.cfg.launch.dash:
            dash = start_dashboard(prep)
            log.info(
                "dashboard: %s (it asks for the run's token once: `slipstream token %s dash` prints it, "
                "open the URL with ?token=<it>)",
                dash.url(f"/run/{prep.exp}", with_token=False),
                prep.meet_dir,
            )
        if not verbose:
            progress = ProgressLine(
                console,
                prep.run_dir,
                prep.cfg.trainer.steps,
                prep.cfg.trainer.warmup.steps,
                lambda: read_live(prep.exp, prep.meet_dir),
            )
            progress.start()
        code = Launcher(prep, console, verbose).run()
    finally:
        if progress is not None:
            progress.stop()
        if dash is not None:
            dash.stop()
        rendezvous.close()
        status = "succeeded" if code == 0 else "interrupted" if code in (130, 143) else "failed"
        registry.finish(prep.exp, status)
        if not verbose:
            show_report(console, prep.run_dir, started)
        log.info(
            "run %s %s (exit code %d) after %s; logs: %s; dashboard: slipstream dash %s",
            prep.exp,
            status,
            code,
            elapsed(time.time() - started),
            prep.run_dir / LOGS,
            prep.run_dir,
        )
    return code


class RunDirLog(logging.FileHandler):
    """The launcher's own log file in the run dir. Its lines are on the console too: a write that fails because
    the disk is full (which the launcher reports once, `Launcher._disk_full`) is not reported again per line."""

    def handleError(self, record: logging.LogRecord) -> None:  # noqa: N802 - logging's name
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return
        super().handleError(record)


def start_dashboard(prep: Prepared) -> DashServer:
    """The dashboard of the run root on loopback (launch.dash); a port that cannot be bound stops the launch."""
    try:
        return DashServer(prep.cfg.run.root, port=prep.cfg.launch.dash_port, token=ensure_secrets(prep.meet_dir).dash)
    except OSError as exc:
        raise LaunchError(
            f"launch.dash: cannot serve the dashboard on port {prep.cfg.launch.dash_port} ({exc}); "
            "set launch.dash_port to a free port, or 0 for any"
        ) from None


def show_report(console: Console, run_dir: Path, since: float) -> None:
    """The trainer's end-of-run report (report.txt), if this launch wrote one; the role logs hold it too."""
    report = run_dir / REPORT_FILE
    if report.is_file() and report.stat().st_mtime >= since:
        for line in report.read_text().splitlines():
            console.line(line)
