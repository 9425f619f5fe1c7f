"""Flow policies as specifications: hand-computed event sequences per strategy, then seeded random
drivers that check the invariants (caps, staleness, weights steps, exactly-once across a resume), with
and without dynamic sampling."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import pytest

from common.config import ConfigError, FlowConfig, load_config
from rollout.flow.events import Abort, Dispatch, Finish, FlowError, Publish, SampleDone, Train
from rollout.flow.policy import FlowPolicy
from rollout.flow.strategies import OneStepOff, OnPolicy, policy_from_config


def policy(strategy: str, *, num_prompts: int | None = None, max_steps: int | None = None, **knobs) -> FlowPolicy:
    """The policy of a strategy on a flow section of these knobs (the rest at their defaults), as a run builds it."""
    return policy_from_config(FlowConfig(strategy=strategy, **knobs), num_prompts=num_prompts, max_steps=max_steps)


# Fully-async batches of one prompt of one sample, two prompts admitted and in flight at most.
ONE_BY_TWO = {"prompts_per_step": 1, "samples_per_prompt": 1, "max_concurrent": 2, "max_untrained_prompts": 2}


def done(p: int, s: int = 0, oldest: int = 0, newest: int | None = None, reward: float | None = None) -> SampleDone:
    return SampleDone(p, s, oldest, oldest if newest is None else newest, reward)


# ----------------------------------------------------------------------------------------------
# Hand-computed sequences
# ----------------------------------------------------------------------------------------------


def test_on_policy_generates_batch_t_with_the_weights_of_step_t_then_trains_then_publishes():
    pol = policy("on_policy", prompts_per_step=2, samples_per_prompt=1, max_concurrent=4, num_prompts=4)
    assert pol.start() == [Dispatch(0, (0,), 0), Dispatch(1, (0,), 0)]
    assert pol.on_sample_done(done(1)) == []
    assert pol.on_sample_done(done(0)) == [Train(0, (0, 1))]
    assert pol.on_train_done(0) == [Publish(1)]
    assert pol.on_published(1) == [Dispatch(2, (0,), 1), Dispatch(3, (0,), 1)]
    assert pol.on_sample_done(done(2, oldest=1)) == []
    assert pol.on_sample_done(done(3, oldest=1)) == [Train(1, (2, 3))]
    assert pol.on_train_done(1) == [Publish(2)]
    assert pol.on_published(2) == [Finish("end_of_data")]
    assert pol.counters.staleness == {0: 4}


def test_one_step_off_weights_steps_are_0_0_1_and_training_overlaps_generation():
    pol = policy("one_step_off", prompts_per_step=1, samples_per_prompt=1, max_concurrent=4, num_prompts=3)
    assert pol.start() == [Dispatch(0, (0,), 0)]
    # Batch 1 starts on the weights of step 0 while batch 0 trains.
    assert pol.on_sample_done(done(0)) == [Train(0, (0,)), Dispatch(1, (0,), 0)]
    assert pol.on_train_done(0) == []  # batch 1 still generating: weights must not change under it
    assert pol.on_sample_done(done(1)) == [Publish(1)]
    assert pol.on_published(1) == [Train(1, (1,)), Dispatch(2, (0,), 1)]
    assert pol.on_train_done(1) == []
    assert pol.on_sample_done(done(2, oldest=1)) == [Publish(2)]
    assert pol.on_published(2) == [Train(2, (2,))]
    assert pol.on_train_done(2) == [Publish(3)]
    assert pol.on_published(3) == [Finish("end_of_data")]
    assert pol.batch_steps == [0, 0, 1]
    assert pol.counters.staleness == {0: 1, 1: 2}


def test_sync_policy_rejects_a_sample_made_by_the_wrong_weights():
    pol = policy("on_policy", prompts_per_step=1, samples_per_prompt=1, num_prompts=2)
    pol.start()
    pol.on_sample_done(done(0))
    pol.on_train_done(0)
    pol.on_published(1)
    with pytest.raises(FlowError, match="expected 1"):
        pol.on_sample_done(done(1, oldest=0, newest=1))


def test_max_concurrent_caps_requests_and_waves_refill_freed_slots():
    pol = policy("on_policy", prompts_per_step=2, samples_per_prompt=3, max_concurrent=4, num_prompts=2)
    assert pol.start() == [Dispatch(0, (0, 1, 2), 0), Dispatch(1, (0,), 0)]
    assert pol.on_sample_done(done(0, 1)) == [Dispatch(1, (1,), 0)]
    assert pol.on_sample_done(done(1, 0)) == [Dispatch(1, (2,), 0)]
    assert len(pol.in_flight) == 4


def test_fully_async_requeues_a_sample_stale_at_consumption():
    pol = policy("fully_async", **ONE_BY_TWO, max_staleness=0)
    assert pol.start() == [Dispatch(0, (0,), 0), Dispatch(1, (0,), 0)]
    # Prompt 0 is consumed, which frees an admission slot for prompt 2.
    assert pol.on_sample_done(done(0)) == [Train(0, (0,)), Dispatch(2, (0,), 0)]
    assert pol.on_train_done(0) == [Publish(1)]
    assert pol.on_sample_done(done(1)) == []  # nothing starts while weights change
    # At step 1 with max_staleness 0, prompt 1 (oldest token from step 0) is stale: re-generated.
    assert pol.on_published(1) == [Dispatch(1, (0,), 1)]
    # Prompt 2 started on the weights of step 0 and finished on step 1's (partial rollout): its oldest token
    # makes it stale.
    assert pol.on_sample_done(done(2, oldest=0, newest=1)) == [Dispatch(2, (0,), 1)]
    assert pol.on_sample_done(done(1, oldest=1)) == [Train(1, (1,)), Dispatch(3, (0,), 1)]
    assert pol.counters.stale_samples == 2 and pol.counters.requeued_samples == 2
    assert pol.counters.dropped_prompts == 0


def test_fully_async_drop_policy_drops_the_stale_prompt_and_admits_another():
    pol = policy("fully_async", **ONE_BY_TWO, max_staleness=0, stale_policy="drop")
    pol.start()
    pol.on_sample_done(done(0))
    pol.on_train_done(0)
    pol.on_sample_done(done(1))
    assert pol.on_published(1) == [Dispatch(3, (0,), 1)]
    assert pol.counters.dropped_prompts == 1 and pol.counters.dropped_samples == 1
    assert 1 not in pol.untrained


def test_fully_async_without_partial_rollout_aborts_in_flight_and_reissues_after_publish():
    pol = policy("fully_async", **ONE_BY_TWO, partial_rollout=False)
    pol.start()
    pol.on_sample_done(done(0))
    assert pol.on_train_done(0) == [Abort(((1, 0), (2, 0))), Publish(1)]
    assert pol.on_published(1) == [Dispatch(1, (0,), 1), Dispatch(2, (0,), 1)]
    assert pol.counters.aborted_samples == 2


def test_fully_async_trains_the_partial_last_batch_at_end_of_data():
    pol = policy(
        "fully_async",
        prompts_per_step=2,
        samples_per_prompt=1,
        max_concurrent=4,
        max_untrained_prompts=4,
        num_prompts=3,
    )
    assert pol.start() == [Dispatch(0, (0,), 0), Dispatch(1, (0,), 0), Dispatch(2, (0,), 0)]
    pol.on_sample_done(done(2))
    assert pol.on_sample_done(done(0)) == [Train(0, (2, 0))]  # completion order, not prompt order
    assert pol.on_sample_done(done(1)) == []
    assert pol.on_train_done(0) == [Publish(1)]
    assert pol.on_published(1) == [Train(1, (1,))]
    assert pol.on_train_done(1) == [Publish(2)]
    assert pol.on_published(2) == [Finish("end_of_data")]


def test_end_of_data_drop_discards_the_partial_last_batch():
    pol = policy("on_policy", prompts_per_step=2, samples_per_prompt=1, num_prompts=3, end_of_data="drop")
    pol.start()
    pol.on_sample_done(done(0))
    pol.on_sample_done(done(1))
    pol.on_train_done(0)
    assert pol.on_published(1) == [Dispatch(2, (0,), 1)]
    assert pol.on_sample_done(done(2, oldest=1)) == [Finish("end_of_data")]
    assert pol.counters.dropped_prompts == 1 and pol.counters.trained_prompts == 2


def test_data_exhausted_event_voids_prompts_past_the_end():
    pol = policy("on_policy", prompts_per_step=2, samples_per_prompt=1)
    pol.start()
    pol.on_sample_done(done(0))
    pol.on_sample_done(done(1))
    pol.on_train_done(0)
    assert pol.on_published(1) == [Dispatch(2, (0,), 1), Dispatch(3, (0,), 1)]
    # The driver found no prompt 3: the last batch is {2} and trains partially.
    assert pol.on_data_exhausted(3) == []
    assert pol.on_sample_done(done(2, oldest=1)) == [Train(1, (2,))]
    pol.on_train_done(1)
    assert pol.on_published(2) == [Finish("end_of_data")]


def test_max_steps_finishes_after_the_last_publish():
    pol = policy(
        "fully_async", prompts_per_step=1, samples_per_prompt=1, max_concurrent=1, max_untrained_prompts=2, max_steps=1
    )
    assert pol.start() == [Dispatch(0, (0,), 0)]
    assert pol.on_sample_done(done(0)) == [Train(0, (0,))]  # one step needs one prompt: no more admitted
    assert pol.on_train_done(0) == [Publish(1)]
    assert pol.on_published(1) == [Finish("max_steps")]


def test_events_that_break_the_contract_name_the_problem():
    pol = policy("on_policy", prompts_per_step=1, samples_per_prompt=1, num_prompts=1)
    pol.start()
    with pytest.raises(FlowError, match=r"\(5, 0\).*not in flight"):
        pol.on_sample_done(done(5))
    with pytest.raises(FlowError, match="train step 0 finished"):
        pol.on_train_done(0)


def test_from_config_builds_the_configured_strategy_and_rejects_bad_knobs():
    pol = policy_from_config(FlowConfig(strategy="one_step_off", prompts_per_step=3), num_prompts=9)
    assert isinstance(pol, OneStepOff) and pol.flow.prompts_per_step == 3 and pol.data_end == 9
    with pytest.raises(ConfigError, match="max_untrained_prompts"):
        policy_from_config(FlowConfig(prompts_per_step=8, max_untrained_prompts=4))
    with pytest.raises(ConfigError, match="stale_policy"):
        policy_from_config(FlowConfig(stale_policy="keep"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"flow\.strategy: 'sync' is not one of"):
        policy_from_config(FlowConfig(strategy="sync"))  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------
# Seeded random drivers: invariants
# ----------------------------------------------------------------------------------------------


@dataclass
class Driver:
    """Executes a policy's actions with random completion orders: samples finish in random order, the
    trainer's job ends at random moments, weights change only when a publish ends."""

    policy: FlowPolicy
    rng: random.Random
    weights_step: int = 0
    in_flight: dict = field(default_factory=dict)  # key -> weights step at start
    finished_meta: dict = field(default_factory=dict)  # key -> oldest weights step of the sample
    job: object = None
    trained: list = field(default_factory=list)  # (step, prompt ids), in order of train end
    batch_oldest: dict = field(default_factory=dict)  # step -> oldest weights steps of its samples
    max_in_flight: int = 0
    max_untrained: int = 0
    finish: Finish | None = None
    reward: object = None  # (prompt id, sample index) -> reward, for dynamic sampling
    trains: list = field(default_factory=list)  # every Train action, in order
    dropped_at_train: list = field(default_factory=list)  # the policy's dropped_groups count at each Train

    def apply(self, actions: list) -> None:
        pol = self.policy
        for a in actions:
            if isinstance(a, Dispatch):
                assert not isinstance(self.job, Publish), "dispatch during a publish"
                for s in a.samples:
                    self.in_flight[(a.prompt_id, s)] = self.weights_step
            elif isinstance(a, Abort):
                for k in a.keys:
                    del self.in_flight[k]
            elif isinstance(a, (Train, Publish)):
                assert self.job is None, "two trainer jobs at once"
                self.job = a
                if isinstance(a, Train):
                    self.trains.append(a)
                    self.dropped_at_train.append(pol.counters.dropped_groups)
                    spp = pol.flow.samples_per_prompt
                    self.batch_oldest[a.step] = [self.finished_meta[(p, s)] for p in a.prompt_ids for s in range(spp)]
            elif isinstance(a, Finish):
                self.finish = a
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))
        self.max_untrained = max(self.max_untrained, len(pol.untrained))

    def step(self) -> None:
        pol = self.policy
        if self.in_flight and (self.job is None or self.rng.random() < 0.7):
            key = self.rng.choice(sorted(self.in_flight))
            oldest = self.in_flight.pop(key)
            self.finished_meta[key] = oldest
            reward = None if self.reward is None else self.reward(*key)
            self.apply(pol.on_sample_done(SampleDone(key[0], key[1], oldest, self.weights_step, reward)))
        elif isinstance(self.job, Train):
            job, self.job = self.job, None
            self.trained.append((job.step, job.prompt_ids))
            self.apply(pol.on_train_done(job.step))
        elif isinstance(self.job, Publish):
            job, self.job = self.job, None
            self.weights_step = job.step
            self.apply(pol.on_published(job.step))
        else:
            raise AssertionError(f"deadlock: nothing in flight and no trainer job; policy state {pol.state_dict()}")

    def run(self, max_events: int = 100_000) -> None:
        self.apply(self.policy.start())
        for _ in range(max_events):
            if self.finish is not None:
                return
            self.step()
        raise AssertionError("the run did not finish")


