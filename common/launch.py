"""Starting a run: the local launcher (`slipstream launch`) and the script builder (`slipstream scripts`).

The launcher resolves the experiment id, run dir and meet dir, writes the resolved config into the
run dir, records the run in the registry, becomes the rendezvous leader (so Redis outlives any role
restart), and starts every replica of every `launch.roles` entry as a child process with ROLE,
SLIPSTREAM_EXP, SLIPSTREAM_MEET_DIR, SLIPSTREAM_REPLICA and SLIPSTREAM_REPLICAS set (trainer replicas are
its ranks). Child output is prefixed with
`role/replica`. The run ends when every critical entry exited 0, or at the first failure (whose
exit code the launcher returns), or on SIGINT/SIGTERM; in every case the whole process tree is torn
down: SIGTERM to each child's process group and every descendant, then SIGKILL after the grace period.

The script builder writes the same processes as shell scripts, one per replica, plus a Slurm batch
file and a Kubernetes manifest rendered from deploy/ templates, for multi-node runs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import queue
import shlex
import signal
import string
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from common import log as logsetup
from common.config import Config, RoleSpec, load_config, to_toml
from common.registry import Registry
from common.rendezvous import Rendezvous
from common.roles import new_exp_id, resolve_meet_dir, resolve_run_dir

log = logging.getLogger(__name__)

DEFAULT_COMMAND = "{python} -m common.cli run {config}"
DEPLOY_DIR = Path(__file__).resolve().parent.parent / "deploy"


@dataclass
class Replica:
    """One process of a launch entry."""

    entry: str
    role: str
    index: int
    spec: RoleSpec
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0

    @property
    def label(self) -> str:
        return f"{self.entry}/{self.index}"


@dataclass(frozen=True)
class Prepared:
    """A run ready to start: ids, directories and the resolved config written into the run dir."""

    cfg: Config
    exp: str
    run_dir: Path
    meet_dir: Path
    config_file: Path


def prepare(config_path: str | None, overrides: Sequence[str], environ: Mapping[str, str] | None = None) -> Prepared:
    """Resolve ids and directories and freeze the config (overrides applied, paths absolute)."""
    env = os.environ if environ is None else environ
    cfg = load_config(config_path, overrides, env)
    exp = env.get("SLIPSTREAM_EXP") or new_exp_id(cfg.run.name)
    run_dir = resolve_run_dir(cfg, exp).resolve()
    meet_dir = resolve_meet_dir(cfg, run_dir, env).resolve()
    # Children read this file and nothing else, so they all see exactly the launcher's config.
    cfg = dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=str(run_dir)),
        rendezvous=dataclasses.replace(cfg.rendezvous, meet_dir=str(meet_dir)),
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    config_file = run_dir / "config.toml"
    config_file.write_text(to_toml(cfg))
    return Prepared(cfg, exp, run_dir, meet_dir, config_file)


def replicas_of(cfg: Config) -> list[Replica]:
    return [
        Replica(entry=name, role=spec.role or name, index=i, spec=spec)
        for name, spec in cfg.launch.roles.items()
        for i in range(spec.replicas)
    ]


def command_of(rep: Replica, prep: Prepared) -> list[str]:
    template = rep.spec.command or DEFAULT_COMMAND
    try:
        text = template.format(
            python=shlex.quote(sys.executable),
            config=shlex.quote(str(prep.config_file)),
            role=rep.role,
            replica=rep.index,
            run_dir=shlex.quote(str(prep.run_dir)),
            exp=prep.exp,
        )
    except (KeyError, IndexError) as exc:
        raise ValueError(
            f"launch.roles.{rep.entry}.command {template!r} uses unknown field {exc}; "
            "available: {python} {config} {role} {replica} {run_dir} {exp}"
        ) from None
    return shlex.split(text)


def env_of(rep: Replica, prep: Prepared) -> dict[str, str]:
    return {
        "ROLE": rep.role,
        "SLIPSTREAM_EXP": prep.exp,
        "SLIPSTREAM_MEET_DIR": str(prep.meet_dir),
        "SLIPSTREAM_REPLICA": str(rep.index),
        "SLIPSTREAM_REPLICAS": str(rep.spec.replicas),
        "PYTHONUNBUFFERED": "1",
        **rep.spec.env,
    }


class Launcher:
    """Runs the replicas of a prepared run as children and tears them all down at the end."""

    def __init__(self, prep: Prepared, out: object = None) -> None:
        self.prep = prep
        self.replicas = replicas_of(prep.cfg)
        self.out = out or sys.stdout
        self._exits: queue.Queue[tuple[Replica | None, int]] = queue.Queue()
        self._print_lock = threading.Lock()
        self._signal: int | None = None

    def _start(self, rep: Replica) -> None:
        env = {**os.environ, **env_of(rep, self.prep)}
        rep.proc = subprocess.Popen(
            command_of(rep, self.prep),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a terminal's Ctrl-C reaches only the launcher
        )
        log.info("started %s (role %s, pid %d)", rep.label, rep.role, rep.proc.pid)
        threading.Thread(target=self._pump, args=(rep, rep.proc), daemon=True, name=f"pump {rep.label}").start()

    def _pump(self, rep: Replica, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        prefix = f"[{rep.label}] "
        for raw in proc.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            with self._print_lock:
                print(prefix + line, file=self.out, flush=True)  # type: ignore[call-overload]
        code = proc.wait()
        self._exits.put((rep, code))

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._signal = signum
        self._exits.put((None, 128 + signum))

    def run(self) -> int:
        """Start everything, wait for the outcome, tear down; returns the run's exit code."""
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            for rep in self.replicas:
                self._start(rep)
            return self._wait()
        finally:
            self.teardown()
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _wait(self) -> int:
        critical = {rep.label for rep in self.replicas if rep.spec.critical}
        while True:
            rep, code = self._exits.get()
            if rep is None:
                log.info("received %s: stopping the run", signal.Signals(code - 128).name)
                return code
            if code < 0:
                code = 128 - code  # killed by a signal: report it the way a shell does
            if code == 0:
                log.info("%s exited successfully", rep.label)
                critical.discard(rep.label)
                if not critical:
                    log.info("all critical roles finished: run succeeded")
                    return 0
                continue
            if rep.spec.restart == "on-failure" and rep.restarts < rep.spec.max_restarts:
                rep.restarts += 1
                log.warning(
                    "%s exited with code %d: restarting (%d/%d)", rep.label, code, rep.restarts, rep.spec.max_restarts
                )
                self._start(rep)
                continue
            log.error("%s failed with exit code %d: stopping the run", rep.label, code)
            return code

    def teardown(self) -> None:
        """SIGTERM every child's group and descendants, SIGKILL what survives the grace period."""
        live = [rep.proc for rep in self.replicas if rep.proc is not None and rep.proc.poll() is None]
        family: list[psutil.Process] = []
        for proc in live:
            # Descendants are collected first: a child that set up its own session (vLLM does)
            # is outside the group and would otherwise be orphaned.
            with contextlib.suppress(psutil.NoSuchProcess):
                family += psutil.Process(proc.pid).children(recursive=True)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.terminate()
        deadline = time.monotonic() + self.prep.cfg.launch.stop_timeout_s
        for proc in live:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        _, alive = psutil.wait_procs(family, timeout=max(0.0, deadline - time.monotonic()))
        for proc in live:
            if proc.poll() is None:
                log.warning("pid %d ignored SIGTERM for %.0fs: killing", proc.pid, self.prep.cfg.launch.stop_timeout_s)
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        for p in alive:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(alive, timeout=5)


