"""The flow-control simulator: drives the same policy objects as the runtime (rollout/flow/policy.py)
through a discrete-event model of a generator pool and one trainer, in simulated time. The pool is
`workers` identical workers, each processor sharing: every request decoding on a worker advances at
`tokens_per_s(c) / c` tokens per second when `c` requests are on it (so throughput depends on
concurrency); a request spends a fixed `latency_s` on its worker before its first token. A sample is an
episode of one or more turns (`EpisodeModel`), each turn one request: the first goes to the worker with the
fewest requests (the router's least-outstanding choice; its group affinity is left out), the later ones
back to that worker (beside their prefix cache; a run records one worker per episode), and between two
turns the episode waits for a tool call (the environment's step), holding no place on its worker but still
in flight at the controller. A publish occupies the trainer for the weight-sync time and
pauses the pool for the last `pause_s` of it (keep mode: requests resume afterwards; tool calls go on),
then serves the new weights; a train step occupies the trainer for `overhead + s_per_token * tokens`.
Sample lengths come from a seeded per-(prompt, sample, attempt) lognormal distribution, or a measured
list of lengths, and an episode's turns and tool-call times from a seeded draw of the same key, so a run
is reproducible and a re-generated sample draws anew. Rewards are modelled only as far as dynamic
sampling needs them: a seeded fraction `uniform_group_rate` of prompts gets the same reward on every
sample (a group with no signal, which dynamic sampling drops and replaces), the others a spread of
rewards. It reports makespan, utilisations, throughput, the staleness histogram, dropped samples and
groups and every completed episode (`SimResult`), rendered as ASCII and as a PNG by report.py;
`slipstream simulate` is cli.py (a model fitted to a real run: calibrate.py).
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from rollout.flow.events import Abort, Action, Dispatch, Finish, Publish, SampleDone, SampleKey, Train
from rollout.flow.policy import FlowPolicy
from rollout.flow.sim.report import (
    SampleRecord,
    SimResult,
    Span,
    StepRecord,
    TracePoint,
)


class SimulationError(RuntimeError):
    """The policy and the model reached a state with nothing left to happen (a policy bug)."""


# ----------------------------------------------------------------------------------------------
# Model inputs
# ----------------------------------------------------------------------------------------------


@dataclass
class Workload:
    """The prompts and the lengths of their samples (seeded: lognormal with a cap like max_tokens, or drawn
    from measured `lengths`), and which prompts' groups have zero reward variance (seeded,
    `uniform_group_rate` of them)."""

    num_prompts: int | None = 1280  # None: as many as the run asks for
    median_tokens: float = 1024.0
    sigma: float = 1.0
    prompt_sigma: float = 0.0
    prompt_tokens: int = 512
    max_tokens: int = 16384
    seed: int = 0
    uniform_group_rate: float = 0.0
    lengths: tuple[int, ...] = ()  # measured completion lengths; when given, the lognormal is not used

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
        rng = random.Random(f"{self.seed}:{prompt_id}:{index}:{attempt}")
        if self.lengths:
            return max(1, min(self.max_tokens, rng.choice(self.lengths)))
        median = self.median_tokens
        if self.prompt_sigma > 0:
            median *= math.exp(random.Random(f"{self.seed}:prompt:{prompt_id}").gauss(0.0, self.prompt_sigma))
        return max(1, min(self.max_tokens, round(rng.lognormvariate(math.log(median), self.sigma))))


@dataclass
class ThroughputModel:
    """Generator throughput of one worker as a function of the requests on it: tokens_per_s(c) = peak * c /
    (c + half). Decoding is memory-bound at low concurrency (one sequence gets peak / (1 + half) tokens/s)
    and saturates towards `peak_tokens_per_s` as the batch grows. A request first spends `latency_s` on its
    worker (HTTP, scheduling, prefill) without decoding; the pool has `workers` such workers."""

    peak_tokens_per_s: float = 16000.0
    half_concurrency: float = 128.0
    latency_s: float = 0.0
    workers: int = 1

    def tokens_per_s(self, concurrency: float) -> float:
        return self.peak_tokens_per_s * concurrency / (concurrency + self.half_concurrency)

    def per_request(self, concurrency: float) -> float:
        return self.peak_tokens_per_s / (concurrency + self.half_concurrency)

    def pool_tokens_per_s(self, concurrency: int) -> float:
        """The pool's throughput with `concurrency` requests spread evenly over its workers."""
        return self.workers * self.tokens_per_s(concurrency / self.workers)


