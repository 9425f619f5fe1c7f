"""The flow runtime: drives a flow policy for real. The policy lives on the GenerationController's
event loop (every policy event is handled there, one at a time, so generation keeps being steered
while the trainer computes); the trainer's work (train steps, weight publishes, checkpoints) runs in
the caller's thread, the trainer's main thread, through plain callables. Prompts come from a sequence
or a `prompt_at(index)` function (prompt ids are data indices); each sample is one controller item,
a `SampleRequest`, and its result must be a `Trajectory`: it tells the weights steps of its tokens
(`token_steps`, or the caller's `steps_of`) and, for dynamic sampling, its reward (`sample_reward`).
The runtime, its requests and its groups are generic over the prompt type P and the result type R (the
RL trainer's are `Problem` and `Rollout`).
The runtime's state (policy state, results of finished samples, attempt numbers) is a snapshot taken
right after every train step and handed to the checkpoint callback; a runtime restored from it
re-issues what was in flight, so every prompt is trained exactly once across a resume.
"""

from __future__ import annotations

import enum
import logging
import queue
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final, Generic, Protocol, TypeVar, cast

from rollout.controller import GenerationController
from rollout.flow.events import (
    Abort,
    Action,
    Dispatch,
    Finish,
    FlowCounters,
    FlowError,
    Publish,
    SampleDone,
    SampleKey,
    Train,
)
from rollout.flow.policy import FlowPolicy
from rollout.outcomes import Outcome

log = logging.getLogger(__name__)


class Trajectory(Protocol):
    """What the runtime reads of a generation result (rollout/generator.py's `Rollout` is one): the weight
    versions of its tokens (one per token, or any non-empty sequence of them) and its reward (None when it
    has none; only dynamic sampling needs it)."""

    @property
    def weight_versions(self) -> Sequence[int]: ...

    @property
    def reward(self) -> float | None: ...


P = TypeVar("P")  # a prompt, as the data holds it
R = TypeVar("R", bound=Trajectory)  # a generation result
T = TypeVar("T")

FlowState = dict[str, Any]
"""The runtime's checkpointable state: the policy's plain-JSON state, the held results (pickled with
the checkpoint) and the attempt numbers."""


@dataclass
class SampleRequest(Generic[P]):
    """What the genable receives: one sample of one prompt. `attempt` counts re-issues of the sample
    (stale, failed, aborted or resumed); `weights_step` is the weights step the generators served at dispatch;
    `dispatched` is when the runtime made it, right before handing it to the controller (`time.monotonic()`)."""

    prompt_id: int
    index: int
    prompt: P
    attempt: int
    weights_step: int
    dispatched: float = field(default_factory=time.monotonic)


@dataclass
class Group(Generic[P, R]):
    """One prompt with its `samples_per_prompt` results, in sample order: the unit a train step gets."""

    prompt_id: int
    prompt: P
    samples: list[R]


@dataclass
class StepTiming:
    """When train step `step` ran, in seconds since `run()` started; `dropped_groups` as in `Train`."""

    step: int
    start: float
    end: float
    prompt_ids: tuple[int, ...]
    dropped_groups: int = 0


@dataclass
class FlowReport:
    """How a run went: why it ended, the steps and publishes it ran (publishes as (weights step, start, end)),
    the policy's counters and the prompts dynamic sampling dropped (never trained)."""

    finish_reason: str
    steps: list[StepTiming]
    publishes: list[tuple[int, float, float]]
    counters: FlowCounters
    filtered_prompts: list[int]


def token_steps(result: Trajectory) -> tuple[int, int]:
    """(oldest, newest) weights step of a result's tokens, read from its `weight_versions` (one version per
    token, or any non-empty sequence of versions) taken as steps: right while every version is its step, as
    in a run that never resumed; a trainer passes `steps_of=` translating through its lineage."""
    # Checked at run time too: the controller hands back whatever the genable returned.
    versions = getattr(result, "weight_versions", None)
    if not versions:
        raise ValueError(
            f"generation result {type(result).__name__} has no weight_versions; every trajectory must record "
            "the weight versions of its tokens (or pass steps_of= to FlowRuntime)"
        )
    return min(versions), max(versions)


def sample_reward(result: Trajectory) -> float | None:
    """A result's reward, read from its `reward`; None when it has none (only dynamic sampling needs it)."""
    reward = getattr(result, "reward", None)
    return None if reward is None else float(reward)


@dataclass
class _TrainBatch(Generic[P, R]):
    """A `Train` action with its groups, on its way to the trainer thread."""

    step: int
    groups: list[Group[P, R]]
    dropped_groups: int


