"""The simulator: hand-computed schedules, the processor-sharing model, multi-turn episodes with tool calls,
invariants on a long-tail workload, the renderings and `slipstream simulate` (cli_main)."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest

from common.config import FlowConfig
from rollout.flow.policy import FlowPolicy
from rollout.flow.sim.cli import build_parser, cli_main
from rollout.flow.sim.report import SimResult, TracePoint, ascii_timeline, save_png
from rollout.flow.sim.simulator import (
    Costs,
    EpisodeModel,
    GeneratorPool,
    ThroughputModel,
    Workload,
    simulate,
    split_tokens,
)
from rollout.flow.strategies import policy_from_config

# One request alone runs at 200 / (1 + 1) = 100 tokens/s; every sample is exactly 100 tokens long.
MODEL = ThroughputModel(peak_tokens_per_s=200.0, half_concurrency=1.0)
FIXED = Workload(num_prompts=3, median_tokens=100, sigma=0.0, prompt_tokens=0)
COSTS = Costs(train_s_per_token=0.0, train_step_overhead_s=0.5, sync_s=0.25)


def policy(strategy: str, **kw) -> FlowPolicy:
    base = dict(prompts_per_step=1, samples_per_prompt=1, max_concurrent=4, max_untrained_prompts=2, max_staleness=1)
    base.update(kw)
    num_prompts = base.pop("num_prompts", 3)
    return policy_from_config(FlowConfig(strategy=strategy, **base), num_prompts=num_prompts)


def test_on_policy_schedule_is_generate_train_sync_in_sequence():
    r = simulate(policy("on_policy", num_prompts=2), FIXED, MODEL, COSTS)
    # gen [0, 1], train [1, 1.5], sync [1.5, 1.75], gen [1.75, 2.75], train [2.75, 3.25], sync [3.25, 3.5]
    assert [t for s in r.steps for t in (s.start, s.end)] == pytest.approx([1.0, 1.5, 2.75, 3.25])
    assert r.makespan == pytest.approx(3.5)
    assert r.trainer_utilisation == pytest.approx(1.5 / 3.5)
    assert r.generator_busy == pytest.approx(2.0 / 3.5)
    assert r.samples_per_s == pytest.approx(2 / 3.5)
    assert r.counters.staleness == {0: 2} and r.finish_reason == "end_of_data"


def test_one_step_off_overlaps_generation_with_training():
    r = simulate(policy("one_step_off"), FIXED, MODEL, COSTS)
    # gen0 [0,1]; train0 [1,1.5] while gen1 [1,2]; sync1 [2,2.25]; train1 [2.25,2.75] while gen2 [2.25,3.25];
    # sync2 [3.25,3.5]; train2 [3.5,4]; sync3 [4,4.25]
    assert [t for s in r.steps for t in (s.start, s.end)] == pytest.approx([1.0, 1.5, 2.25, 2.75, 3.5, 4.0])
    assert r.makespan == pytest.approx(4.25)
    assert r.counters.staleness == {0: 1, 1: 2}


def test_processor_sharing_slows_every_request_by_the_concurrency():
    pool = GeneratorPool(ThroughputModel(peak_tokens_per_s=300.0, half_concurrency=1.0))
    pool.add((0, 0), 100)
    pool.add((1, 0), 200)
    # Two in flight: 300 / 3 = 100 tokens/s each, the short one ends at t = 1.
    assert pool.next_time() == pytest.approx(1.0)
    pool.advance(1.0)
    assert pool.pop_finished() == [((0, 0), 0)]
    # Alone: 300 / 2 = 150 tokens/s for the remaining 100 tokens.
    assert pool.next_time() == pytest.approx(1.0 + 100 / 150)
    pool.paused = True
    assert pool.next_time() == float("inf")
    assert pool.generated == pytest.approx(200.0)


def test_a_second_worker_takes_the_next_request_and_each_worker_shares_only_its_own():
    pool = GeneratorPool(ThroughputModel(peak_tokens_per_s=200.0, half_concurrency=1.0, workers=2))
    for p in range(3):
        pool.add((p, 0), 100)
    assert [pool.active[(p, 0)].worker for p in range(3)] == [0, 1, 0]  # the least loaded, the first on a tie
    # Worker 1 alone: 200 / 2 = 100 tokens/s, done at t = 1; worker 0 shares 200 / 3 between two: t = 1.5.
    assert pool.next_time() == pytest.approx(1.0)
    pool.advance(1.0)
    assert pool.pop_finished() == [((1, 0), 0)]
    assert pool.next_time() == pytest.approx(1.5)
    pool.advance(1.5)
    assert sorted(pool.pop_finished()) == [((0, 0), 0), ((2, 0), 0)]
    assert pool.generated == pytest.approx(300.0)


def test_latency_comes_before_the_first_token_and_holds_a_place_on_the_worker():
    pool = GeneratorPool(ThroughputModel(peak_tokens_per_s=200.0, half_concurrency=1.0, latency_s=0.5))
    pool.add((0, 0), 100)
    assert pool.next_time() == pytest.approx(0.5)
    pool.advance(0.5)
    assert pool.pop_finished() == [] and pool.generated == 0.0
    pool.add((1, 0), 100)  # in its latency until t = 1, yet the first already shares: 200 / 3 tokens/s
    assert pool.next_time() == pytest.approx(1.0)
    pool.advance(1.0)
    # The first has 100 - 33.3 tokens left, at 200 / 3 tokens/s: done at t = 2; the second then alone at 100/s.
    assert pool.next_time() == pytest.approx(2.0)
    pool.advance(2.0)
    assert pool.pop_finished() == [((0, 0), 0)]
    assert pool.next_time() == pytest.approx(2.0 + (100 - 200 / 3) / 100)


def test_workload_lengths_are_seeded_capped_and_redrawn_per_attempt():
    w = Workload(median_tokens=1000, sigma=1.0, max_tokens=3000, seed=7)
    lengths = [w.tokens(p, s, 0) for p in range(200) for s in range(4)]
    assert lengths == [w.tokens(p, s, 0) for p in range(200) for s in range(4)]
    assert max(lengths) == 3000 and min(lengths) >= 1
    assert 700 < sorted(lengths)[len(lengths) // 2] < 1400  # the median
    assert any(w.tokens(p, 0, 1) != w.tokens(p, 0, 0) for p in range(10))
    measured = Workload(lengths=(2, 3, 9), max_tokens=6, seed=7)
    drawn = [measured.tokens(p, s, 0) for p in range(50) for s in range(4)]
    assert set(drawn) == {2, 3, 6}  # drawn from the measured lengths, capped


LONG_TAIL = Workload(num_prompts=160, median_tokens=512, sigma=1.0, prompt_tokens=128, max_tokens=8192, seed=1)
HW = ThroughputModel(peak_tokens_per_s=8000.0, half_concurrency=32.0)
TRAIN = Costs(train_s_per_token=5e-5, train_step_overhead_s=1.0, sync_s=2.0)


def long_tail_policy(strategy: str, **kw) -> FlowPolicy:
    base = dict(prompts_per_step=8, samples_per_prompt=4, max_concurrent=32, max_untrained_prompts=24, max_staleness=2)
    base.update(kw)
    return policy_from_config(FlowConfig(strategy=strategy, **base), num_prompts=160, max_steps=16)


def test_a_publish_pauses_generation_for_its_last_pause_s_only():
    def run(pause_s):
        return simulate(long_tail_policy("fully_async"), LONG_TAIL, HW, Costs(5e-5, 1.0, 2.0, pause_s=pause_s))

    r = run(0.5)
    ends = r.trace[1:] + [TracePoint(r.makespan, 0, 0, False)]
    paused: list[list[float]] = []
    for p, q in zip(r.trace, ends, strict=True):
        if p.paused and paused and paused[-1][1] == p.t:
            paused[-1][1] = q.t  # one pause across several trace points
        elif p.paused:
            paused.append([p.t, q.t])
    syncs = [t for s in r.spans if s.kind == "sync" for t in (s.end - 0.5, s.end)]
    assert [t for window in paused for t in window] == pytest.approx(syncs)
    assert r.makespan < run(None).makespan  # generating through most of each publish is faster


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
@pytest.mark.parametrize("stale_policy", ["requeue", "drop"])
def test_fully_async_never_trains_past_the_staleness_bound_nor_exceeds_the_cap(max_staleness, stale_policy):
    pol = long_tail_policy("fully_async", max_staleness=max_staleness, stale_policy=stale_policy)
    r = simulate(pol, LONG_TAIL, HW, TRAIN)
    assert max(r.counters.staleness) <= max_staleness
    assert max(p.concurrency for p in r.trace) <= 32
    c = r.counters
    if stale_policy == "requeue":
        assert len(r.steps) == 16 and c.dropped_prompts == 0
    else:  # dropped prompts are not replaced beyond the data: the run may end with the data
        assert c.dropped_samples == c.dropped_prompts * 4
        assert len(r.steps) == 16 or c.trained_prompts + c.dropped_prompts == 160


def test_fully_async_outruns_on_policy_on_a_long_tail_and_the_simulation_is_deterministic():
    on = simulate(long_tail_policy("on_policy"), LONG_TAIL, HW, TRAIN)
    fa = simulate(long_tail_policy("fully_async"), LONG_TAIL, HW, TRAIN)
    again = simulate(long_tail_policy("fully_async"), LONG_TAIL, HW, TRAIN)
    assert fa.samples_per_s > 1.3 * on.samples_per_s
    assert fa.generator_utilisation > on.generator_utilisation
    assert [s.prompt_ids for s in fa.steps] == [s.prompt_ids for s in again.steps]
    assert fa.makespan == again.makespan


def test_ascii_timeline_and_png(tmp_path):
    r = simulate(policy("one_step_off"), FIXED, MODEL, COSTS)
    text = ascii_timeline(r, width=34)
    rows = {line.split("|")[0].strip(): line.split("|")[1] for line in text.splitlines() if line.count("|") == 2}
    assert set(rows) == {"trainer", "generator", "weights"} and all(len(v) == 34 for v in rows.values())
    # 0.125 s per column: train 0 fills [1, 1.5] = columns 8..11; the weights of step 1 from t = 2.25 on.
    assert rows["trainer"][8:12] == "0000" and rows["trainer"][:8] == "........"
    assert rows["weights"][:16] == "0" * 16 and rows["weights"][19:26] == "1" * 7
    path = tmp_path / "timeline.png"
    save_png([r, simulate(policy("on_policy"), FIXED, MODEL, COSTS)], str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_takes_the_flow_section_from_a_config_and_flags_override(tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[flow]\nstrategy = "one_step_off"\nprompts_per_step = 2\nsamples_per_prompt = 2\n')
    png = tmp_path / "t.png"
    assert cli_main(["--config", str(cfg), "--steps", "3", "--median-tokens", "64", "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "strategy one_step_off: 3 steps, 12 samples" in out and "trainer   |" in out and png.exists()
    assert cli_main(["--config", str(cfg), "--strategy", "on_policy", "--steps", "2", "--strategies", "all"]) == 0
    out = capsys.readouterr().out
    assert "strategy on_policy: 2 steps" in out and "vs base" in out and "fully_async" in out


def test_cli_flow_flags_are_the_policy_knobs_of_the_flow_schema_with_their_docstrings(capsys):
    parser = build_parser()
    args = parser.parse_args(["--no-partial-rollout", "--end-of-data", "drop", "--max-staleness", "0"])
    assert (args.partial_rollout, args.end_of_data, args.max_staleness, args.strategy) == (False, "drop", 0, None)
    assert "Prompt groups per optimizer step." in " ".join(parser.format_help().split())
    with pytest.raises(SystemExit):
        parser.parse_args(["--stale-policy", "keep"])  # a Literal field: its values are the choices
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-retries", "2"])  # a controller knob, which the simulator does not model
    assert "unrecognized arguments: --max-retries" in capsys.readouterr().err


def test_cli_simulate_rejects_bad_knobs_with_a_named_error(capsys):
    assert cli_main(["--strategy", "fully_async", "--prompts-per-step", "8", "--max-untrained-prompts", "4"]) == 2
    assert "max_untrained_prompts" in capsys.readouterr().err


@pytest.mark.parametrize("strategy", ["on_policy", "one_step_off", "fully_async"])
def test_dynamic_sampling_replaces_uniform_groups_at_the_cost_of_more_generation(strategy):
    def run(rate: float):
        workload = Workload(median_tokens=256, sigma=0.5, prompt_tokens=64, seed=3, uniform_group_rate=rate)
        cfg = FlowConfig(
            strategy=strategy,
            prompts_per_step=8,
            samples_per_prompt=4,
            max_concurrent=32,
            max_untrained_prompts=24,
            max_staleness=1,
            dynamic_sampling=True,
        )
        return simulate(policy_from_config(cfg, num_prompts=None, max_steps=8), workload, HW, TRAIN), workload

    clean, _ = run(0.0)
    r, workload = run(0.3)
    assert clean.counters.dropped_groups == 0 and r.counters.dropped_groups > 0
    # The same 8 full steps, every group with signal, paid for with the dropped groups' tokens.
    assert len(r.steps) == 8 and all(len(s.prompt_ids) == 8 for s in r.steps)
    assert all(len({workload.reward(p, i) for i in range(4)}) == 2 for s in r.steps for p in s.prompt_ids)
    assert r.generated_tokens > clean.generated_tokens and r.makespan > clean.makespan
    assert r.wasted_fraction > clean.wasted_fraction
    assert max(p.concurrency for p in r.trace) <= 32 and max(r.counters.staleness) <= 1


def test_cli_simulate_models_dynamic_sampling(capsys):
    args = ["--strategy", "on_policy", "--prompts-per-step", "4", "--steps", "3", "--median-tokens", "64"]
    assert cli_main([*args, "--dynamic-sampling", "--uniform-group-rate", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "strategy on_policy: 3 steps, 48 samples" in out
    dropped = int(out.split("dynamic sampling dropped ")[1].split()[0])
    assert dropped > 0
    assert cli_main([*args, "--uniform-group-rate", "0.5"]) == 0  # off: nothing dropped
    assert "dynamic sampling dropped 0 zero-variance groups" in capsys.readouterr().out
    assert cli_main([*args, "--dynamic-sampling", "--uniform-group-rate", "1.5"]) == 2
    assert "--uniform-group-rate" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------
# Multi-turn episodes
# ----------------------------------------------------------------------------------------------


def test_a_tool_call_lengthens_each_on_policy_step_by_its_seconds_and_its_tokens_train_with_the_episode():
    two_turns = EpisodeModel(turns={2: 1}, tool_s=0.5, env_tokens=20)
    costs = Costs(train_s_per_token=0.005, train_step_overhead_s=0.5, sync_s=0.25)
    single = simulate(policy("on_policy", num_prompts=2), FIXED, MODEL, costs)
    r = simulate(policy("on_policy", num_prompts=2), FIXED, MODEL, costs, episodes=two_turns)
    # Single turn: gen [0, 1], train 0.5 + 0.005 * 100 = 1 s [1, 2], sync [2, 2.25]; again from 2.25: 4.5 s.
    assert [t for s in single.steps for t in (s.start, s.end)] == pytest.approx([1.0, 2.0, 3.25, 4.25])
    # Two turns of 50 tokens at 100 tokens/s with a 0.5 s tool call between: gen [0, 1.5]; the call appended
    # 20 tokens, so train 0.5 + 0.005 * 120 = 1.1 s [1.5, 2.6]; sync [2.6, 2.85]; gen [2.85, 4.35]; train
    # [4.35, 5.45]; sync [5.45, 5.7]. Each step 0.5 s (the call) + 0.1 s (its tokens) longer.
    assert [t for s in r.steps for t in (s.start, s.end)] == pytest.approx([1.5, 2.6, 4.35, 5.45])
    assert r.makespan == pytest.approx(single.makespan + 2 * (0.5 + 0.1)) and r.makespan == pytest.approx(5.7)
    assert [s.tokens for s in r.steps] == [120, 120] and r.trained_completion_tokens == 200
    assert [(s.turns, s.tool_s, s.env_tokens) for s in r.samples] == [(2, 0.5, 20)] * 2
    assert r.turns_per_episode == 2.0 and r.tool_s_per_episode == 0.5
    # The generator decodes 1 s of each 1.5 s episode; the episode is in flight at the controller throughout.
    assert r.generator_busy_s == pytest.approx(2.0)
    in_flight = [t for p, q in zip(r.trace, r.trace[1:], strict=False) if p.concurrency for t in (p.t, q.t)]
    assert in_flight == pytest.approx([0.0, 1.5, 2.85, 4.35])
    assert "episodes: 2.00 turns and 0.50 s of tool calls each on average (2 completed)" in r.summary()
    assert "episodes:" not in single.summary()


def test_an_episode_in_a_tool_call_holds_no_place_on_its_worker_and_comes_back_to_it():
    pool = GeneratorPool(ThroughputModel(peak_tokens_per_s=300.0, half_concurrency=1.0, workers=2))
    pool.add((0, 0), 200, tool_calls=(1.0,))  # two turns of 100 tokens, a one-second tool call between
    pool.add((1, 0), 100)
    pool.add((2, 0), 200)
    assert [pool.active[(p, 0)].worker for p in range(3)] == [0, 1, 0]
    # (1, 0) alone on worker 1 at 300 / 2 = 150 tokens/s: done at t = 2/3.
    pool.advance(pool.next_time())
    assert pool.t == pytest.approx(2 / 3) and pool.pop_finished() == [((1, 0), 0)]
    # Worker 0 shares 300 / 3 = 100 tokens/s each between two: the first turn of (0, 0) ends at t = 1 and the
    # episode goes to its tool call, in flight but off its worker, so (2, 0) speeds up to 150 tokens/s.
    assert pool.next_time() == pytest.approx(1.0)
    pool.advance(1.0)
    assert pool.pop_finished() == [] and pool.active[(0, 0)].tooling
    assert pool.load == [1, 0] and pool.decoding == [1, 0] and len(pool.active) == 2
    assert pool.next_time() == pytest.approx(1.0 + 100 / 150)
    pool.advance(1.0 + 100 / 150)
    assert pool.pop_finished() == [((2, 0), 0)]
    pool.add((3, 0), 300)  # both workers empty: worker 0, which 50 tokens by t = 2
    assert pool.active[(3, 0)].worker == 0
    # The call ends at t = 2; the second turn goes back to worker 0, though worker 1 is idle: both share
    # 100 tokens/s, the turn's 100 tokens end at t = 3, then (3, 0)'s last 150 alone at 150/s by t = 4.
    assert pool.next_time() == pytest.approx(2.0)
    pool.advance(2.0)
    assert pool.pop_finished() == [] and pool.load == [2, 0] and not pool.active[(0, 0)].tooling
    assert pool.next_time() == pytest.approx(3.0)
    pool.advance(3.0)
    assert pool.pop_finished() == [((0, 0), 0)]
    pool.advance(pool.next_time())
    assert pool.t == pytest.approx(4.0) and pool.pop_finished() == [((3, 0), 0)]
    assert pool.load == [0, 0] and not pool.active and pool.generated == pytest.approx(800.0)


def test_an_episode_aborted_in_its_tool_call_leaves_the_pool_clean():
    pool = GeneratorPool(ThroughputModel(peak_tokens_per_s=200.0, half_concurrency=1.0, latency_s=0.25))
    pool.add((0, 0), 100, tool_calls=(2.0, 2.0))  # three turns of 34, 33 and 33 tokens
    assert pool.active[(0, 0)].tokens == 34 and pool.active[(0, 0)].later == [(2.0, 33), (2.0, 33)]
    first = 0.25 + 34 / 100  # the latency, then alone at 100 tokens/s
    pool.advance(0.25)
    assert pool.next_time() == pytest.approx(first)
    pool.advance(first)
    assert pool.pop_finished() == [] and pool.active[(0, 0)].tooling and pool.load == [0]
    assert pool.next_time() == pytest.approx(first + 2.0)  # the call's end
    pool.remove((0, 0))  # aborted while the tool runs
    assert pool.load == [0] and pool.decoding == [0] and not pool.active
    assert pool.next_time() == float("inf")  # its call's end is skipped
    pool.add((0, 0), 10)  # the re-generated sample: a new request, whose latency comes first
    assert pool.next_time() == pytest.approx(first + 0.25)
    pool.advance(first + 0.25)
    assert pool.next_time() == pytest.approx(first + 0.25 + 10 / 100)


def test_episode_draws_are_seeded_and_follow_the_turn_histogram_and_the_tool_call_mean_and_spread():
    model = EpisodeModel(turns={1: 1, 3: 3}, tool_s=2.0, tool_sd=1.0, env_tokens=7.5)
    draws = [model.tool_calls(0, p, i, 0) for p in range(2000) for i in range(2)]
    assert draws == [model.tool_calls(0, p, i, 0) for p in range(2000) for i in range(2)]
    assert {len(d) for d in draws} == {0, 2} and sum(len(d) == 2 for d in draws) / len(draws) == pytest.approx(
        0.75, abs=0.02
    )
    calls = [c for d in draws for c in d]
    mean = sum(calls) / len(calls)
    sd = (sum((c - mean) ** 2 for c in calls) / len(calls)) ** 0.5
    assert (mean, sd) == pytest.approx((2.0, 1.0), rel=0.05) and min(calls) > 0
    assert model.mean_turns == 2.5 and model.env_tokens_of(2) == 15
    assert EpisodeModel(turns={2: 1}, tool_s=1.5).tool_calls(0, 0, 0, 0) == (1.5,)
    assert (
        EpisodeModel().tool_calls(0, 0, 0, 0) == ()
        and EpisodeModel(turns={1: 5}, tool_s=9).tool_calls(0, 0, 0, 0) == ()
    )
    assert split_tokens(100, 3) == [34, 33, 33] and split_tokens(2, 3) == [1, 1, 0] and split_tokens(7, 1) == [7]
    with pytest.raises(ValueError, match="turns per episode are whole numbers >= 1"):
        EpisodeModel(turns={0: 1})
    with pytest.raises(ValueError, match="tool_s = -1"):
        EpisodeModel(tool_s=-1)


def _digest(r: SimResult) -> str:
    """Every event time, count and summary line of a single-turn run, in the fields a run had before episodes."""
    parts = [repr(r.makespan), repr(r.generated_tokens), repr(r.generator_busy_s)]
    parts += [repr((s.step, s.start, s.end, s.prompt_ids, s.tokens)) for s in r.steps]
    parts += [repr((p.t, p.concurrency, p.weights_step, p.paused)) for p in r.trace]
    parts += [
        repr((s.prompt_id, s.index, s.attempt, s.start, s.end, s.tokens, s.worker, s.concurrency)) for s in r.samples
    ]
    parts.append(r.summary())
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


# Made by the simulator before it modelled episodes (commit b1de9c4).
SINGLE_TURN_DIGESTS = {
    "on_policy": "d4e4229bd04fdb03",
    "one_step_off": "363a08f0e6d681dd",
    "fully_async": "5cd9b506eb8bd067",
}


@pytest.mark.parametrize("strategy", list(SINGLE_TURN_DIGESTS))
def test_single_turn_episodes_give_the_event_trace_of_the_simulator_before_episodes(strategy):
    hw = dataclasses.replace(HW, latency_s=0.05, workers=2)
    costs = Costs(5e-5, 1.0, 2.0, pause_s=0.5)
    plain = simulate(long_tail_policy(strategy), LONG_TAIL, hw, costs)
    assert _digest(plain) == SINGLE_TURN_DIGESTS[strategy]
    # A model whose episodes all have one turn has no tool calls, whatever their time says.
    one_turn = EpisodeModel(turns={1: 10}, tool_s=3.0, tool_sd=1.0, env_tokens=50)
    assert _digest(simulate(long_tail_policy(strategy), LONG_TAIL, hw, costs, episodes=one_turn)) == _digest(plain)


def test_tool_calls_slow_a_long_tail_run_less_when_generation_overlaps_them():
    tools = EpisodeModel(turns={1: 1, 2: 1, 4: 1}, tool_s=2.0, tool_sd=1.0)
    on = simulate(long_tail_policy("on_policy"), LONG_TAIL, HW, TRAIN)
    on_tools = simulate(long_tail_policy("on_policy"), LONG_TAIL, HW, TRAIN, episodes=tools)
    fa = simulate(long_tail_policy("fully_async"), LONG_TAIL, HW, TRAIN)
    fa_tools = simulate(long_tail_policy("fully_async"), LONG_TAIL, HW, TRAIN, episodes=tools)
    assert on_tools.makespan > on.makespan and fa_tools.makespan > fa.makespan
    assert on_tools.generated_tokens == pytest.approx(on.generated_tokens)  # the same lengths, split over turns
    assert 2.0 < on_tools.turns_per_episode < 2.7 and on_tools.tool_s_per_episode > 1.5
    assert fa_tools.makespan - fa.makespan < on_tools.makespan - on.makespan
    assert max(p.concurrency for p in fa_tools.trace) <= 32 and max(fa_tools.counters.staleness) <= 2