@dataclass
class Costs:
    """Trainer costs: a step is `train_step_overhead_s + train_s_per_token * tokens` (prompt plus
    completion tokens of its samples); a publish takes `sync_s` on the trainer and pauses the pool for
    its last `pause_s` (None: all of it; loading the weights ends a publish, writing them may not pause)."""

    train_s_per_token: float = 5e-5
    train_step_overhead_s: float = 2.0
    sync_s: float = 5.0
    pause_s: float | None = None

    def train_s(self, tokens: int) -> float:
        return self.train_step_overhead_s + self.train_s_per_token * tokens

    @property
    def publish_pause_s(self) -> float:
        return self.sync_s if self.pause_s is None else min(self.pause_s, self.sync_s)


def split_tokens(tokens: int, turns: int) -> list[int]:
    """An episode's policy tokens over its turns, evenly: every turn gets tokens // turns, the first
    tokens % turns turns one more. A run records only an episode's sum (gen/output_tokens), so an even split
    is the per-turn model its calibration can stand behind."""
    base, extra = divmod(tokens, turns)
    return [base + (k < extra) for k in range(turns)]


@dataclass
class EpisodeModel:
    """What a sample is beyond its tokens: how many turns (generation requests) it takes, and the tool calls
    between them. `turns` is a histogram, turns per episode -> episodes seen, which each episode draws from;
    empty (or only 1), every episode is a single turn. A tool call takes `tool_s` seconds on average with
    standard deviation `tool_sd` (lognormal with that mean and spread; exactly `tool_s` when `tool_sd` is 0)
    and appends `env_tokens` tokens on average, which the next turn reads as prompt and which count in the
    train step's tokens with the episode's own. The policy's tokens are split evenly over the turns
    (`split_tokens`)."""

    turns: dict[int, int] = field(default_factory=dict)
    tool_s: float = 0.0
    tool_sd: float = 0.0
    env_tokens: float = 0.0

    def __post_init__(self) -> None:
        if any(not isinstance(n, int) or n < 1 for n in self.turns):
            raise ValueError(f"episode turns {sorted(self.turns)}: turns per episode are whole numbers >= 1")
        if any(c < 0 for c in self.turns.values()) or (self.turns and sum(self.turns.values()) <= 0):
            raise ValueError(f"episode turns {self.turns}: give each turn count a weight >= 0, not all 0")
        for name in ("tool_s", "tool_sd", "env_tokens"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"episode {name} = {getattr(self, name)}: it must be >= 0")

    @property
    def multi_turn(self) -> bool:
        return any(n > 1 and c > 0 for n, c in self.turns.items())

    @property
    def mean_turns(self) -> float:
        """Turns per episode on average (1 for a single-turn model)."""
        total = sum(self.turns.values())
        return sum(n * c for n, c in self.turns.items()) / total if total else 1.0

    def tool_calls(self, seed: int, prompt_id: int, index: int, attempt: int) -> tuple[float, ...]:
        """The seconds of each tool call of one episode, so it has one turn more than calls; () for a single
        turn. Seeded per (prompt, sample, attempt), as its length is."""
        if not self.multi_turn:
            return ()
        rng = random.Random(f"{seed}:turns:{prompt_id}:{index}:{attempt}")
        counts = sorted(self.turns)
        turns = rng.choices(counts, weights=[self.turns[n] for n in counts])[0]
        if self.tool_sd <= 0 or self.tool_s <= 0:
            return (self.tool_s,) * (turns - 1)
        sigma2 = math.log1p((self.tool_sd / self.tool_s) ** 2)  # the lognormal of this mean and spread
        mu = math.log(self.tool_s) - sigma2 / 2
        return tuple(rng.lognormvariate(mu, math.sqrt(sigma2)) for _ in range(turns - 1))

    def env_tokens_of(self, calls: int) -> int:
        """Tokens the environment appends over `calls` tool calls."""
        return round(self.env_tokens * calls)


