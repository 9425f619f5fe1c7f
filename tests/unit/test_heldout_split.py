"""The held-out arithmetic set shares no problem with training (issue 39 item 3): a hash of a problem's text
splits every problem space in two, the training generator (RL prompts, the supervised warm start, a
mixture's arithmetic source) draws only one side and the held-out benchmark only the other. Checked on the
demo's config by enumerating every problem its knobs can produce, and by drawing every problem the demo
trains on. Real parts only: the shipped config, generator and benchmark data."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from common.config import ConfigError, TaskConfig, load_config
from evaluator.benchmark import load_benchmark
from rollout.tasks import Problem
from rollout.tasks.arithmetic import ArithmeticTask, heldout_side
from rollout.tasks.load import load_task

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "evaluator" / "data"
DEMO = ROOT / "configs" / "demo.toml"
# The fully-async end-to-end test's prompt mixture (tests/e2e/test_rl_e2e.py MIXTURE): arithmetic 80%, words 20%.
MIXTURE = [
    "rollout.task.kind=mixture",
    'rollout.task.sources=[{name = "arithmetic", format = "arithmetic", weight = 0.8, max_value = 6}, '
    '{name = "words", path = "configs/data/word_problems.jsonl", weight = 0.2, repeat = true}]',
    "trainer.warmup.steps=150",
]


def every_expression(cfg: TaskConfig) -> set[str]:
    """Every expression the arithmetic generator can produce with a config's knobs."""
    values = [str(v) for v in range(cfg.max_value + 1)]
    out: set[str] = set()
    for n in range(cfg.min_operands, cfg.max_operands + 1):
        for vals in itertools.product(values, repeat=n):
            for ops in itertools.product(cfg.operators, repeat=n - 1):
                out.add(vals[0] + "".join(o + v for o, v in zip(ops, vals[1:], strict=True)))
    return out


def trained_problems(overrides: list[str]) -> list[Problem]:
    """Every problem a demo run of trainer.steps steps can train on: the RL prompts from the start of the
    data (each step's prompts, plus the flow's untrained backlog) and the warm start's from its end
    (trainer.rl.batch.warm_start_batch's indices)."""
    cfg = load_config(DEMO, overrides)
    task = load_task(cfg.rollout.task)
    n = len(task)
    rl = cfg.trainer.steps * cfg.flow.prompts_per_step + cfg.flow.max_untrained_prompts
    warm = cfg.trainer.warmup.steps * cfg.trainer.warmup.batch_size
    return [task.problem(i) for i in range(rl)] + [task.problem(n - 1 - (k % n)) for k in range(warm)]


@pytest.mark.parametrize("overrides", [[], MIXTURE], ids=["demo", "demo-mixture"])
def test_the_demo_never_trains_on_a_held_out_problem(overrides):
    cfg = load_config(DEMO, overrides)
    held_out = {c.prompt for c in load_benchmark("arithmetic", DATA, cfg.rollout.task).cases()}
    trained = {p.prompt for p in trained_problems(overrides) if "=" in p.prompt and p.prompt[0].isdigit()}
    assert held_out and not held_out & trained, sorted(held_out & trained)
    # Every problem the demo's knobs reach is on exactly one side, and both sides are drawn in full: the split
    # partitions the 98 facts (24 held out at 0.25) and the training run meets all of its own.
    knobs = load_config(DEMO).rollout.task
    space = {f"{e}=" for e in every_expression(knobs)}
    side = {e for e in space if heldout_side(e[:-1], knobs.heldout_fraction)}
    assert len(space) == 98 and held_out == side and trained == space - side, (len(side), len(trained))
    # arithmetic_train asks the other side (training facts only; its 200 draws miss a few of the rarest),
    # under ids of its own.
    train_bench = load_benchmark("arithmetic_train", DATA, cfg.rollout.task).cases()
    asked = {c.prompt for c in train_bench}
    assert asked <= trained and len(asked) > 0.9 * len(trained), (len(asked), len(trained))
    assert all(c.id.startswith("arith-train-") for c in train_bench)


def test_the_training_generator_never_emits_a_held_out_problem_and_the_benchmark_only_those():
    knobs = dict(min_operands=2, max_operands=3, max_value=9, operators="+-*", heldout_fraction=0.3)
    train = ArithmeticTask(seed=5, num_problems=3000, **knobs)  # type: ignore[arg-type]
    held = ArithmeticTask(seed=6, num_problems=3000, heldout=True, **knobs)  # type: ignore[arg-type]
    train_exprs = {train.problem(i).prompt[:-1] for i in range(len(train))}
    held_exprs = {held.problem(i).prompt[:-1] for i in range(len(held))}
    assert not any(heldout_side(e, 0.3) for e in train_exprs)
    assert all(heldout_side(e, 0.3) for e in held_exprs)
    # About 30% of the space is held out (1,100 problems of 2 operands and 1,000 x 9 of 3 here).
    space = every_expression(TaskConfig(**knobs))  # type: ignore[arg-type]
    share = sum(heldout_side(e, 0.3) for e in space) / len(space)
    assert abs(share - 0.3) < 0.01, share


def test_an_empty_side_of_the_split_is_refused_naming_the_knobs():
    # One possible problem, 0+0, which the hash holds out at 0.25: training has nothing left to draw.
    assert heldout_side("0+0", 0.25)
    with pytest.raises(ValueError, match=r"no training problem: heldout_fraction = 0.25 .* in 0..0 with '\+'"):
        ArithmeticTask(max_value=0, operators="+", heldout_fraction=0.25).problem(0)
    with pytest.raises(ValueError, match="heldout_fraction = 0.0 must be in"):
        ArithmeticTask(heldout_fraction=0.0, heldout=True)


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1])
def test_a_heldout_fraction_outside_0_1_is_refused_naming_the_key(value):
    with pytest.raises(ConfigError, match=rf"rollout.task.heldout_fraction = {value} must be in \(0, 1\)"):
        load_config(DEMO, [f"rollout.task.heldout_fraction={value}"])
    source = f'{{name = "a", format = "arithmetic", heldout_fraction = {value}}}'
    with pytest.raises(ConfigError, match=rf"sources\[0\] \('a'\).heldout_fraction = {value} must be in"):
        load_config(DEMO, ["rollout.task.kind=mixture", f"rollout.task.sources=[{source}]"])