def make(strategy: str, **knobs) -> FlowPolicy:
    """The random drivers' policy: three prompts of two samples a step, five in flight, then `knobs`."""
    base = dict(prompts_per_step=3, samples_per_prompt=2, max_concurrent=5, max_untrained_prompts=7, max_staleness=1)
    return policy(strategy, **(base | knobs))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("strategy,lag", [("on_policy", 0), ("one_step_off", 1)])
def test_sync_strategies_weights_step_sequence_and_exactly_once(strategy, lag, seed):
    pol = make(strategy, num_prompts=20)
    d = Driver(pol, random.Random(seed))
    d.run()
    assert d.finish == Finish("end_of_data")
    assert [step for step, _ in d.trained] == list(range(7))
    for step, oldest in d.batch_oldest.items():
        assert set(oldest) == {max(0, step - lag)}, f"batch {step} weights steps {set(oldest)}"
    trained = sorted(p for _, ids in d.trained for p in ids)
    assert trained == list(range(20))
    assert d.max_in_flight <= 5


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("partial_rollout", [True, False])
def test_fully_async_caps_and_staleness_bound_hold_and_every_prompt_trains_once(max_staleness, partial_rollout, seed):
    pol = make("fully_async", num_prompts=25, max_staleness=max_staleness, partial_rollout=partial_rollout)
    d = Driver(pol, random.Random(seed))
    d.run()
    assert d.finish == Finish("end_of_data")
    assert d.max_in_flight <= 5
    assert d.max_untrained <= 7
    for step, oldest in d.batch_oldest.items():
        assert min(oldest) >= step - max_staleness, f"step {step} consumed weights steps {oldest}"
    trained = sorted(p for _, ids in d.trained for p in ids)
    assert trained == list(range(25))
    assert sum(pol.counters.staleness.values()) == 25 * 2
    assert max(pol.counters.staleness) <= max_staleness