# ----------------------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------------------


@dataclass
class InFlight:
    """An episode in flight: its worker, the tokens of its current turn, the weights step it started on
    (`oldest`), the sequence number of its current turn (which tells its heap entries from those of an
    earlier turn or request of the same key), once the turn decodes the worker level at which it is done,
    its later turns as (seconds of the tool call before it, tokens) and whether it is in a tool call
    (`tooling`: no place on its worker)."""

    worker: int
    tokens: int
    oldest: int
    seq: int
    finish: float | None = None
    later: list[tuple[float, int]] = field(default_factory=list)
    tooling: bool = False


class GeneratorPool:
    """The generator model: workers that each share their throughput among their requests (processor
    sharing). All requests decoding on a worker advance equally, so one is done when the worker's
    cumulative per-request service `levels[w]` passes its start level plus its length: completions are a
    heap per worker on that finish level, O(log n) per event; requests still in their latency wait in a
    heap on the time they start decoding, episodes in a tool call in a heap on the time it ends. Time is
    whatever the caller passes to `advance` (simulated seconds here; scaled wall-clock seconds in a fake
    backend)."""

    def __init__(self, model: ThroughputModel) -> None:
        if model.workers < 1:
            raise ValueError(f"the generator pool needs at least one worker, got workers = {model.workers}")
        self.model = model
        self.t = 0.0
        self.levels = [0.0] * model.workers
        self.load = [0] * model.workers  # requests on each worker, waiting or decoding
        self.decoding = [0] * model.workers
        self.heaps: list[list[tuple[float, int, SampleKey]]] = [[] for _ in range(model.workers)]
        self.waiting: list[tuple[float, int, SampleKey]] = []  # (decoding starts, seq, key)
        self.calls: list[tuple[float, int, SampleKey]] = []  # (tool call ends, seq, key)
        self.weights_step = 0
        self.paused = False
        self.active: dict[SampleKey, InFlight] = {}
        self.seq = 0
        self.generated = 0.0
        self.busy_s = 0.0

    def advance(self, now: float) -> None:
        while True:
            wait, tool = self._valid(self.waiting), self._valid(self.calls)
            if tool is not None and tool[0] <= now and (wait is None or tool[0] < wait[0]):
                heapq.heappop(self.calls)
                self._run(tool[0])
                req = self.active[tool[2]]
                req.tooling = False
                self.load[req.worker] += 1
                self._enter(req, tool[2])
            elif wait is not None and wait[0] <= now:
                heapq.heappop(self.waiting)
                self._run(wait[0])
                self._decode(self.active[wait[2]], wait[2])
            else:
                break
        self._run(now)

    def _run(self, now: float) -> None:
        dt = now - self.t
        if dt > 0 and not self.paused and any(self.decoding):
            for w, n in enumerate(self.decoding):
                if n:
                    rate = self.model.per_request(self.load[w])
                    self.levels[w] += rate * dt
                    self.generated += n * rate * dt
            self.busy_s += dt
        self.t = max(self.t, now)

    def add(self, key: SampleKey, tokens: int, tool_calls: Sequence[float] = ()) -> None:
        """Start an episode of `tokens` policy tokens and the given tool calls (seconds each) between its
        turns, one turn more than calls, the tokens split evenly over them; no calls: a single request."""
        worker = min(range(self.model.workers), key=self.load.__getitem__)
        per_turn = split_tokens(tokens, len(tool_calls) + 1)
        self.seq += 1
        self.load[worker] += 1
        later = list(zip(tool_calls, per_turn[1:], strict=True))
        req = self.active[key] = InFlight(worker, per_turn[0], self.weights_step, self.seq, later=later)
        self._enter(req, key)

    def _enter(self, req: InFlight, key: SampleKey) -> None:
        """A turn arrives on its worker: it decodes after the request latency."""
        if self.model.latency_s > 0:
            heapq.heappush(self.waiting, (self.t + self.model.latency_s, req.seq, key))
        else:
            self._decode(req, key)

    def _to_tool(self, req: InFlight, key: SampleKey) -> None:
        """A turn that is not the episode's last ended: the episode leaves its worker for the tool call."""
        seconds, req.tokens = req.later.pop(0)
        self.load[req.worker] -= 1
        self.decoding[req.worker] -= 1
        self.seq += 1
        req.seq, req.finish, req.tooling = self.seq, None, True
        heapq.heappush(self.calls, (self.t + seconds, req.seq, key))

    def _decode(self, req: InFlight, key: SampleKey) -> None:
        req.finish = self.levels[req.worker] + req.tokens
        self.decoding[req.worker] += 1
        heapq.heappush(self.heaps[req.worker], (req.finish, req.seq, key))

    def remove(self, key: SampleKey) -> None:
        req = self.active.pop(key)  # its heap entries are skipped lazily
        if req.tooling:
            return
        self.load[req.worker] -= 1
        if req.finish is not None:
            self.decoding[req.worker] -= 1

    def _valid(self, heap: list[tuple[float, int, SampleKey]]) -> tuple[float, int, SampleKey] | None:
        while heap:
            entry = self.active.get(heap[0][2])
            if entry is not None and entry.seq == heap[0][1]:
                return heap[0]
            heapq.heappop(heap)
        return None

    def next_time(self) -> float:
        top = self._valid(self.waiting)
        t = top[0] if top is not None else math.inf
        if (top := self._valid(self.calls)) is not None:
            t = min(t, top[0])
        if self.paused:
            return t
        for w, heap in enumerate(self.heaps):
            if (top := self._valid(heap)) is not None:
                t = min(t, self.t + max(0.0, top[0] - self.levels[w]) / self.model.per_request(self.load[w]))
        return t

    def pop_finished(self) -> list[tuple[SampleKey, int]]:
        """(key, oldest weights step) of every episode whose last turn's finish level is reached, in finish
        order per worker; an episode whose earlier turn ended goes to its tool call."""
        out = []
        for w, heap in enumerate(self.heaps):
            eps = 1e-9 * max(1.0, self.levels[w])
            while (top := self._valid(heap)) is not None and top[0] <= self.levels[w] + eps:
                heapq.heappop(heap)
                key = top[2]
                req = self.active[key]
                if req.later:
                    self._to_tool(req, key)
                else:
                    out.append((key, req.oldest))
                    self.remove(key)
        return out


