"""The flow strategies (rollout/flow/policy.py holds what they share): the batch-synchronous ones,
on-policy (batch t generated with the weights of step t) and one-step-off (with those of step t - 1, while
batch t - 1 trains), and fully-async (continuous generation under admission control, each sample checked against the
staleness bound when it is consumed, weights published after every step while requests go on or are
aborted and re-issued). `policy_from_config` builds the one `flow.strategy` names."""

from __future__ import annotations

from typing import Any, ClassVar

from common.config import FlowConfig
from rollout.flow.events import Abort, Action, FlowError, PublishJob, SampleDone, SampleKey
from rollout.flow.policy import FlowPolicy

# ----------------------------------------------------------------------------------------------
# Batch-synchronous strategies: on-policy (lag 0) and one-step-off (lag 1)
# ----------------------------------------------------------------------------------------------


class _SyncPolicy(FlowPolicy):
    """Batch b is a set of prompts, all generated with the weights of step max(0, b - lag). The generators
    work on one batch at a time; weights change only while they are idle, so a batch is pure. A group
    dynamic sampling drops leaves its batch and a new prompt joins it, dispatched at once on the batch's
    weights (the generators are still busy with the batch, so its weights cannot have changed)."""

    lag: ClassVar[int] = 0

    def __init__(self, flow: FlowConfig, *, num_prompts: int | None = None, max_steps: int | None = None) -> None:
        super().__init__(flow, num_prompts=num_prompts, max_steps=max_steps)
        self.batches: list[list[int]] = []  # prompt ids of batch b
        self.batch_steps: list[int] = []  # the weights step batch b is generated with
        self.batch_dropped: list[int] = []  # groups of batch b dropped by dynamic sampling
        self.batch_of: dict[int, int] = {}

    def _extra_state(self) -> dict[str, Any]:
        return {
            "batches": [list(b) for b in self.batches],
            "batch_steps": list(self.batch_steps),
            "batch_dropped": list(self.batch_dropped),
        }

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.batches = [list(b) for b in state["batches"]]
        self.batch_steps = list(state["batch_steps"])
        self.batch_dropped = list(state.get("batch_dropped", [0] * len(self.batches)))
        self.batch_of = {p: b for b, batch in enumerate(self.batches) for p in batch}

    def _refills_left(self) -> bool:
        return self.batch_dropped[-1] < self.flow.max_dynamic_refills_per_step

    def _replace(self, pid: int) -> None:
        b = self.batch_of.pop(pid)
        if b != len(self.batches) - 1:
            raise FlowError(
                f"{self.strategy}: prompt {pid} of batch {b} completed while batch {len(self.batches) - 1} is "
                "generated; the generators work on one batch at a time"
            )
        self.batches[b].remove(pid)
        self.batch_dropped[b] += 1
        if self._data_left():
            new = self._admit()
            self.batches[b].append(new)
            self.batch_of[new] = b
        elif not self.batches[b]:
            self._pop_batch()

    def _take_dropped(self) -> int:
        return self.batch_dropped[self.step]

    def _pop_batch(self) -> None:
        self.batches.pop()
        self.batch_steps.pop()
        self.batch_dropped.pop()

    def _check_sample(self, sample: SampleDone) -> None:
        expected = self.batch_steps[self.batch_of[sample.prompt_id]]
        if sample.oldest_step != expected or sample.newest_step != expected:
            raise FlowError(
                f"{self.strategy}: sample {(sample.prompt_id, sample.index)} of batch "
                f"{self.batch_of[sample.prompt_id]} has weights steps {sample.oldest_step}..{sample.newest_step}, "
                f"expected {expected}; weights must not change while a batch is generated"
            )

    def _forget_prompts(self, prompt_ids: list[int]) -> None:
        gone = set(prompt_ids)
        if not gone:
            return
        last = self.batches[-1]
        last[:] = [p for p in last if p not in gone]
        for p in gone:
            self.batch_of.pop(p, None)
        if not last:
            self._pop_batch()

    def _batch_complete(self, b: int) -> bool:
        return all(len(self.done.get(p, ())) == self.flow.samples_per_prompt for p in self.batches[b])

    def _advance(self, actions: list[Action]) -> None:
        while True:
            progressed = False
            if self.job is None:
                if self.step > self.served_step and self._generator_idle():
                    self._publish(actions)
                    progressed = True
                elif self._steps_left() and self.step < len(self.batches) and self._batch_complete(self.step):
                    batch = self.batches[self.step]
                    if len(batch) < self.flow.prompts_per_step and self.flow.end_of_data == "drop":
                        self._drop(batch)
                        for p in batch:
                            self.batch_of.pop(p, None)
                        self._pop_batch()
                    else:
                        self._train(batch, actions)
                    progressed = True
            b = len(self.batches)
            if (
                self._generator_idle()
                and not isinstance(self.job, PublishJob)
                and self._data_left()
                and (self.max_steps is None or b < self.max_steps)
                and self.served_step == max(0, b - self.lag)
            ):
                n = self.flow.prompts_per_step
                if self.data_end is not None:
                    n = min(n, self.data_end - self.next_prompt)
                batch = [self._admit() for _ in range(n)]
                self.batches.append(batch)
                self.batch_steps.append(self.served_step)
                self.batch_dropped.append(0)
                self.batch_of.update((p, b) for p in batch)
                progressed = True
            progressed |= self._dispatch(actions)
            if not progressed:
                return

    def _out_of_data(self) -> bool:
        return not self._data_left() and self._generator_idle() and self.step == len(self.batches)


