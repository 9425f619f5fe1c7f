"""The launch section: the process entries (`RoleSpec`) that `slipstream launch` starts and `slipstream scripts`
writes for a cluster, each checking its own knobs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from common.config.coerce import ConfigError, require
from common.proc import parse_cpus

ROLES = ("trainer", "vllm", "router", "evaluator")


@dataclass
class RoleSpec:
    role: str = ""
    """Role run by this entry (trainer, vllm, router, evaluator); empty means the entry's name."""
    replicas: int = 1
    """Processes started for this entry."""
    critical: bool = False
    """The run ends when every critical entry has exited successfully."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables of these processes."""
    command: str = ""
    """Command template; empty runs `slipstream run`. Fields: {python} {config} {role} {replica}."""
    restart: Literal["auto", "never", "on-failure"] = "auto"
    """on-failure: restart a replica that exits non-zero (up to max_restarts, after restart_backoff_s,
    doubling) instead of failing the run. auto: on-failure for every role (the router, vLLM workers and the
    evaluator rejoin a running experiment by themselves; the trainer resumes from its newest checkpoint, all
    of its ranks together); never for entries with their own command."""
    max_restarts: int = 3
    """Restarts allowed per replica when it restarts on failure."""
    restart_backoff_s: float = 1.0
    """Wait before a replica's first restart; each further restart of it waits twice as long."""
    node_group: str = ""
    """Entries with the same node group share nodes in `slipstream scripts` output (one Slurm hetjob component
    per group, pod affinity on Kubernetes); empty means the entry is a group of its own."""
    cpus: str = ""
    """CPUs this entry's processes run on when `slipstream launch` starts them, written as taskset writes them
    ("1", "0,2-3"); empty: any. Each replica and every process it starts is bound to them, OMP_NUM_THREADS
    defaults to their number, and a vLLM worker binds its OpenMP threads to them (VLLM_CPU_OMP_THREADS_BIND).
    Giving the trainer and the workers of one host disjoint CPUs is what separate GPUs are on a GPU host:
    they stop competing for cores (unbound, the demo's fully-async train steps took 2.75x as long,
    bench/RESULTS.md). `slipstream scripts` leaves binding to the scheduler."""
    gpus_per_replica: int = 0
    """GPUs one replica uses on its node: 1 for a trainer rank, rollout.tensor_parallel_size for a vLLM
    worker, 0 for a process without GPUs. `slipstream scripts` packs replicas onto nodes by this count."""

    def check(self, name: str) -> None:
        """This entry's own knobs; `name` is its key under launch.roles."""
        role = self.role or name
        require(
            role in ROLES or bool(self.command),
            f"launch.roles.{name}: unknown role {role!r}; use one of {', '.join(ROLES)} or give a command",
        )
        require(self.replicas >= 0, f"launch.roles.{name}.replicas must be >= 0")
        require(self.max_restarts >= 0, f"launch.roles.{name}.max_restarts must be >= 0")
        require(self.restart_backoff_s >= 0, f"launch.roles.{name}.restart_backoff_s must be >= 0 (seconds)")
        if self.cpus:
            try:
                parse_cpus(self.cpus, f"launch.roles.{name}.cpus")
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
        gpus, key = self.gpus_per_replica, f"launch.roles.{name}.gpus_per_replica"
        require(gpus >= 0, f"{key} must be >= 0 (0 = no GPU), got {gpus}")
        require(
            role != "trainer" or gpus <= 1,
            f"{key} = {gpus}: a trainer rank drives one GPU; set 1 and raise launch.roles.{name}.replicas instead",
        )


@dataclass
class LaunchConfig:
    roles: dict[str, RoleSpec] = field(default_factory=dict)
    """Process entries started by `slipstream launch` / written by `slipstream scripts`."""
    stop_timeout_s: float = 10.0
    """Grace period between SIGTERM and SIGKILL when the launcher tears the run down."""
    gpus_per_node: int = 8
    """GPUs of one node of the cluster that `slipstream scripts` writes for; a node group takes as many
    nodes as its replicas need when packed by gpus_per_replica (a group without GPUs takes one)."""
    master_port: int = 29500
    """Port trainer rank 0 listens on for the process group when `slipstream scripts` starts the ranks
    torchrun-style (MASTER_PORT under Slurm and Kubernetes)."""
    image: str = "slipstream:latest"
    """Container image of every pod in the Kubernetes manifest; it must hold this checkout at the path
    `slipstream scripts` ran from, with the same Python."""
    shared_volume_size: str = "100Gi"
    """Size requested by the manifest's ReadWriteMany volume, mounted at the run dir in every pod (meet
    dir, published weights and checkpoints live there)."""
    dash: bool = False
    """Serve the run dashboard (`slipstream dash`) from the launcher on loopback while the run goes on, and
    print its URL; for a bind beyond loopback run `slipstream dash --host H --token T` instead."""
    dash_port: int = 0
    """Port of the launcher's dashboard; 0 picks a free one (printed)."""

    def check(self) -> None:
        require(self.gpus_per_node >= 1, f"launch.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        require(0 < self.master_port < 65536, f"launch.master_port {self.master_port} is not a port")
        for name, spec in self.roles.items():
            spec.check(name)
            key = f"launch.roles.{name}.gpus_per_replica"
            require(
                spec.gpus_per_replica <= self.gpus_per_node,
                f"{key} = {spec.gpus_per_replica} exceeds launch.gpus_per_node = {self.gpus_per_node}: a replica "
                "runs on one node; lower it or raise launch.gpus_per_node",
            )
        if self.roles:
            require(
                any(spec.critical for spec in self.roles.values()),
                "launch.roles: no entry is critical, so a launch would never end; set critical = true on one "
                "(usually the trainer)",
            )