@pytest.mark.parametrize("seed", range(6))
def test_fully_async_drop_policy_trains_each_prompt_at_most_once_and_counts_the_rest(seed):
    pol = make("fully_async", num_prompts=25, max_staleness=0, stale_policy="drop")
    d = Driver(pol, random.Random(seed))
    d.run()
    trained = [p for _, ids in d.trained for p in ids]
    assert len(trained) == len(set(trained))
    assert len(trained) + pol.counters.dropped_prompts == 25
    assert pol.counters.trained_prompts == len(trained)


@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("strategy", ["on_policy", "one_step_off", "fully_async"])
def test_resume_from_a_saved_state_loses_and_duplicates_no_prompt(strategy, seed):
    rng = random.Random(seed)
    pol = make(strategy, num_prompts=22)
    d = Driver(pol, rng)
    d.apply(pol.start())
    for _ in range(rng.randrange(5, 60)):
        if d.finish:
            break
        d.step()
    state = json.loads(json.dumps(pol.state_dict()))  # a checkpoint is plain data
    before = [ids for _, ids in d.trained]

    # A new process: fresh policy from the config, the saved state, a driver with nothing in flight.
    pol2 = make(strategy, num_prompts=22)
    pol2.load_state_dict(state)
    d2 = Driver(pol2, random.Random(seed + 100), weights_step=pol2.served_step, finished_meta=dict(d.finished_meta))
    d2.run()
    after = [ids for _, ids in d2.trained]
    trained = sorted(p for ids in before + after for p in ids)
    assert trained == list(range(22))