_Job = _TrainBatch[P, R] | Publish | Finish
"""What the loop thread hands the trainer thread. The controller's wake-up marker (an error to raise, or
a close) arrives on the same queue and is none of these."""


@dataclass
class _LoopState(Generic[P, R]):
    """Everything the loop thread owns besides the policy."""

    tickets: dict[SampleKey, int] = field(default_factory=dict)
    keys: dict[int, SampleKey] = field(default_factory=dict)  # ticket -> sample
    results: dict[SampleKey, R] = field(default_factory=dict)  # finished, not yet trained (incl. the job's)
    attempts: dict[SampleKey, int] = field(default_factory=dict)
    prompts: dict[int, P] = field(default_factory=dict)  # payloads of prompts not yet trained
    void_from: int | None = None  # prompt ids from here on do not exist


class _Missing(enum.Enum):
    """A prompt id past the end of the data (None is a prompt like any other in a sequence)."""

    MISSING = enum.auto()


_MISSING: Final = _Missing.MISSING


class FlowRuntime(Generic[P, R]):
    """Runs a flow policy with a GenerationController and the trainer's callbacks until it finishes."""

    def __init__(
        self,
        policy: FlowPolicy,
        controller: GenerationController,
        prompts: Sequence[P] | Callable[[int], P | None],
        train_step: Callable[[int, list[Group[P, R]], int], None],
        publish: Callable[[int], None],
        *,
        checkpoint: Callable[[int, FlowState], None] | None = None,
        steps_of: Callable[[R], tuple[int, int]] = token_steps,
        rewards: Callable[[R], float | None] = sample_reward,
    ) -> None:
        """`train_step(step, groups, dropped_groups)` trains one batch; `dropped_groups` is how many
        zero-variance groups dynamic sampling dropped while it formed (0 without dynamic sampling).
        `publish(step)` publishes the weights of step `step`; `steps_of(result)` is the (oldest, newest) weights
        step of a result's tokens."""
        self.policy = policy
        self.controller = controller
        self.prompts = prompts
        self.train_step = train_step
        self.publish = publish
        self.checkpoint = checkpoint
        self.steps_of = steps_of
        self.rewards = rewards
        self._s: _LoopState[P, R] = _LoopState()
        self._jobs: queue.SimpleQueue[_Job[P, R]] = queue.SimpleQueue()
        self._last_state: FlowState | None = None
        self.origin: float | None = None
        """The flow's clock: `time.monotonic()` when `run()` started (None before). The report's times are
        seconds since it, and so are the trainer's timing metrics (one origin per trainer process)."""

    # -- caller (trainer) thread ---------------------------------------------------------------

    def run(self) -> FlowReport:
        """Block until the policy finishes, running train steps, publishes and checkpoints in this
        thread. Errors of the trainer callbacks propagate; errors of generation past the error budget
        (and bugs in the loop) are raised here too."""
        self.controller.wake_on_error(self._jobs)
        t0 = self.origin = time.monotonic()
        steps: list[StepTiming] = []
        publishes: list[tuple[int, float, float]] = []
        self._in_loop(lambda: self._apply(self.policy.start()))
        while True:
            job = self._jobs.get()
            self.controller.check()
            if isinstance(job, _TrainBatch):
                start = time.monotonic() - t0
                self.train_step(job.step, job.groups, job.dropped_groups)
                end = time.monotonic() - t0
                ids = tuple(g.prompt_id for g in job.groups)
                steps.append(StepTiming(job.step, start, end, ids, job.dropped_groups))
                state = self._in_loop(partial(self._train_done, job.step))
                log.info("flow: step %d trained on %d groups in %.2fs", job.step, len(job.groups), end - start)
                if self.checkpoint is not None:
                    self.checkpoint(job.step + 1, state)
            elif isinstance(job, Publish):
                start = time.monotonic() - t0
                self.publish(job.step)
                publishes.append((job.step, start, time.monotonic() - t0))
                self._in_loop(partial(self._published, job.step))
            elif isinstance(job, Finish):
                log.info("flow: finished (%s) after %d steps", job.reason, self.policy.step)
                return FlowReport(job.reason, steps, publishes, self.policy.counters, list(self.policy.filtered))
            # anything else is the controller's wake-up marker; check() above found nothing

    def state_dict(self) -> FlowState:
        """The state after the latest train step (what the checkpoint callback got), or the current
        state before the run starts. Results are kept as they are: they must be picklable to be saved."""
        if self._last_state is not None:
            return self._last_state
        return self._snapshot()

    def final_state(self) -> FlowState:
        """The state as a finished `run()` left it, its last publish included: what the final checkpoint
        holds, so that a run extended with more steps goes on from there (state_dict() is the state before
        that publish, which the trainer's lineage has already passed). Call after run() returned."""
        return self._snapshot()

    def load_state_dict(self, state: FlowState) -> None:
        """Restore a saved state before `run()`: buffered results come back, anything in flight is
        re-issued, and finished samples whose results were not saved are generated again."""
        self.policy.load_state_dict(state["policy"])
        self._s.results = {(p, s): r for p, s, r in state.get("results", [])}
        self._s.attempts = {(p, s): n for p, s, n in state.get("attempts", [])}
        missing = [k for k in self.policy.held_keys() if k not in self._s.results]
        if missing:
            self.policy.forget_buffered(missing)

    # -- loop thread ---------------------------------------------------------------------------

    def _in_loop(self, fn: Callable[[], T]) -> T:
        return self.controller.call_soon(fn).result()

    def _prompt(self, pid: int) -> P | _Missing:
        if pid in self._s.prompts:
            return self._s.prompts[pid]
        prompt: P | _Missing
        if callable(self.prompts):
            fetched = self.prompts(pid)
            prompt = _MISSING if fetched is None else fetched
        else:
            prompt = self.prompts[pid] if pid < len(self.prompts) else _MISSING
        if prompt is not _MISSING:
            self._s.prompts[pid] = prompt
        return prompt

    def _apply(self, actions: list[Action]) -> None:
        s = self._s
        todo = deque(actions)
        while todo:
            a = todo.popleft()
            if isinstance(a, Dispatch):
                if s.void_from is not None and a.prompt_id >= s.void_from:
                    continue
                prompt = self._prompt(a.prompt_id)
                if prompt is _MISSING:
                    s.void_from = a.prompt_id
                    todo.extend(self.policy.on_data_exhausted(a.prompt_id))
                    continue
                for index in a.samples:
                    key = (a.prompt_id, index)
                    attempt = s.attempts.get(key, 0)
                    s.attempts[key] = attempt + 1
                    request = SampleRequest(a.prompt_id, index, prompt, attempt, a.weights_step)
                    ticket = self.controller.submit(request, self._on_outcome)
                    s.tickets[key] = ticket
                    s.keys[ticket] = key
            elif isinstance(a, Abort):
                for key in a.keys:
                    ticket = s.tickets.pop(key)
                    del s.keys[ticket]
                    self.controller.cancel(ticket)
            elif isinstance(a, Train):
                self._jobs.put(_TrainBatch(a.step, [self._group(p) for p in a.prompt_ids], a.dropped_groups))
            elif isinstance(a, (Publish, Finish)):
                self._jobs.put(a)

    def _group(self, pid: int) -> Group[P, R]:
        prompt = self._prompt(pid)
        if prompt is _MISSING:  # only after a resume on data that lost the prompt since the checkpoint
            raise FlowError(
                f"prompt {pid} is in a train batch but the data has no prompt {pid}; resume with the data "
                "the checkpoint was made with"
            )
        spp = self.policy.flow.samples_per_prompt
        return Group(pid, prompt, [self._s.results[(pid, i)] for i in range(spp)])

    def _on_outcome(self, out: Outcome[SampleRequest[P], R]) -> None:
        key = self._s.keys.pop(out.ticket, None)
        if key is None:  # aborted: the policy already re-queued it
            return
        del self._s.tickets[key]
        if out.ok:
            # Whatever the genable returned: the controller does not know R; `steps_of` checks it.
            result = cast(R, out.result)
            oldest, newest = self.steps_of(result)
            reward = self.rewards(result)
            self._s.results[key] = result
            self._apply(self.policy.on_sample_done(SampleDone(key[0], key[1], oldest, newest, reward)))
        else:
            log.warning("flow: sample %s failed for good (%r); it is generated again", key, out.error)
            self._apply(self.policy.on_sample_failed(*key))

    def _published(self, step: int) -> None:
        self._apply(self.policy.on_published(step))

    def _train_done(self, step: int) -> FlowState:
        self._apply(self.policy.on_train_done(step))
        # Forget what no longer matters: trained or dropped prompts and their samples.
        live = set(self.policy.untrained) | {p for p, _ in self.policy.held_keys()}
        s = self._s
        s.prompts = {p: v for p, v in s.prompts.items() if p in live}
        held = set(self.policy.held_keys())
        s.results = {k: v for k, v in s.results.items() if k in held}
        s.attempts = {k: n for k, n in s.attempts.items() if k[0] in live}
        self._last_state = self._snapshot()
        return self._last_state

    def _snapshot(self) -> FlowState:
        s = self._s
        return {
            "policy": self.policy.state_dict(),
            "results": [[p, i, s.results[(p, i)]] for p, i in self.policy.held_keys() if (p, i) in s.results],
            "attempts": [[p, i, n] for (p, i), n in s.attempts.items()],
        }
