"""The flow-control simulator: drives the same policy objects as the runtime (rollout/flow/policy.py)
through a discrete-event model of one generator pool and one trainer, in simulated time. Generation
is processor sharing: every in-flight request advances at `tokens_per_s(c) / c` tokens per second when
`c` requests are in flight (so the pool's throughput depends on concurrency), a publish pauses the pool
for the weight-sync time (keep mode: requests resume afterwards) and bumps its version, and a train
step occupies the trainer for `overhead + s_per_token * tokens`. Sample lengths come from a seeded
per-(prompt, sample, attempt) lognormal distribution, so a run is reproducible and a re-generated
sample draws a new length. Rewards are modelled only as far as dynamic sampling needs them: a seeded
fraction `uniform_group_rate` of prompts gets the same reward on every sample (a group with no
signal, which dynamic sampling drops and replaces), the others a spread of rewards. It reports
makespan, utilisations, throughput, the staleness histogram, dropped samples and groups
(`SimResult`), rendered as ASCII and as a PNG by sim_report.py; `slipstream simulate` is
simulate_cli.py. Both are re-exported here, the simulator's one import path.
"""

from __future__ import annotations

import heapq
import math
import random
import sys
from dataclasses import dataclass

from rollout.flow.events import Abort, Action, Dispatch, Finish, Publish, SampleDone, SampleKey, Train
from rollout.flow.policy import FlowPolicy
from rollout.flow.sim_report import (
    SimResult,
    Span,
    StepRecord,
    TracePoint,
    ascii_timeline,
    compare_table,
    save_png,
)


class SimulationError(RuntimeError):
    """The policy and the model reached a state with nothing left to happen (a policy bug)."""


# ----------------------------------------------------------------------------------------------
# Model inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The prompts and the lengths of their samples (seeded, lognormal with a cap like max_tokens), and
    which prompts' groups have zero reward variance (seeded, `uniform_group_rate` of them)."""

    num_prompts: int | None = 1280  # None: as many as the run asks for
    median_tokens: float = 1024.0
    sigma: float = 1.0
    prompt_sigma: float = 0.0
    prompt_tokens: int = 512
    max_tokens: int = 16384
    seed: int = 0
    uniform_group_rate: float = 0.0

    def reward(self, prompt_id: int, index: int) -> float:
        """A sample's reward: 0 on every sample of a uniform prompt (too hard or, alike for dynamic
        sampling, too easy), else alternating 0 and 1 over the group, so the group has signal. Per
        prompt, so a re-generated sample keeps its group's kind."""
        if random.Random(f"{self.seed}:uniform:{prompt_id}").random() < self.uniform_group_rate:
            return 0.0
        return float(index % 2)

    def tokens(self, prompt_id: int, index: int, attempt: int) -> int:
        """Generated tokens of one sample; `prompt_sigma` spreads the per-prompt median (hard prompts
        make every sample of their group long), `sigma` spreads the samples of one prompt."""
        median = self.median_tokens
        if self.prompt_sigma > 0:
            median *= math.exp(random.Random(f"{self.seed}:prompt:{prompt_id}").gauss(0.0, self.prompt_sigma))
        rng = random.Random(f"{self.seed}:{prompt_id}:{index}:{attempt}")
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(median), self.sigma))))


@dataclass
class ThroughputModel:
    """Generator pool throughput as a function of concurrency: tokens_per_s(c) = peak * c / (c + half).
    Decoding is memory-bound at low concurrency (one sequence gets peak / (1 + half) tokens/s) and
    saturates towards `peak_tokens_per_s` as the batch grows."""

    peak_tokens_per_s: float = 16000.0
    half_concurrency: float = 128.0

    def tokens_per_s(self, concurrency: int) -> float:
        return self.peak_tokens_per_s * concurrency / (concurrency + self.half_concurrency)

    def per_request(self, concurrency: int) -> float:
        return self.peak_tokens_per_s / (concurrency + self.half_concurrency)


@dataclass
class Costs:
    """Trainer costs: a step is `train_step_overhead_s + train_s_per_token * tokens` (prompt plus
    completion tokens of its samples); a publish takes `sync_s` on the trainer and pauses the pool."""

    train_s_per_token: float = 5e-5
    train_step_overhead_s: float = 2.0
    sync_s: float = 5.0

    def train_s(self, tokens: int) -> float:
        return self.train_step_overhead_s + self.train_s_per_token * tokens


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


class GeneratorPool:
    """The generator model: a processor-sharing pool. All in-flight requests advance equally, so a
    request is done when the pool's cumulative per-request service `level` passes its start level plus
    its length: completions are a heap on that finish level, O(log n) per event. Time is whatever the
    caller passes to `advance` (simulated seconds here; scaled wall-clock seconds in a fake backend)."""

    def __init__(self, model: ThroughputModel) -> None:
        self.model = model
        self.t = 0.0
        self.level = 0.0
        self.version = 0
        self.paused = False
        self.active: dict[SampleKey, tuple[float, int, int]] = {}  # -> (finish level, oldest version, seq)
        self.heap: list[tuple[float, int, SampleKey]] = []
        self.seq = 0
        self.generated = 0.0
        self.busy_s = 0.0

    def advance(self, now: float) -> None:
        dt = now - self.t
        if dt > 0 and self.active and not self.paused:
            c = len(self.active)
            self.level += self.model.per_request(c) * dt
            self.generated += self.model.tokens_per_s(c) * dt
            self.busy_s += dt
        self.t = max(self.t, now)

    def add(self, key: SampleKey, tokens: int) -> None:
        self.seq += 1
        finish = self.level + tokens
        self.active[key] = (finish, self.version, self.seq)
        heapq.heappush(self.heap, (finish, self.seq, key))

    def remove(self, key: SampleKey) -> None:
        del self.active[key]  # its heap entry is skipped lazily

    def _top(self) -> tuple[float, int, SampleKey] | None:
        while self.heap:
            finish, seq, key = self.heap[0]
            entry = self.active.get(key)
            if entry is not None and entry[2] == seq:
                return self.heap[0]
            heapq.heappop(self.heap)
        return None

    def next_time(self) -> float:
        top = self._top()
        if top is None or self.paused:
            return math.inf
        return self.t + max(0.0, top[0] - self.level) / self.model.per_request(len(self.active))

    def pop_finished(self) -> list[tuple[SampleKey, int]]:
        """(key, oldest version) of every request whose finish level is reached, in finish order."""
        out = []
        eps = 1e-9 * max(1.0, self.level)
        while (top := self._top()) is not None and top[0] <= self.level + eps:
            heapq.heappop(self.heap)
            key = top[2]
            out.append((key, self.active.pop(key)[1]))
        return out