def test_load_state_refuses_a_different_group_size():
    pol = make("fully_async")
    state = pol.state_dict()
    other = make("fully_async", samples_per_prompt=4)
    with pytest.raises(FlowError, match="samples_per_prompt"):
        other.load_state_dict(state)


# States of the on-policy run of `tiny_on_policy` as checkpoints hold them: step 0 training prompts 0 and 1,
# then the weights of step 1 publishing.
_COUNTERS = {
    "dispatched_samples": 2,
    "completed_samples": 2,
    "failed_samples": 0,
    "aborted_samples": 0,
    "reissued_samples": 0,
    "trained_prompts": 0,
    "trained_samples": 0,
    "stale_samples": 0,
    "requeued_samples": 0,
    "dropped_prompts": 0,
    "dropped_samples": 0,
    "dropped_groups": 0,
    "staleness": {},
}
SAVED_MID_TRAIN = {
    "strategy": "on_policy",
    "prompts_per_step": 2,
    "samples_per_prompt": 1,
    "dynamic_sampling": False,
    "step": 0,
    "served_step": 0,
    "job": ["train", 0],
    "job_groups": [[0, 0, 0, 0], [1, 0, 0, 0]],
    "next_prompt": 2,
    "data_end": 4,
    "pending": [],
    "in_flight": [],
    "done": [],
    "untrained": [],
    "ready": [],
    "rewards": [],
    "filtered": [],
    "job_dropped": 0,
    "finished": False,
    "counters": _COUNTERS,
    "batches": [[0, 1]],
    "batch_steps": [0],
    "batch_dropped": [0],
}
SAVED_MID_PUBLISH = {
    **SAVED_MID_TRAIN,
    "step": 1,
    "job": ["publish", 1],
    "job_groups": [],
    "counters": {**_COUNTERS, "trained_prompts": 2, "trained_samples": 2, "staleness": {"0": 2}},
}