def launch(config_path: str | None, overrides: Sequence[str] = ()) -> int:
    """`slipstream launch`: run every role of the config on this machine; returns the exit code."""
    prep = prepare(config_path, overrides)
    logsetup.setup("launch", prep.exp, prep.cfg.run.log_level)
    if not prep.cfg.launch.roles:
        raise ValueError(f"{config_path}: [launch.roles] is empty; add e.g. [launch.roles.trainer] critical = true")
    registry = Registry.for_root(prep.cfg.run.root)
    registry.start(prep.exp, prep.cfg.run.name, to_toml(prep.cfg))
    log.info("experiment %s, run dir %s", prep.exp, prep.run_dir)
    rendezvous = Rendezvous(prep.meet_dir, prep.cfg.rendezvous)
    code = 1
    try:
        rendezvous.connect()
        code = Launcher(prep).run()
    finally:
        rendezvous.close()
        status = "succeeded" if code == 0 else "interrupted" if code in (130, 143) else "failed"
        registry.finish(prep.exp, status)
        log.info("run %s %s (exit code %d)", prep.exp, status, code)
    return code


# ----------------------------------------------------------------------------------------------
# Scripts for multi-node runs
# ----------------------------------------------------------------------------------------------


def _render(template: str, **fields: str) -> str:
    return string.Template((DEPLOY_DIR / template).read_text()).substitute(fields)


def write_scripts(config_path: str | None, overrides: Sequence[str], outdir: str | os.PathLike[str]) -> list[Path]:
    """Write one script per replica, a Slurm batch file and a Kubernetes manifest; returns their paths."""
    prep = prepare(config_path, overrides)
    if not prep.cfg.launch.roles:
        raise ValueError(f"{config_path}: [launch.roles] is empty; nothing to write")
    out = Path(outdir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    steps: list[str] = []
    pods: list[str] = []
    workdir = Path.cwd().resolve()
    for rep in replicas_of(prep.cfg):
        env = env_of(rep, prep)
        exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in env.items())
        cmd = shlex.join(command_of(rep, prep))
        path = out / f"{rep.entry}-{rep.index}.sh"
        path.write_text(
            _render("role.sh.tmpl", entry=rep.entry, index=str(rep.index), exp=prep.exp, exports=exports,
                    workdir=shlex.quote(str(workdir)), command=cmd)
        )
        path.chmod(0o755)
        written.append(path)
        wait = "critical" if rep.spec.critical else "background"
        steps.append(f"srun --nodes=1 --ntasks=1 --exclusive bash {shlex.quote(str(path))} &  # {wait}")
        if rep.spec.critical:
            steps.append("critical_pids+=($!)")
        env_yaml = "\n".join(f"            - {{name: {k}, value: {_yaml_str(v)}}}" for k, v in env.items())
        pods.append(
            _render("k8s-job.yaml.tmpl", name=_k8s_name(f"{prep.exp}-{rep.entry}-{rep.index}"), exp=prep.exp,
                    role=rep.role, env=env_yaml, command=_yaml_str(cmd), workdir=_yaml_str(str(workdir)),
                    meet_dir=_yaml_str(str(prep.meet_dir)))
        )
    slurm = out / "slurm.sbatch"
    slurm.write_text(
        _render("slurm.sbatch.tmpl", exp=prep.exp, nodes=str(len(written)), steps="\n".join(steps))
    )
    k8s = out / "k8s.yaml"
    k8s.write_text("---\n".join(pods))
    return written + [slurm, k8s, prep.config_file]


def _yaml_str(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _k8s_name(value: str) -> str:
    name = "".join(c if c.isalnum() else "-" for c in value.lower()).strip("-")
    return name[:63].rstrip("-")
