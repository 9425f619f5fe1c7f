"""A run made ready to start, and each of its replicas' process: the experiment id, run dir and meet dir
resolved, the config frozen into the run dir (`prepare`, also for `--resume`), and for every replica of
every `launch.roles` entry its command line, environment (ROLE, SLIPSTREAM_EXP, SLIPSTREAM_MEET_DIR,
SLIPSTREAM_REPLICA, SLIPSTREAM_REPLICAS) and CPUs. The local launcher (common/runs/launch.py) runs these
processes; common/runs/scripts.py writes them as scripts for several machines.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from common.config import Config, RoleSpec, load_config, to_toml
from common.proc import machine_cpus, parse_cpus
from common.roles import RUN_FILE, new_exp_id, resolve_meet_dir, resolve_run_dir

DEFAULT_COMMAND = "{python} -m common.runs.cli run {config}"


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


class LaunchError(RuntimeError):
    """A run cannot be launched as asked (names the run and the remedy)."""


def prepare(
    config_path: str | None,
    overrides: Sequence[str],
    environ: Mapping[str, str] | None = None,
    resume: str | os.PathLike[str] | None = None,
) -> Prepared:
    """Resolve ids and directories and freeze the config (overrides applied, paths absolute). With `resume`,
    the experiment and run dir are those of that run dir (and the config its config.toml unless given)."""
    env = os.environ if environ is None else environ
    if resume is not None:
        run_dir = Path(resume).resolve()
        record = run_dir / RUN_FILE
        if not record.is_file():
            raise LaunchError(f"--resume {resume}: no {RUN_FILE} there; give the run dir a launch created")
        exp = json.loads(record.read_text())["exp"]
        if env.get("SLIPSTREAM_EXP", exp) != exp:
            raise LaunchError(
                f"--resume {resume} is experiment {exp}, but SLIPSTREAM_EXP={env['SLIPSTREAM_EXP']}; "
                "unset SLIPSTREAM_EXP"
            )
        cfg = load_config(config_path or run_dir / "config.toml", [*overrides, f"run.dir={run_dir}"], env)
    else:
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
    config_file.touch(mode=0o600)  # it may hold router.auth_token and rollout.api_key
    config_file.chmod(0o600)
    config_file.write_text(to_toml(cfg))
    if not (run_dir / RUN_FILE).exists():
        (run_dir / RUN_FILE).write_text(json.dumps({"exp": exp, "name": cfg.run.name}) + "\n")
    return Prepared(cfg, exp, run_dir, meet_dir, config_file)


def replicas_of(cfg: Config) -> list[Replica]:
    return [
        Replica(entry=name, role=spec.role or name, index=i, spec=spec)
        for name, spec in cfg.launch.roles.items()
        for i in range(spec.replicas)
    ]


def command_of(rep: Replica, prep: Prepared, replica: str | None = None) -> list[str]:
    """The replica's command line; `replica` stands in for its index where the index is only known later."""
    template = rep.spec.command or DEFAULT_COMMAND
    try:
        text = template.format(
            python=shlex.quote(sys.executable),
            config=shlex.quote(str(prep.config_file)),
            role=rep.role,
            replica=rep.index if replica is None else replica,
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
    env = {
        "ROLE": rep.role,
        "SLIPSTREAM_EXP": prep.exp,
        "SLIPSTREAM_MEET_DIR": str(prep.meet_dir),
        "SLIPSTREAM_REPLICA": str(rep.index),
        "SLIPSTREAM_REPLICAS": str(rep.spec.replicas),
        "PYTHONUNBUFFERED": "1",
    }
    if rep.spec.cpus:  # as many threads as CPUs; a vLLM worker's OpenMP threads on exactly those CPUs
        cpus = parse_cpus(rep.spec.cpus, f"launch.roles.{rep.entry}.cpus")
        env["OMP_NUM_THREADS"] = str(len(cpus))
        if rep.role == "vllm":
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cpus))
    return env | rep.spec.env


def cpus_of(rep: Replica) -> list[int] | None:
    """The CPUs a replica is bound to (None: any); an error names the key when this machine lacks one."""
    if not rep.spec.cpus:
        return None
    key = f"launch.roles.{rep.entry}.cpus"
    cpus = parse_cpus(rep.spec.cpus, key)
    allowed = machine_cpus()
    if not set(cpus) <= allowed:
        raise ValueError(
            f"{key} = {rep.spec.cpus!r} names CPUs {sorted(set(cpus) - allowed)} that this machine does not give "
            f"(it has {sorted(allowed)}); pick CPUs among those"
        )
    return cpus