def tiny_on_policy() -> OnPolicy:
    return policy("on_policy", prompts_per_step=2, samples_per_prompt=1, max_concurrent=4, num_prompts=4)


def test_the_trainer_job_is_saved_as_a_kind_and_a_number_as_checkpoints_always_held_it():
    pol = tiny_on_policy()
    pol.start()
    assert pol.state_dict()["job"] is None
    pol.on_sample_done(done(1))
    pol.on_sample_done(done(0))
    assert json.loads(json.dumps(pol.state_dict())) == SAVED_MID_TRAIN
    pol.on_train_done(0)
    assert json.loads(json.dumps(pol.state_dict())) == SAVED_MID_PUBLISH


def test_a_checkpoint_saved_mid_train_step_trains_the_same_batch_again():
    pol = tiny_on_policy()
    pol.load_state_dict(json.loads(json.dumps(SAVED_MID_TRAIN)))
    assert pol.start() == [Train(0, (0, 1))]
    assert pol.on_train_done(0) == [Publish(1)]
    assert pol.counters.staleness == {0: 2}


def test_a_checkpoint_saved_mid_publish_publishes_the_same_weights_again():
    pol = tiny_on_policy()
    pol.load_state_dict(json.loads(json.dumps(SAVED_MID_PUBLISH)))
    assert pol.start() == [Publish(1)]
    assert pol.on_published(1) == [Dispatch(2, (0,), 1), Dispatch(3, (0,), 1)]


