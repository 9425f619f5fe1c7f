"""Held-out arithmetic: problems of the RL arithmetic task (`rollout.tasks.arithmetic`: same generator,
same prompt rendering, same exact verifier) that training never draws. A hash of each problem's text puts
a fixed `heldout_fraction` of all problems on the held-out side (`rollout.tasks.arithmetic.heldout_side`):
the training generator (the RL prompts, the supervised warm start, a mixture's arithmetic source) redraws
every problem that lands there, and this benchmark asks only those, from a held-out seed.
`<data_root>/arithmetic/heldout.json` fixes the seed, the number of problems, max_tokens and the
generator's knobs; the shipped file asks for 200 problems of two operands in 0..20 joined by + or -, a
quarter of all such problems held out. Given the run's task config (`train_task`, which the evaluator role
and `slipstream eval --config` pass), the knobs (operand counts, max_value, operators, heldout_fraction)
follow training instead, so the held-out problems come from the distribution the policy is trained on
(less the problems it trains on), and a held-out seed equal to the training seed is refused. A small
problem space has few held-out problems (two operands in 0..6 are 98 facts, 24 of them held out at 0.25):
the 200 cases then repeat them, each weighed by how often the generator draws it. A case id names the
seed, every knob and the index (`case_id`), so two different prompts never share an id, whatever the
config. When the run's RL prompts go through the tokenizer's chat template (rollout.chat_template), so do
these: each is one user message (its id ends in "-chat").

`arithmetic_train` asks the other side of the same split: problems of the facts training does draw, from
the benchmark's own seed (ids `arith-train-...`). Its greedy accuracy is how well a version does the task
it is trained on (what the held-out benchmark measured before the split, when the two sides were one
set), not generalisation: the end-to-end tests judge that RL learns by it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import cached_property

from common.config import PromptSourceConfig, TaskConfig
from evaluator.benchmark import Benchmark, BenchmarkError, Case, ChatMessage, SampleScore, Sampling
from rollout.tasks import Problem
from rollout.tasks.arithmetic import GENERATOR_KNOBS, ArithmeticTask, verify

DATA_FILE = "arithmetic/heldout.json"
# Operators spelled as letters in case ids ("2+3-1" style ids would be unreadable).
OPERATOR_LETTERS = {"+": "p", "-": "m", "*": "t"}


@dataclass(frozen=True)
class HeldOutSpec:
    seed: int
    count: int
    min_operands: int
    max_operands: int
    max_value: int
    operators: str
    max_tokens: int
    heldout_fraction: float


def case_id(spec: HeldOutSpec, index: int, prefix: str = "arith") -> str:
    """`<prefix>-<seed>-<min>to<max>ops-max<max_value>-<operators as letters>-h<heldout_fraction>-<index>`: the
    problem is a pure function of exactly these, so equal ids mean equal prompts (the count and max_tokens
    change no prompt)."""
    ops = "".join(OPERATOR_LETTERS[op] for op in spec.operators)
    return (
        f"{prefix}-{spec.seed}-{spec.min_operands}to{spec.max_operands}ops-max{spec.max_value}-{ops}"
        f"-h{spec.heldout_fraction:g}-{index}"
    )


class HeldOutArithmetic(Benchmark):
    name = "arithmetic"
    primary = "accuracy/mean"
    heldout = True  # the side of the split (`heldout_side`) this benchmark asks
    id_prefix = "arith"

    @cached_property
    def spec(self) -> HeldOutSpec:
        path = self.data_file(DATA_FILE)
        try:
            spec = HeldOutSpec(**json.loads(path.read_text()))
        except (json.JSONDecodeError, TypeError) as exc:
            raise BenchmarkError(f"{path}: expected a JSON object with the fields of HeldOutSpec ({exc})") from None
        if not spec.operators or set(spec.operators) - set(OPERATOR_LETTERS):
            raise BenchmarkError(
                f"{path}: operators = {spec.operators!r}; use a non-empty subset of {''.join(OPERATOR_LETTERS)!r}"
            )
        if not 0 < spec.heldout_fraction < 1:
            raise BenchmarkError(f"{path}: heldout_fraction = {spec.heldout_fraction}; give a share in (0, 1)")
        t = self.train_task
        if t is None:
            return spec
        gen: TaskConfig | PromptSourceConfig = t  # the arithmetic generator the training task draws from
        if t.kind == "mixture":
            # A prompt mixture is followed through its one arithmetic generator (same field names).
            generators = [src for src in t.sources if src.format == "arithmetic"]
            if len(generators) != 1:
                raise BenchmarkError(
                    f"benchmark 'arithmetic' follows the training task's arithmetic generator, but the prompt "
                    f"mixture has {len(generators)} sources of format 'arithmetic'; give it exactly one, or "
                    "evaluate another benchmark"
                )
            gen = generators[0]
        elif t.kind != "arithmetic":
            raise BenchmarkError(
                f"benchmark 'arithmetic' follows the training task, but rollout.task.kind = {t.kind!r}; "
                "evaluate another benchmark or train on arithmetic"
            )
        if gen.seed == spec.seed:
            raise BenchmarkError(f"{self.name} seed {spec.seed} ({path}) equals rollout.task.seed; change one of them")
        return dataclasses.replace(spec, **{k: getattr(gen, k) for k in GENERATOR_KNOBS})

    @cached_property
    def task(self) -> ArithmeticTask:
        """The generator of this benchmark's problems (`spec`'s seed, count and knobs, this side of the split),
        whose `reward` is the exact verifier `score` applies."""
        s = self.spec
        knobs = {k: getattr(s, k) for k in GENERATOR_KNOBS}
        return ArithmeticTask(seed=s.seed, num_problems=s.count, heldout=self.heldout, **knobs)

    @cached_property
    def problems(self) -> list[Problem]:
        """Every problem, in case order (the i-th case asks the i-th problem)."""
        return [self.task.problem(i) for i in range(len(self.task))]

    @cached_property
    def _cases(self) -> list[Case]:
        s = self.spec
        sampling = Sampling(temperature=0.0, max_tokens=s.max_tokens)
        problems = self.problems
        if not self.chat:
            return [
                Case(case_id(s, i, self.id_prefix), p.prompt, sampling, 1, {"answer": p.answer})
                for i, p in enumerate(problems)
            ]
        # One user turn, which vLLM's chat route renders with the served model's template: the RL prompt's tokens.
        return [
            Case(
                f"{case_id(s, i, self.id_prefix)}-chat",
                (ChatMessage("user", p.prompt),),
                sampling,
                1,
                {"answer": p.answer},
            )
            for i, p in enumerate(problems)
        ]

    def cases(self) -> list[Case]:
        return self._cases

    def score(self, case: Case, completion: str) -> SampleScore:
        return SampleScore({"accuracy": float(verify(completion, case.context["answer"]))})


class TrainingArithmetic(HeldOutArithmetic):
    """The training side of the split (the module docstring): the facts RL trains on, from this benchmark's seed."""

    name = "arithmetic_train"
    heldout = False
    id_prefix = "arith-train"