class OnPolicy(_SyncPolicy):
    """Batch t is generated with the weights of step t only: generate, train, publish, repeat."""

    strategy = "on_policy"
    lag = 0


class OneStepOff(_SyncPolicy):
    """Batch t is generated with the weights of step t-1 (batch 0 with those of step 0) while batch t-1 trains."""

    strategy = "one_step_off"
    lag = 1


# ----------------------------------------------------------------------------------------------
# Fully-async
# ----------------------------------------------------------------------------------------------


class FullyAsync(FlowPolicy):
    """Continuous generation under admission control (in-flight plus buffered prompts never exceed
    `max_untrained_prompts`, in-flight requests never exceed `max_concurrent`). A batch is the first
    `prompts_per_step` complete groups, in completion order, all of whose samples pass the staleness
    check at consumption; a stale sample is re-generated (requeue) or its prompt dropped (drop).
    Weights are published after every step; in-flight requests keep going across the update when
    `partial_rollout` is on and are aborted and re-issued otherwise. A group dynamic sampling drops
    frees its admission slot, which a new prompt takes through the same admission control; the
    refill budget counts the groups dropped since the last batch was handed to the trainer."""

    strategy = "fully_async"

    def __init__(self, flow: FlowConfig, *, num_prompts: int | None = None, max_steps: int | None = None) -> None:
        super().__init__(flow, num_prompts=num_prompts, max_steps=max_steps)
        self.dropped_since_train = 0

    def _extra_state(self) -> dict[str, Any]:
        return {"dropped_since_train": self.dropped_since_train}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.dropped_since_train = state.get("dropped_since_train", 0)

    def _refills_left(self) -> bool:
        return self.dropped_since_train < self.flow.max_dynamic_refills_per_step

    def _replace(self, pid: int) -> None:
        self.dropped_since_train += 1  # the freed admission slot is refilled by `_advance`

    def _take_dropped(self) -> int:
        dropped, self.dropped_since_train = self.dropped_since_train, 0
        return dropped

    def _is_stale(self, oldest: int) -> bool:
        return oldest < self.step - self.flow.max_staleness

    def _sweep_stale(self) -> None:
        """Staleness is checked per sample by the oldest weights step of its tokens. Groups in the buffer are
        checked whenever the trainer's step moves: a sample stale now is stale at any later
        consumption, so deciding early is the same decision made sooner."""
        requeue: list[SampleKey] = []
        for pid in list(self.ready):
            group = self.done[pid]
            stale = sorted(s for s, (oldest, _) in group.items() if self._is_stale(oldest))
            if not stale:
                continue
            self.counters.stale_samples += len(stale)
            if self.flow.stale_policy == "drop":
                self._drop([pid])
                continue
            self.ready.remove(pid)
            for s in stale:
                del group[s]
                self._forget_reward(pid, s)
                requeue.append((pid, s))
        self.counters.requeued_samples += len(requeue)
        self.pending.extendleft(reversed(requeue))  # re-generated before any new prompt

    def _drained(self) -> bool:
        """No sample will ever arrive again: the data is used up and nothing is pending or in flight."""
        return not self._data_left() and self._generator_idle()

    def _may_admit(self) -> bool:
        if not self._data_left() or len(self.untrained) >= self.flow.max_untrained_prompts:
            return False
        if self.max_steps is None:
            return True
        # Enough prompts for the remaining steps are admitted already (dropped ones get replaced).
        planned = self.counters.trained_prompts + len(self.job_groups) + len(self.untrained)
        return planned < self.max_steps * self.flow.prompts_per_step

    def _advance(self, actions: list[Action]) -> None:
        while True:
            progressed = False
            if self.job is None:
                if self.step > self.served_step:
                    if not self.flow.partial_rollout and self.in_flight:
                        keys = tuple(self.in_flight)
                        self.in_flight.clear()
                        self.pending.extendleft(reversed(keys))
                        self.counters.aborted_samples += len(keys)
                        actions.append(Abort(keys))
                    self._publish(actions)
                    progressed = True
                elif self._steps_left():
                    self._sweep_stale()
                    if len(self.ready) >= self.flow.prompts_per_step:
                        self._train(self.ready[: self.flow.prompts_per_step], actions)
                        progressed = True
                    elif self.ready and self._drained() and len(self.ready) == len(self.untrained):
                        if self.flow.end_of_data == "train_partial":
                            self._train(list(self.ready), actions)
                        else:
                            self._drop(list(self.ready))
                        progressed = True
            if not isinstance(self.job, PublishJob):
                while len(self.in_flight) + len(self.pending) < self.flow.max_concurrent and self._may_admit():
                    self._admit()
            progressed |= self._dispatch(actions)
            if not progressed:
                return

    def _out_of_data(self) -> bool:
        return self._drained() and not self.untrained


STRATEGIES: dict[str, type[FlowPolicy]] = {cls.strategy: cls for cls in (OnPolicy, OneStepOff, FullyAsync)}


def policy_from_config(cfg: FlowConfig, *, num_prompts: int | None = None, max_steps: int | None = None) -> FlowPolicy:
    """The policy of `cfg.strategy` on the flow config section, checked first by `FlowConfig.check` (a loaded
    config passed it already; the simulator's and tests' flows are built in code). The constructors
    themselves trust their section."""
    cfg.check()
    return STRATEGIES[cfg.strategy](cfg, num_prompts=num_prompts, max_steps=max_steps)