def test_load_state_refuses_a_trainer_job_that_is_neither_train_nor_publish():
    with pytest.raises(FlowError, match=r"job \['eval', 0\]"):
        tiny_on_policy().load_state_dict({**SAVED_MID_TRAIN, "job": ["eval", 0]})


# ----------------------------------------------------------------------------------------------
# Dynamic sampling
# ----------------------------------------------------------------------------------------------


def test_on_policy_drops_a_uniform_group_and_generates_a_new_prompt_for_the_same_batch():
    pol = policy(
        "on_policy", prompts_per_step=2, samples_per_prompt=2, max_concurrent=4, num_prompts=4, dynamic_sampling=True
    )
    assert pol.start() == [Dispatch(0, (0, 1), 0), Dispatch(1, (0, 1), 0)]
    assert pol.on_sample_done(done(0, 0, reward=1.0)) == []
    # Prompt 0's rewards are all 1: no signal. Prompt 2 replaces it in batch 0, on the weights of step 0.
    assert pol.on_sample_done(done(0, 1, reward=1.0)) == [Dispatch(2, (0, 1), 0)]
    assert pol.on_sample_done(done(1, 0, reward=0.0)) == []
    assert pol.on_sample_done(done(1, 1, reward=1.0)) == []
    assert pol.on_sample_done(done(2, 0, reward=1.0)) == []
    assert pol.on_sample_done(done(2, 1, reward=0.5)) == [Train(0, (1, 2), dropped_groups=1)]
    assert pol.on_train_done(0) == [Publish(1)]
    assert pol.on_published(1) == [Dispatch(3, (0, 1), 1)]
    pol.on_sample_done(done(3, 0, oldest=1, reward=0.0))
    # The data is used up: the uniform prompt 3 is dropped unreplaced and its empty batch never trains.
    assert pol.on_sample_done(done(3, 1, oldest=1, reward=0.0)) == [Finish("end_of_data")]
    assert pol.filtered == [0, 3] and pol.counters.dropped_groups == 2
    assert pol.counters.trained_prompts == 2 and pol.counters.dropped_prompts == 0


def test_one_step_off_replaces_a_uniform_group_on_its_batchs_weights():
    """One-step-off replaces a uniform group on the batch's own weights while the previous batch trains."""
    pol = policy(
        "one_step_off", prompts_per_step=1, samples_per_prompt=2, max_concurrent=4, num_prompts=4, dynamic_sampling=True
    )
    assert pol.start() == [Dispatch(0, (0, 1), 0)]
    pol.on_sample_done(done(0, 0, reward=0.0))
    assert pol.on_sample_done(done(0, 1, reward=1.0)) == [Train(0, (0,)), Dispatch(1, (0, 1), 0)]
    pol.on_sample_done(done(1, 0, reward=0.0))
    # Batch 1 is generated with the weights of step 0 (t - 1): so is the prompt that replaces its uniform group.
    assert pol.on_sample_done(done(1, 1, reward=0.0)) == [Dispatch(2, (0, 1), 0)]
    assert pol.on_train_done(0) == []  # batch 1 is still generating: weights must not change under it
    pol.on_sample_done(done(2, 0, reward=0.0))
    assert pol.on_sample_done(done(2, 1, reward=1.0)) == [Publish(1)]
    assert pol.on_published(1) == [Train(1, (2,), dropped_groups=1), Dispatch(3, (0, 1), 1)]
    assert pol.batches == [[0], [2], [3]] and pol.batch_steps == [0, 0, 1]


