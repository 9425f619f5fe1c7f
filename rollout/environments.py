"""`load_environments`: the episodes' environments a config's rollout.episode section names, a built-in kind or an
imported factory. Apart from rollout/episode.py (the contracts) because it imports the tools environment, which
imports those contracts."""

from __future__ import annotations

from pathlib import Path

from common.config import Config
from rollout.episode import Environments, TaskEnvironments
from rollout.tasks import Task, import_factory


def load_environments(cfg: Config, task: Task, run_dir: Path) -> Environments:
    """The environments `cfg.rollout.episode.environment` names, over `task`, writing under `run_dir` (tool
    scratch directories)."""
    name = cfg.rollout.episode.environment
    if name == "task":
        return TaskEnvironments(task)
    if name == "tools":
        from rollout.tools.env import ToolEnvironments

        return ToolEnvironments.from_config(cfg.rollout.episode, task, run_dir)
    envs = import_factory(name, "rollout.episode.environment")(cfg, task, run_dir)
    if not isinstance(envs, Environments):
        raise TypeError(
            f"rollout.episode.environment {name!r} returned {type(envs).__name__}, which lacks new() and "
            "reference(problem)"
        )
    return envs
