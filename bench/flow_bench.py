"""Flow-control study: on-policy vs one-step-off vs fully-async (max_staleness 1, 2, 4) on one and
the same simulated hardware, plus the GenerationController's dispatch rate with an instant backend.

The model (rollout/flow/sim/simulator.py), chosen to describe a typical RLVR reasoning run, not tuned to a
target:
- Workload: 32 prompts per step, 8 samples per prompt (256 samples per step), 40 steps. Completion
  lengths are lognormal with median 1024 tokens and sigma 1.0 (mean ~1.7k tokens, a long tail: the
  longest of 256 samples is typically ~14x the median), capped at max_tokens 16384; prompts are 512
  tokens. Every re-generated sample draws a new length.
- Generator pool: processor sharing with throughput tokens_per_s(c) = 16000 * c / (c + 128): one lone
  sequence decodes at ~124 tokens/s (memory-bound), 256 concurrent sequences reach ~10.7k tokens/s in
  total (~42 tokens/s each). max_concurrent = 256 for every strategy.
- Trainer: 2 s per step plus 50 us per token (~20k tokens/s; a step of ~560k tokens takes ~30 s);
  a weight sync takes 5 s of the trainer and pauses the pool (keep mode: requests resume afterwards).
- Fully-async admission: max_untrained_prompts = (max_staleness + 1) * prompts_per_step, stale samples
  re-queued (re-generated), partial rollout on.
Generation dominates (as in most RLVR runs), so the strategies differ mainly in how well they keep the
pool busy through the long tail: a synchronous batch ends with a handful of long samples decoding
alone, while fully-async keeps the pool full with the next prompts. The price is staleness: samples
that span more than `max_staleness` steps are re-generated, which is reported as wasted tokens.

Run: .venv/bin/python bench/flow_bench.py [--png bench/flow_timeline.png] [--steps 40]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from common.config import FlowConfig
from rollout.controller import GenerationController
from rollout.flow.sim.report import SimResult, ascii_timeline, compare_table, save_png
from rollout.flow.sim.simulator import Costs, ThroughputModel, Workload, simulate
from rollout.flow.strategies import policy_from_config

PROMPTS_PER_STEP = 32
SAMPLES_PER_PROMPT = 8
MAX_CONCURRENT = 256
MODEL = ThroughputModel(peak_tokens_per_s=16000.0, half_concurrency=128.0)
COSTS = Costs(train_s_per_token=5e-5, train_step_overhead_s=2.0, sync_s=5.0)


def workload(steps: int) -> Workload:
    return Workload(
        num_prompts=steps * PROMPTS_PER_STEP,
        median_tokens=1024.0,
        sigma=1.0,
        prompt_tokens=512,
        max_tokens=16384,
        seed=0,
    )


def run(strategy: str, steps: int, max_staleness: int = 1) -> SimResult:
    flow = FlowConfig(
        strategy=strategy,
        prompts_per_step=PROMPTS_PER_STEP,
        samples_per_prompt=SAMPLES_PER_PROMPT,
        max_concurrent=MAX_CONCURRENT,
        max_untrained_prompts=(max_staleness + 1) * PROMPTS_PER_STEP,
        max_staleness=max_staleness,
        stale_policy="requeue",
        partial_rollout=True,
    )
    w = workload(steps)
    return simulate(policy_from_config(flow, num_prompts=w.num_prompts, max_steps=steps), w, MODEL, COSTS)


def dispatch_rate(n: int = 100_000) -> tuple[float, float]:
    """Items per second through the controller with a backend that answers at once: via generate()
    and via submit() with a callback."""

    async def instant(item: int) -> int:
        return item

    with GenerationController(instant, FlowConfig(max_concurrent=MAX_CONCURRENT)) as ctl:
        sum(1 for _ in ctl.generate(range(1000)))  # warm-up
        t0 = time.perf_counter()
        got = sum(1 for _ in ctl.generate(range(n)))
        gen_rate = got / (time.perf_counter() - t0)

        import threading

        done = threading.Event()
        count = [0]

        def callback(_out: object) -> None:
            count[0] += 1
            if count[0] == n:
                done.set()

        t0 = time.perf_counter()
        for i in range(n):
            ctl.submit(i, callback)
        done.wait()
        submit_rate = n / (time.perf_counter() - t0)
    return gen_rate, submit_rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--png", default="bench/flow_timeline.png")
    args = parser.parse_args()

    t0 = time.perf_counter()
    rows = [
        ("on_policy", run("on_policy", args.steps)),
        ("one_step_off", run("one_step_off", args.steps)),
    ]
    for s in (1, 2, 4):
        rows.append((f"fully_async max_staleness={s}", run("fully_async", args.steps, s)))
    sim_s = time.perf_counter() - t0
    base = rows[0][1]
    print(f"workload: {dataclasses.asdict(workload(args.steps))}")
    print(f"generator: {MODEL}; trainer: {COSTS}; max_concurrent {MAX_CONCURRENT}")
    print(
        f"{args.steps} steps x {PROMPTS_PER_STEP} prompts x {SAMPLES_PER_PROMPT} samples; simulated in {sim_s:.1f} s\n"
    )
    print(compare_table(rows, base))
    print()
    for name, r in rows:
        staleness = dict(sorted(r.counters.staleness.items()))
        mean_len = r.trained_completion_tokens / max(1, r.counters.trained_samples)
        # Re-generating stale samples favours short ones, so compare trained tokens/s as well as samples/s.
        tok_ratio = (r.trained_completion_tokens / r.makespan) / (base.trained_completion_tokens / base.makespan)
        print(
            f"{name}: staleness {staleness}, requeued {r.counters.requeued_samples} samples, "
            f"mean trained completion {mean_len:.0f} tokens, trained tokens/s {tok_ratio:.2f}x on_policy"
        )
    print()
    for _name, r in (rows[0], rows[3]):
        print(ascii_timeline(r, 100))
        print()
    save_png([r for _, r in rows[:2]] + [rows[3][1]], args.png, labels=[rows[0][0], rows[1][0], rows[3][0]])
    print(f"timeline figure: {args.png}")
    gen_rate, submit_rate = dispatch_rate()
    print(
        f"\ncontroller dispatch rate, instant backend, max_concurrent {MAX_CONCURRENT}: "
        f"generate() {gen_rate:,.0f} items/s, submit()+callback {submit_rate:,.0f} items/s"
    )


if __name__ == "__main__":
    main()