def test_fully_async_admits_the_replacement_through_admission_control():
    pol = policy(
        "fully_async",
        prompts_per_step=1,
        samples_per_prompt=2,
        max_concurrent=4,
        max_untrained_prompts=2,
        dynamic_sampling=True,
    )
    assert pol.start() == [Dispatch(0, (0, 1), 0), Dispatch(1, (0, 1), 0)]
    pol.on_sample_done(done(0, 0, reward=1.0))
    # Prompt 0 is dropped, which frees its admission slot (2 untrained at most) for prompt 2.
    assert pol.on_sample_done(done(0, 1, reward=1.0)) == [Dispatch(2, (0, 1), 0)]
    assert list(pol.untrained) == [1, 2]
    pol.on_sample_done(done(1, 0, reward=0.0))
    assert pol.on_sample_done(done(1, 1, reward=1.0)) == [Train(0, (1,), dropped_groups=1), Dispatch(3, (0, 1), 0)]
    assert pol.on_train_done(0) == [Publish(1)]
    assert pol.filtered == [0] and pol.counters.dropped_groups == 1


def test_dynamic_sampling_needs_rewards_and_groups_of_two_or_more():
    pol = policy("on_policy", prompts_per_step=1, samples_per_prompt=2, num_prompts=1, dynamic_sampling=True)
    pol.start()
    with pytest.raises(FlowError, match="without a reward"):
        pol.on_sample_done(done(0, 0))
    with pytest.raises(ConfigError, match="samples_per_prompt >= 2"):
        policy_from_config(FlowConfig(strategy="on_policy", samples_per_prompt=1, dynamic_sampling=True))
    with pytest.raises(ConfigError, match="samples_per_prompt >= 2"):
        load_config(None, ["flow.dynamic_sampling=true", "flow.samples_per_prompt=1"], environ={})
    with pytest.raises(ConfigError, match="max_dynamic_refills_per_step must be >= 1"):
        load_config(None, ["flow.max_dynamic_refills_per_step=0"], environ={})


def test_load_state_refuses_a_checkpoint_with_dynamic_sampling_switched():
    state = make("fully_async").state_dict()
    with pytest.raises(FlowError, match="dynamic_sampling"):
        make("fully_async", dynamic_sampling=True).load_state_dict(state)


def steps_apart(totals: list[int]) -> list[int]:
    return [b - a for a, b in zip([0, *totals], totals, strict=False)]


