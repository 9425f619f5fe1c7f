"""The vocabulary between a flow policy (rollout/flow/policy.py) and its driver (the runtime or the
simulator): the events a driver feeds in (`SampleDone`), the actions that come out (`Dispatch`, `Abort`,
`Train`, `Publish`, `Finish`), the trainer job a policy waits on (`TrainJob`, `PublishJob`), the counters of
what happened to the samples, and `FlowError` for a driver that breaks the contract. Plain frozen records, no
behaviour.

The flow counts in trainer steps, never in weight versions. `step` is an optimizer step: `Train(step)` runs
optimizer step `step`. The weights of step s (weights step s, for short) are the weights after s optimizer
steps (step 0: the initial model): optimizer step s trains on them and produces those of step s + 1. Every
field that names weights holds such a step (`Dispatch.weights_step`, `SampleDone.oldest_step` and
`newest_step`, `Publish.step`, the policy's `served_step`), and staleness is a difference of steps. The published weight
version that carries a step's weights to the generators is the trainer's business
(common/weights/lineage.py): versions are never reused, so after a resume a version is not its step."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

SampleKey = tuple[int, int]
"""(prompt id, sample index within its group)."""


class FlowError(RuntimeError):
    """The driver broke the policy's contract (an unknown sample, an unexpected event or weights step)."""


@dataclass(frozen=True)
class SampleDone:
    """One sample finished generating; `oldest_step` and `newest_step` are the oldest and newest weights step
    of its tokens, `reward` the task's reward of it (required with dynamic sampling, which filters on it)."""

    prompt_id: int
    index: int
    oldest_step: int
    newest_step: int
    reward: float | None = None


@dataclass(frozen=True)
class Dispatch:
    """Start generation requests for these samples of one prompt (the generators serve the weights of step
    `weights_step`)."""

    prompt_id: int
    samples: tuple[int, ...]
    weights_step: int


@dataclass(frozen=True)
class Abort:
    """Cancel these in-flight requests (weights are about to change and partial rollout is off)."""

    keys: tuple[SampleKey, ...]


@dataclass(frozen=True)
class Train:
    """Run optimizer step `step` on these complete prompt groups; it produces the weights of step + 1.
    `dropped_groups` counts the zero-variance groups dynamic sampling dropped while the batch formed."""

    step: int
    prompt_ids: tuple[int, ...]
    dropped_groups: int = 0


@dataclass(frozen=True)
class Publish:
    """Publish the weights of step `step` to the generators (they are paused in keep mode meanwhile)."""

    step: int


@dataclass(frozen=True)
class Finish:
    """The run is over: every step is trained (`max_steps`) or the data is used up (`end_of_data`)."""

    reason: str


Action = Dispatch | Abort | Train | Publish | Finish


@dataclass(frozen=True)
class TrainJob:
    """The trainer is running optimizer step `step` (the policy issued `Train(step, ...)`)."""

    step: int


@dataclass(frozen=True)
class PublishJob:
    """The trainer is publishing the weights of step `step` (the policy issued `Publish(step)`)."""

    step: int


TrainerJob = TrainJob | PublishJob
"""The trainer's one outstanding job, as the policy tracks it until the driver reports its end."""


@dataclass
class FlowCounters:
    """What happened to the samples of a run; `staleness` maps staleness -> trained samples.
    `dropped_prompts` are stale drops; `dropped_groups` are dynamic sampling's zero-variance drops."""

    dispatched_samples: int = 0
    completed_samples: int = 0
    failed_samples: int = 0
    aborted_samples: int = 0
    reissued_samples: int = 0
    trained_prompts: int = 0
    trained_samples: int = 0
    stale_samples: int = 0
    requeued_samples: int = 0
    dropped_prompts: int = 0
    dropped_samples: int = 0
    dropped_groups: int = 0
    staleness: dict[int, int] = field(default_factory=dict)

    def state(self) -> dict[str, Any]:
        """As a checkpoint holds them (JSON: the staleness histogram's keys as strings)."""
        return {**dataclasses.asdict(self), "staleness": {str(k): v for k, v in sorted(self.staleness.items())}}

    @classmethod
    def from_state(cls, saved: dict[str, Any]) -> FlowCounters:
        return cls(**{**saved, "staleness": {int(k): v for k, v in saved["staleness"].items()}})


def job_state(job: TrainerJob | None) -> list[str | int] | None:
    """A job as checkpoints hold it: ["train", step], ["publish", step] or null."""
    if isinstance(job, TrainJob):
        return ["train", job.step]
    if isinstance(job, PublishJob):
        return ["publish", job.step]
    return None


def job_from_state(saved: list[Any] | None) -> TrainerJob | None:
    """The inverse of `job_state`."""
    match saved:
        case None | []:
            return None
        case ["train", int(step)]:
            return TrainJob(step)
        case ["publish", int(step)]:
            return PublishJob(step)
    raise FlowError(f'checkpoint flow state has job {saved!r}; expected ["train", step], ["publish", step] or null')
