"""The Redis key schema: every key of an experiment, in one place (the table is in docs/ARCHITECTURE.md).

All keys start with `ss:{exp}:`. Liveness is always a key with a TTL refreshed by a heartbeat;
nothing is alive without one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Keys:
    """Key names of one experiment."""

    exp: str

    def __post_init__(self) -> None:
        if not self.exp or any(c in self.exp for c in " :{}"):
            raise ValueError(f"experiment id {self.exp!r} must be non-empty without spaces, ':' or braces")

    @property
    def prefix(self) -> str:
        return f"ss:{self.exp}:"

    def router(self, name: str = "default") -> str:
        """The URL of the router named `name`; a TTL key, refreshed by the router's heartbeat."""
        return f"{self.prefix}router" if name == "default" else f"{self.prefix}router:{name}"

    @property
    def workers(self) -> str:
        """Hash worker_id -> JSON {url, model, weight_version, started_at}."""
        return f"{self.prefix}workers"

    @property
    def eval_workers(self) -> str:
        """Hash worker_id -> JSON like `workers`, for the evaluator's own workers (rollout.pool = "eval");
        the router and the weight publisher never read it, so these workers serve only the evaluator."""
        return f"{self.prefix}eval_workers"

    def worker_alive(self, worker_id: str) -> str:
        """TTL key of one worker of either pool; the worker counts as alive only while it exists."""
        return f"{self.prefix}worker:{worker_id}:alive"

    def worker_sync(self, worker_id: str) -> str:
        """Lock held by whoever is changing one worker's weights (a publisher, or the worker catching up)."""
        return f"{self.prefix}worker:{worker_id}:sync"

    @property
    def weights_current(self) -> str:
        """The newest weight version every live worker acknowledged (integer)."""
        return f"{self.prefix}weights:current"

    @property
    def weights_log(self) -> str:
        """Stream of published versions {version, backend, location, ts}."""
        return f"{self.prefix}weights:log"

    @property
    def events(self) -> str:
        """Stream of lifecycle events {role, event, detail, ts}."""
        return f"{self.prefix}events"

    @property
    def evals(self) -> str:
        """Stream of finished evaluations {version, benchmark, score, ts}."""
        return f"{self.prefix}evals"

    def role_alive(self, role: str, instance: str) -> str:
        """TTL key of one role process (every role heartbeats one)."""
        return f"{self.prefix}role:{role}:{instance}:alive"

    def role_pattern(self, role: str) -> str:
        """SCAN pattern matching the liveness keys of every process of one role."""
        return f"{self.prefix}role:{role}:*:alive"

    @property
    def trainer_store(self) -> str:
        """JSON {addr: "host:port", pid, ts} of trainer rank 0's process-group store (launcher-started ranks)."""
        return f"{self.prefix}trainer:store"

    @property
    def trainer_ranks(self) -> str:
        """Hash rank -> JSON {host, pid, instance, state}: each trainer rank's process and its role heartbeat."""
        return f"{self.prefix}trainer:ranks"