def simulate(
    policy: FlowPolicy,
    workload: Workload,
    throughput: ThroughputModel,
    costs: Costs,
    *,
    episodes: EpisodeModel | None = None,
    max_events: int = 50_000_000,
) -> SimResult:
    """Run `policy` to its Finish against the model; deterministic for given inputs. `episodes` (default:
    every sample a single turn) gives the samples' turns and tool calls."""
    episodes = episodes if episodes is not None else EpisodeModel()
    pool = GeneratorPool(throughput)
    spp = policy.flow.samples_per_prompt
    attempts: dict[SampleKey, int] = {}
    requests: dict[SampleKey, SampleRecord] = {}
    samples: list[SampleRecord] = []
    steps: list[StepRecord] = []
    spans: list[Span] = []
    trace: list[TracePoint] = [TracePoint(0.0, 0, 0, False)]
    job: Train | Publish | None = None
    job_end = pause_at = math.inf
    finish: Finish | None = None
    trained_completion_tokens = 0

    def mark() -> None:
        point = TracePoint(pool.t, len(pool.active), pool.weights_step, pool.paused)
        last = trace[-1]
        if (last.concurrency, last.weights_step, last.paused) == (point.concurrency, point.weights_step, point.paused):
            return
        if last.t == point.t:
            trace[-1] = point
        else:
            trace.append(point)

    def apply(actions: list[Action]) -> None:
        nonlocal job, job_end, pause_at, finish, trained_completion_tokens
        for a in actions:
            if isinstance(a, Dispatch):
                if pool.paused:
                    raise SimulationError(f"{policy.strategy} dispatched {a} during a weight sync")
                for s in a.samples:
                    key = (a.prompt_id, s)
                    n = attempts.get(key, 0)
                    attempts[key] = n + 1
                    tokens = workload.tokens(a.prompt_id, s, n)
                    calls = episodes.tool_calls(workload.seed, a.prompt_id, s, n)
                    pool.add(key, tokens, calls)
                    worker = pool.active[key].worker
                    record = SampleRecord(a.prompt_id, s, n, pool.t, math.nan, tokens, worker, len(pool.active))
                    record.turns, record.tool_s = len(calls) + 1, math.fsum(calls)
                    record.env_tokens = episodes.env_tokens_of(len(calls))
                    requests[key] = record
            elif isinstance(a, Abort):
                for key in a.keys:
                    pool.remove(key)
            elif isinstance(a, Train):
                completion = sum(requests[(p, s)].tokens for p in a.prompt_ids for s in range(spp))
                env = sum(requests[(p, s)].env_tokens for p in a.prompt_ids for s in range(spp))
                tokens = completion + env + workload.prompt_tokens * spp * len(a.prompt_ids)
                trained_completion_tokens += completion
                job, job_end = a, pool.t + costs.train_s(tokens)
                steps.append(StepRecord(a.step, pool.t, job_end, a.prompt_ids, tokens))
                spans.append(Span(pool.t, job_end, "train", a.step))
            elif isinstance(a, Publish):
                job, job_end = a, pool.t + costs.sync_s
                pause_at = job_end - costs.publish_pause_s
                spans.append(Span(pool.t, job_end, "sync", a.step))
            elif isinstance(a, Finish):
                finish = a
        if pause_at <= pool.t:  # the publish reached its pause: nothing decodes until it ends
            pool.paused, pause_at = True, math.inf
        mark()

    apply(policy.start())
    for _ in range(max_events):
        if finish is not None:
            break
        t_gen = pool.next_time()
        if t_gen == math.inf and job_end == math.inf:
            raise SimulationError(f"{policy.strategy}: nothing in flight and no trainer job at t={pool.t:.1f}s")
        if t_gen <= min(pause_at, job_end):
            pool.advance(t_gen)
            for (p, s), oldest in pool.pop_finished():
                record = requests[(p, s)]
                record.end = pool.t
                samples.append(record)
                apply(policy.on_sample_done(SampleDone(p, s, oldest, pool.weights_step, workload.reward(p, s))))
        elif pause_at < job_end:
            pool.advance(pause_at)
            apply([])
        else:
            pool.advance(job_end)
            ended, job, job_end, pause_at = job, None, math.inf, math.inf
            assert ended is not None  # job_end is finite only while a job runs
            if isinstance(ended, Train):
                apply(policy.on_train_done(ended.step))
            else:
                pool.weights_step = ended.step
                pool.paused = False
                apply(policy.on_published(ended.step))
    else:
        raise SimulationError(f"{policy.strategy}: no Finish after {max_events} events")
    return SimResult(
        strategy=policy.strategy,
        max_concurrent=policy.flow.max_concurrent,
        makespan=pool.t,
        steps=steps,
        spans=spans,
        trace=trace,
        counters=policy.counters,
        generated_tokens=pool.generated,
        trained_completion_tokens=trained_completion_tokens,
        generator_busy_s=pool.busy_s,
        peak_tokens_per_s=throughput.pool_tokens_per_s(policy.flow.max_concurrent),
        finish_reason=finish.reason,
        samples=samples,
    )


__all__ = [
    "Costs",
    "EpisodeModel",
    "InFlight",
    "SimulationError",
    "GeneratorPool",
    "ThroughputModel",
    "Workload",
    "simulate",
    "split_tokens",
]