def simulate(
    policy: FlowPolicy,
    workload: Workload,
    throughput: ThroughputModel,
    costs: Costs,
    *,
    max_events: int = 50_000_000,
) -> SimResult:
    """Run `policy` to its Finish against the model; deterministic for given inputs."""
    pool = GeneratorPool(throughput)
    spp = policy.samples_per_prompt
    attempts: dict[SampleKey, int] = {}
    lengths: dict[SampleKey, int] = {}
    steps: list[StepRecord] = []
    spans: list[Span] = []
    trace: list[TracePoint] = [TracePoint(0.0, 0, 0, False)]
    job: Train | Publish | None = None
    job_end = math.inf
    finish: Finish | None = None
    trained_completion_tokens = 0

    def mark() -> None:
        point = TracePoint(pool.t, len(pool.active), pool.version, pool.paused)
        last = trace[-1]
        if (last.concurrency, last.version, last.paused) == (point.concurrency, point.version, point.paused):
            return
        if last.t == point.t:
            trace[-1] = point
        else:
            trace.append(point)

    def apply(actions: list[Action]) -> None:
        nonlocal job, job_end, finish, trained_completion_tokens
        for a in actions:
            if isinstance(a, Dispatch):
                if pool.paused:
                    raise SimulationError(f"{policy.strategy} dispatched {a} during a weight sync")
                for s in a.samples:
                    key = (a.prompt_id, s)
                    n = attempts.get(key, 0)
                    attempts[key] = n + 1
                    lengths[key] = workload.tokens(a.prompt_id, s, n)
                    pool.add(key, lengths[key])
            elif isinstance(a, Abort):
                for key in a.keys:
                    pool.remove(key)
            elif isinstance(a, Train):
                completion = sum(lengths[(p, s)] for p in a.prompt_ids for s in range(spp))
                tokens = completion + workload.prompt_tokens * spp * len(a.prompt_ids)
                trained_completion_tokens += completion
                job, job_end = a, pool.t + costs.train_s(tokens)
                steps.append(StepRecord(a.step, pool.t, job_end, a.prompt_ids, tokens))
                spans.append(Span(pool.t, job_end, "train", a.step))
            elif isinstance(a, Publish):
                job, job_end = a, pool.t + costs.sync_s
                pool.paused = True
                spans.append(Span(pool.t, job_end, "sync", a.version))
            elif isinstance(a, Finish):
                finish = a
        mark()

    apply(policy.start())
    for _ in range(max_events):
        if finish is not None:
            break
        t_gen = pool.next_time()
        if t_gen == math.inf and job_end == math.inf:
            raise SimulationError(f"{policy.strategy}: nothing in flight and no trainer job at t={pool.t:.1f}s")
        if t_gen <= job_end:
            pool.advance(t_gen)
            for (p, s), oldest in pool.pop_finished():
                apply(policy.on_sample_done(SampleDone(p, s, oldest, pool.version, workload.reward(p, s))))
        else:
            pool.advance(job_end)
            ended, job, job_end = job, None, math.inf
            assert ended is not None  # job_end is finite only while a job runs
            if isinstance(ended, Train):
                apply(policy.on_train_done(ended.step))
            else:
                pool.version = ended.version
                pool.paused = False
                apply(policy.on_published(ended.version))
    else:
        raise SimulationError(f"{policy.strategy}: no Finish after {max_events} events")
    return SimResult(
        strategy=policy.strategy,
        max_concurrent=policy.max_concurrent,
        makespan=pool.t,
        steps=steps,
        spans=spans,
        trace=trace,
        counters=policy.counters,
        generated_tokens=pool.generated,
        trained_completion_tokens=trained_completion_tokens,
        generator_busy_s=pool.busy_s,
        peak_tokens_per_s=throughput.tokens_per_s(policy.max_concurrent),
        finish_reason=finish.reason,
    )


def cli_main(argv: list[str]) -> int:
    """`slipstream simulate` (common/cli.py delegates here); the command line is simulate_cli.py, which imports
    this module, so it is imported when called."""
    from rollout.flow.simulate_cli import cli_main as main

    return main(argv)


__all__ = [
    "Costs",
    "SimResult",
    "SimulationError",
    "Span",
    "StepRecord",
    "GeneratorPool",
    "ThroughputModel",
    "TracePoint",
    "Workload",
    "ascii_timeline",
    "cli_main",
    "compare_table",
    "save_png",
    "simulate",
]

if __name__ == "__main__":  # pragma: no cover - `slipstream simulate` is the entry point
    raise SystemExit(cli_main(sys.argv[1:]))
