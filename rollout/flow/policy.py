"""Flow-control policies: pure, deterministic state machines (no threads, I/O, clocks or randomness)
that decide when each prompt is generated, which complete prompt groups form a train batch, and when
new weights are published. A driver (the runtime, or the simulator) feeds events in (`start`,
`on_sample_done`, `on_sample_failed`, `on_train_done`, `on_published`, `on_data_exhausted`) and
executes the actions that come out (`Dispatch`, `Abort`, `Train`, `Publish`, `Finish`) in order.
Weights are named by the step they belong to (rollout/flow/events.py): the weights of step 0 are the
initial model and optimizer step t produces those of step t+1. A prompt is a group of
`samples_per_prompt` samples; a batch is `prompts_per_step` complete groups. The trainer is one
serial resource: at most one `Train` or `Publish` is outstanding at a time, and the driver reports
its end before the policy issues the next. Staleness of a sample is `step - oldest`, where `step` is
the trainer's step when the sample is consumed and `oldest` the oldest weights step among its
tokens. With dynamic sampling on (DAPO-style), a group whose samples all got the same reward carries
no GRPO signal: it is dropped when it completes (`filtered`, never trained) and a new prompt from
the data cursor takes its place, admitted like any other prompt, so a batch still holds
`prompts_per_step` groups with signal. At most `max_dynamic_refills_per_step` groups are dropped per
train step; past that, uniform groups are kept (trained with zero advantage), so a step always fills
and a saturated task cannot burn the data in an endless refill loop. At the end of the data a
dropped group is not replaced and the last batch is partial (`end_of_data` decides). The whole state
is a plain dict (`state_dict`) for checkpoints; `start()` on a restored policy re-issues whatever
was in flight. The events and actions are rollout/flow/events.py; the strategies, and
`policy_from_config`, rollout/flow/strategies.py.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

from common.config import FlowConfig
from rollout.flow.events import (
    Action,
    Dispatch,
    Finish,
    FlowCounters,
    FlowError,
    Publish,
    PublishJob,
    SampleDone,
    SampleKey,
    Train,
    TrainerJob,
    TrainJob,
    job_from_state,
    job_state,
)


class FlowPolicy:
    """Bookkeeping shared by the strategies; subclasses decide in `_advance` what happens next."""

    strategy: ClassVar[str] = ""

    KNOBS: ClassVar[tuple[str, ...]] = (
        "prompts_per_step",
        "samples_per_prompt",
        "max_concurrent",
        "max_untrained_prompts",
        "max_staleness",
        "stale_policy",
        "partial_rollout",
        "end_of_data",
        "dynamic_sampling",
        "max_dynamic_refills_per_step",
    )
    """The fields of the flow section a policy reads (besides `strategy`, which picks the class); the rest are
    the GenerationController's."""

    def __init__(self, flow: FlowConfig, *, num_prompts: int | None = None, max_steps: int | None = None) -> None:
        """A policy with the knobs of `flow` (trusted: `policy_from_config` checks them first). `num_prompts`:
        the data's size (None: unknown until `on_data_exhausted`); `max_steps`: train steps before it finishes."""
        if num_prompts is not None and num_prompts < 0:
            raise ValueError(f"num_prompts must be >= 0 or None (unknown), got {num_prompts}")
        if max_steps is not None and max_steps < 0:
            raise ValueError(f"max_steps must be >= 0 or None (until the data ends), got {max_steps}")
        self.flow = flow
        self.max_steps = max_steps

        self.step = 0  # optimizer steps done: the trainer holds the weights of this step
        self.served_step = 0  # the weights step the generators serve
        self.job: TrainerJob | None = None  # the trainer's outstanding train step or publish
        self.job_groups: dict[int, dict[int, tuple[int, int]]] = {}  # the groups being trained, in batch order
        self.next_prompt = 0  # the data cursor: prompt ids are indices into the data
        self.data_end: int | None = num_prompts
        self.pending: deque[SampleKey] = deque()  # admitted samples waiting for a request slot
        self.in_flight: dict[SampleKey, int] = {}  # -> weights step served at dispatch
        self.done: dict[int, dict[int, tuple[int, int]]] = {}  # prompt -> index -> (oldest, newest) weights step
        self.untrained: dict[int, None] = {}  # admitted prompts not yet handed to the trainer (ordered set)
        self.ready: list[int] = []  # complete groups, in completion order
        self.rewards: dict[int, dict[int, float]] = {}  # dynamic sampling: prompt -> index -> reward, as `done`
        self.filtered: list[int] = []  # prompts dropped by dynamic sampling (zero reward variance), in order
        self.job_dropped = 0  # dropped_groups of the outstanding Train
        self._redo: tuple[tuple[int, ...], int] | None = None  # an interrupted Train to re-issue as it was
        self.finished = False
        self.counters = FlowCounters()

    # -- events --------------------------------------------------------------------------------

    def start(self) -> list[Action]:
        """First actions of a run (also of a resumed one: see `load_state_dict`)."""
        return self._run()

    def _rewind(self) -> None:
        """After a restart nothing is in flight and the trainer is idle: in-flight requests are queued
        again (first) and an interrupted train step gets its batch back, so no prompt is lost or
        trained twice."""
        if self.in_flight:
            keys = list(self.in_flight)
            self.in_flight.clear()
            self.pending.extendleft(reversed(keys))
            self.counters.reissued_samples += len(keys)
        if self.job is not None:
            if isinstance(self.job, TrainJob):
                # Interrupted mid-step: the batch goes back to the head of the buffer, untouched, and is
                # trained again with the dropped-group count it had.
                self._redo = (tuple(self.job_groups), self.job_dropped)
                for pid, group in self.job_groups.items():
                    self.done[pid] = group
                    self.untrained[pid] = None
                self.ready[:0] = list(self.job_groups)
                self.job_groups = {}
            self.job = None

    def on_sample_done(self, sample: SampleDone) -> list[Action]:
        key = (sample.prompt_id, sample.index)
        if key not in self.in_flight:
            raise FlowError(f"sample {key} finished but is not in flight; report each dispatched sample once")
        # During a publish the generators may already serve the new weights before its end is reported.
        newest_possible = self.job.step if isinstance(self.job, PublishJob) else self.served_step
        if sample.oldest_step > sample.newest_step or sample.newest_step > newest_possible:
            raise FlowError(
                f"sample {key} reports weights steps {sample.oldest_step}..{sample.newest_step} but the "
                f"generators serve step {self.served_step}; report the oldest and newest weights step of its tokens"
            )
        if self.flow.dynamic_sampling and sample.reward is None:
            raise FlowError(
                f"sample {key} finished without a reward; flow.dynamic_sampling needs every sample's reward "
                "in SampleDone (the genable's result must carry it)"
            )
        del self.in_flight[key]
        self._check_sample(sample)
        group = self.done.setdefault(sample.prompt_id, {})
        group[sample.index] = (sample.oldest_step, sample.newest_step)
        if self.flow.dynamic_sampling and sample.reward is not None:  # never None here: checked above
            self.rewards.setdefault(sample.prompt_id, {})[sample.index] = float(sample.reward)
        self.counters.completed_samples += 1
        if len(group) == self.flow.samples_per_prompt:
            self._group_complete(sample.prompt_id)
        return self._run()

    def _group_complete(self, pid: int) -> None:
        """A group is judged whenever it becomes complete (again, after re-generated samples)."""
        uniform = self.flow.dynamic_sampling and len(set(self.rewards[pid].values())) == 1
        if uniform and self._refills_left():
            self._filter(pid)
        else:
            self.ready.append(pid)

    def _filter(self, pid: int) -> None:
        """Dynamic sampling drops a zero-variance group for good; the strategy brings in a new prompt."""
        self.done.pop(pid)
        self.rewards.pop(pid)
        self.untrained.pop(pid)
        self.filtered.append(pid)
        self.counters.dropped_groups += 1
        self._replace(pid)

    def on_sample_failed(self, prompt_id: int, index: int) -> list[Action]:
        """A request failed for good (after the controller's retries): generate the sample again."""
        key = (prompt_id, index)
        if key not in self.in_flight:
            raise FlowError(f"sample {key} failed but is not in flight")
        del self.in_flight[key]
        self.pending.appendleft(key)
        self.counters.failed_samples += 1
        return self._run()

    def on_train_done(self, step: int) -> list[Action]:
        if self.job != TrainJob(step):
            raise FlowError(f"train step {step} finished but the trainer's job is {self.job}")
        for group in self.job_groups.values():
            for oldest, _ in group.values():
                lag = step - oldest
                self.counters.staleness[lag] = self.counters.staleness.get(lag, 0) + 1
            self.counters.trained_samples += len(group)
        self.counters.trained_prompts += len(self.job_groups)
        for pid in self.job_groups:
            self.rewards.pop(pid, None)
        self.job = None
        self.job_groups = {}
        self.step = step + 1
        return self._run()

    def on_published(self, step: int) -> list[Action]:
        if self.job != PublishJob(step):
            raise FlowError(f"the weights of step {step} were published but the trainer's job is {self.job}")
        self.job = None
        self.served_step = step
        return self._run()

    def on_data_exhausted(self, num_prompts: int) -> list[Action]:
        """The data holds only `num_prompts` prompts. Dispatches of ids >= num_prompts already handed
        out are void: the driver skips them and the policy forgets them."""
        if self.data_end is not None and num_prompts > self.data_end:
            raise FlowError(f"data exhausted at {num_prompts} but it already ended at {self.data_end}")
        gone = [p for p in self.untrained if p >= num_prompts]
        for p in gone:
            if p in self.done:
                raise FlowError(f"prompt {p} produced samples, so the data cannot end at {num_prompts}")
            del self.untrained[p]
        self.pending = deque(k for k in self.pending if k[0] < num_prompts)
        for key in [k for k in self.in_flight if k[0] >= num_prompts]:
            del self.in_flight[key]
            self.counters.dispatched_samples -= 1
        self._forget_prompts(gone)
        self.data_end = num_prompts
        self.next_prompt = min(self.next_prompt, num_prompts)
        return self._run()

    # -- checkpoint ----------------------------------------------------------------------------

    IDENTITY: ClassVar[tuple[str, ...]] = ("prompts_per_step", "samples_per_prompt", "dynamic_sampling")

    def state_dict(self) -> dict[str, Any]:
        """The policy state as plain JSON-able data (ints, strings, lists, dicts with string keys)."""
        return {
            "strategy": self.strategy,
            "prompts_per_step": self.flow.prompts_per_step,
            "samples_per_prompt": self.flow.samples_per_prompt,
            "dynamic_sampling": self.flow.dynamic_sampling,
            "step": self.step,
            "served_step": self.served_step,
            "job": job_state(self.job),
            "job_groups": [[p, s, o, n] for p, group in self.job_groups.items() for s, (o, n) in group.items()],
            "next_prompt": self.next_prompt,
            "data_end": self.data_end,
            "pending": [list(k) for k in self.pending],
            "in_flight": [[p, s, v] for (p, s), v in self.in_flight.items()],
            "done": [[p, s, o, n] for p, group in self.done.items() for s, (o, n) in group.items()],
            "untrained": list(self.untrained),
            "ready": list(self.ready),
            "rewards": [[p, s, r] for p, group in self.rewards.items() for s, r in group.items()],
            "filtered": list(self.filtered),
            "job_dropped": self.job_dropped,
            "finished": self.finished,
            "counters": self.counters.state(),
            **self._extra_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a state saved by `state_dict` into a fresh policy, then call `start()`. The strategy
        and the group/batch sizes must match the checkpoint; runtime knobs (caps, staleness, timeouts)
        come from the current config. What was in flight is queued again and an interrupted train step
        gets its batch back."""
        if state["strategy"] != self.strategy:
            raise FlowError(
                f"checkpoint flow strategy {state['strategy']!r} differs from flow.strategy {self.strategy!r}; "
                "resume with the checkpoint's strategy"
            )
        for name in self.IDENTITY:
            saved = state.get(name, False)  # checkpoints from before dynamic sampling existed ran without it
            if saved != getattr(self.flow, name):
                raise FlowError(
                    f"checkpoint flow.{name} = {saved} differs from the config's {getattr(self.flow, name)}; "
                    "it defines the run, so resume with the checkpoint's value"
                )
        self.step = state["step"]
        self.served_step = state["served_step"]
        self.job = job_from_state(state["job"])
        self.job_groups = {}
        for p, s, o, n in state["job_groups"]:
            self.job_groups.setdefault(p, {})[s] = (o, n)
        self.next_prompt = state["next_prompt"]
        if state["data_end"] is not None:
            self.data_end = state["data_end"] if self.data_end is None else min(self.data_end, state["data_end"])
        self.pending = deque((p, s) for p, s in state["pending"])
        self.in_flight = {(p, s): v for p, s, v in state["in_flight"]}
        self.done = {}
        for p, s, o, n in state["done"]:
            self.done.setdefault(p, {})[s] = (o, n)
        self.untrained = dict.fromkeys(state["untrained"])
        self.ready = list(state["ready"])
        self.rewards = {}
        for p, s, r in state.get("rewards", []):
            self.rewards.setdefault(p, {})[s] = r
        self.filtered = list(state.get("filtered", []))
        self.job_dropped = state.get("job_dropped", 0)
        # Whether the run is over is decided again by `start()` from the current limits: a finished run resumed
        # with more steps (or more data) goes on, one resumed as it was finishes at once.
        self.finished = False
        self.counters = FlowCounters.from_state(state["counters"])
        self._load_extra_state(state)
        self._rewind()

    def forget_buffered(self, keys: Iterable[SampleKey]) -> None:
        """Finished samples whose results were lost (e.g. not stored in a checkpoint) are generated
        again; call after `load_state_dict`, before `start()`."""
        for p, s in keys:
            group = self.done.get(p)
            if group is None or s not in group:
                raise FlowError(f"sample {(p, s)} is not buffered, so it cannot be forgotten")
            del group[s]
            if not group:
                del self.done[p]
            self._forget_reward(p, s)
            if p in self.ready:
                self.ready.remove(p)
            self.pending.appendleft((p, s))

    # -- queries -------------------------------------------------------------------------------

    def held_keys(self) -> list[SampleKey]:
        """Finished samples whose results the driver must keep: buffered ones and the batch in training."""
        return [(p, s) for groups in (self.done, self.job_groups) for p, group in groups.items() for s in group]

    def sample_steps(self, prompt_id: int) -> list[tuple[int, int]]:
        """(oldest, newest) weights steps of a buffered group's samples, in sample order."""
        group = self.done[prompt_id]
        return [group[s] for s in sorted(group)]

    # -- internals -----------------------------------------------------------------------------

    def _run(self) -> list[Action]:
        if self.finished:
            return []
        actions: list[Action] = []
        self._advance(actions)
        reason = self._finish_reason()
        if reason is not None:
            self.finished = True
            actions.append(Finish(reason))
        return actions

    def _advance(self, actions: list[Action]) -> None:
        raise NotImplementedError

    def _finish_reason(self) -> str | None:
        """Why the run is over, asked once the trainer is idle with its newest weights published: every step
        trained (`max_steps`), or the data used up with nothing left to train (`end_of_data`)."""
        if self.job is not None or self.served_step != self.step:
            return None
        if not self._steps_left():
            return "max_steps"
        return "end_of_data" if self._out_of_data() else None

    def _out_of_data(self) -> bool:
        """The strategy's part of `end_of_data`: no prompt is left to admit, generate or train."""
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def _check_sample(self, sample: SampleDone) -> None:
        pass

    def _forget_prompts(self, prompt_ids: list[int]) -> None:
        pass

    def _refills_left(self) -> bool:
        """Whether dynamic sampling may still drop a group of the batch being formed."""
        raise NotImplementedError

    def _replace(self, pid: int) -> None:
        """Dynamic sampling dropped `pid`'s group (already out of `done` and `untrained`)."""
        raise NotImplementedError

    def _take_dropped(self) -> int:
        """Groups dropped while the batch now handed to the trainer formed (resets per-step counts)."""
        raise NotImplementedError

    def _forget_reward(self, pid: int, index: int) -> None:
        group = self.rewards.get(pid)
        if group is not None:
            group.pop(index, None)
            if not group:
                del self.rewards[pid]

    def _steps_left(self) -> bool:
        return self.max_steps is None or self.step < self.max_steps

    def _data_left(self) -> bool:
        return self.data_end is None or self.next_prompt < self.data_end

    def _generator_idle(self) -> bool:
        return not self.in_flight and not self.pending

    def _admit(self) -> int:
        pid = self.next_prompt
        self.next_prompt += 1
        self.untrained[pid] = None
        self.pending.extend((pid, s) for s in range(self.flow.samples_per_prompt))
        return pid

    def _dispatch(self, actions: list[Action]) -> bool:
        """Start pending samples while request slots are free; the cap holds at every moment. Nothing
        starts during a publish: the generators are paused and would serve the new weights anyway."""
        if isinstance(self.job, PublishJob):
            return False
        started = False
        while self.pending and len(self.in_flight) < self.flow.max_concurrent:
            pid = self.pending[0][0]
            samples: list[int] = []
            while self.pending and self.pending[0][0] == pid and len(self.in_flight) < self.flow.max_concurrent:
                _, s = self.pending.popleft()
                self.in_flight[(pid, s)] = self.served_step
                samples.append(s)
            self.counters.dispatched_samples += len(samples)
            actions.append(Dispatch(pid, tuple(samples), self.served_step))
            started = True
        return started

    def _publish(self, actions: list[Action]) -> None:
        self.job = PublishJob(self.step)
        actions.append(Publish(self.step))

    def _train(self, prompt_ids: list[int], actions: list[Action]) -> None:
        """Hand these complete groups to the trainer (the moment of consumption)."""
        redo, self._redo = self._redo, None
        dropped = redo[1] if redo is not None and redo[0] == tuple(prompt_ids) else self._take_dropped()
        for pid in prompt_ids:
            self.job_groups[pid] = self.done.pop(pid)
            self.untrained.pop(pid, None)
            if pid in self.ready:
                self.ready.remove(pid)
        self.job = TrainJob(self.step)
        self.job_dropped = dropped
        actions.append(Train(self.step, tuple(prompt_ids), dropped))

    def _drop(self, prompt_ids: list[int]) -> None:
        for pid in prompt_ids:
            group = self.done.pop(pid, {})
            self.rewards.pop(pid, None)
            self.untrained.pop(pid, None)
            if pid in self.ready:
                self.ready.remove(pid)
            self.counters.dropped_prompts += 1
            self.counters.dropped_samples += len(group)
