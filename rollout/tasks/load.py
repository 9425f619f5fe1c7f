"""`load_task`: the task a config's rollout.task section names, a built-in kind or an imported factory. It
lives apart from the package's contracts (`Problem`, `Task`) because it imports the built-in tasks, which
import those contracts."""

from __future__ import annotations

from common.config import TaskConfig
from rollout.tasks import Task, import_factory


def load_task(cfg: TaskConfig) -> Task:
    """The task a config names."""
    if cfg.kind == "arithmetic":
        from rollout.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask.from_config(cfg)
    if cfg.kind == "jsonl_math":
        from rollout.tasks.jsonl_math import JsonlMathTask

        return JsonlMathTask.from_config(cfg)
    if cfg.kind == "mixture":
        from rollout.tasks.mixture import MixtureTask

        return MixtureTask.from_config(cfg)
    task = import_factory(cfg.import_path, "rollout.task.import_path")(cfg)
    if not isinstance(task, Task):
        raise TypeError(
            f"rollout.task.import_path {cfg.import_path!r} returned {type(task).__name__}, which lacks "
            "name, __len__, problem(index) and reward(problem, completion)"
        )
    return task