def uniform_rewards(seed: int, rate: float):
    """Rewards where a seeded `rate` of prompts get 0 on every sample and the rest 0, 1, 0, ..."""

    def is_uniform(p: int) -> bool:
        return random.Random(f"{seed}:{p}").random() < rate

    def reward(p: int, s: int) -> float:
        return 0.0 if is_uniform(p) else float(s % 2)

    return reward, is_uniform


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("strategy", ["on_policy", "one_step_off", "fully_async"])
def test_dynamic_sampling_trains_full_batches_of_signal_and_every_prompt_at_most_once(strategy, seed):
    reward, is_uniform = uniform_rewards(seed, 0.4)
    pol = make(strategy, num_prompts=40, dynamic_sampling=True, max_staleness=1)
    d = Driver(pol, random.Random(seed), reward=reward)
    d.run()
    assert d.finish == Finish("end_of_data")
    trained = [p for _, ids in d.trained for p in ids]
    assert len(trained) == len(set(trained)), "a prompt was trained twice"
    assert not set(trained) & set(pol.filtered), "a dropped prompt was trained"
    # Every prompt is trained or dropped, and exactly the uniform ones are dropped.
    assert sorted(trained + pol.filtered) == list(range(40))
    assert set(pol.filtered) == {p for p in range(40) if is_uniform(p)}
    assert pol.counters.dropped_groups == len(pol.filtered) > 0
    # Each step reports the groups dropped since the previous one (the rest fell after the last step).
    assert [t.dropped_groups for t in d.trains] == steps_apart(d.dropped_at_train)
    # Full batches (only the last one may be short: the data ended), each group with signal.
    assert all(len(t.prompt_ids) == 3 for t in d.trains[:-1])
    for t in d.trains:
        assert all(len({reward(p, s) for s in range(2)}) == 2 for p in t.prompt_ids)
    assert d.max_in_flight <= 5
    if strategy == "fully_async":
        assert d.max_untrained <= 7
        for step, oldest in d.batch_oldest.items():
            assert min(oldest) >= step - 1, f"step {step} consumed weights steps {oldest}"
    else:
        lag = 0 if strategy == "on_policy" else 1
        for step, oldest in d.batch_oldest.items():
            assert set(oldest) == {max(0, step - lag)}, f"batch {step} weights steps {set(oldest)}"


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("strategy", ["on_policy", "one_step_off", "fully_async"])
def test_the_refill_budget_ends_the_refill_loop_when_every_group_is_uniform(strategy, seed):
    reward, _ = uniform_rewards(seed, 1.0)
    pol = make(strategy, max_steps=4, dynamic_sampling=True, max_dynamic_refills_per_step=2)
    d = Driver(pol, random.Random(seed), reward=reward)
    d.run()
    # Data never ends here: without the budget this run would refill forever.
    assert d.finish == Finish("max_steps")
    assert [len(t.prompt_ids) for t in d.trains] == [3, 3, 3, 3]
    dropped = [t.dropped_groups for t in d.trains]
    if strategy == "fully_async":  # groups buffered past the budget may fill the next batch at once
        assert all(n <= 2 for n in dropped)
    else:
        assert dropped == [2, 2, 2, 2]
    assert pol.counters.dropped_groups == len(pol.filtered) >= sum(dropped)
    assert dropped == steps_apart(d.dropped_at_train)
    trained = [p for _, ids in d.trained for p in ids]
    assert len(trained) == len(set(trained)) and not set(trained) & set(pol.filtered)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("strategy", ["on_policy", "one_step_off", "fully_async"])
def test_dynamic_sampling_state_round_trip_mid_run_gives_the_same_rest_of_the_run(strategy, seed):
    reward, _ = uniform_rewards(seed, 0.4)
    # Without partial rollout every request in flight runs the current weights, so re-issuing it after
    # the restore changes nothing: the resumed run must be the very same run.
    knobs = dict(num_prompts=30, dynamic_sampling=True, partial_rollout=False)
    pol = make(strategy, **knobs)
    d = Driver(pol, random.Random(seed), reward=reward)
    d.apply(pol.start())
    rng = random.Random(seed + 1000)
    for _ in range(rng.randrange(5, 50)):
        if d.finish:
            break
        d.step()
    if d.finish:
        pytest.skip("the run ended before the snapshot")
    state = json.loads(json.dumps(pol.state_dict()))
    trains_before = len(d.trains) - (1 if isinstance(d.job, Train) else 0)  # an open Train is issued again
    trained_before = len(d.trained)

    pol2 = make(strategy, **knobs)
    pol2.load_state_dict(state)
    rng2 = random.Random()
    rng2.setstate(d.rng.getstate())
    d2 = Driver(pol2, rng2, weights_step=d.weights_step, finished_meta=dict(d.finished_meta), reward=reward)
    d2.apply(pol2.start())
    assert d2.in_flight == d.in_flight and d2.job == d.job

    d.run()
    d2.run()
    assert d2.trains == d.trains[trains_before:]
    assert d2.trained == d.trained[trained_before:]
    assert pol2.filtered == pol.filtered
    assert pol2.counters.dropped_groups == pol.counters.dropped_groups
    assert pol2.counters.staleness == pol.counters.staleness
