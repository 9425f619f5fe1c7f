"""The instruction-following benchmark (IFEval style): each prompt carries one or more verifiable
instructions (`evaluator.benchmarks.instructions`), sent as one chat user message. A completion is
scored at prompt level (every instruction followed, 0/1) and at instruction level (the fraction
followed), both strictly and loosely; the summary adds IFEval's pooled instruction-level accuracy
(followed instructions over all instructions) and the strict and loose accuracy of each instruction
type. Data: `<data_root>/ifeval/prompts.jsonl`, one {"id", "prompt", "instructions": [{"id",
"kwargs"}]} per line.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from functools import cached_property

from evaluator.benchmark import Benchmark, Case, ChatMessage, SampleScore, Sampling, summarize
from evaluator.benchmarks.instructions import Instruction, follows_loose, follows_strict

DATA_FILE = "ifeval/prompts.jsonl"
RECORD = 'an ifeval record {"id", "prompt", "instructions"} (see the module docstring for the format)'


class IFEval(Benchmark):
    name = "ifeval"
    primary = "prompt_strict/mean"
    sampling = Sampling(temperature=0.0, max_tokens=256)

    @cached_property
    def _cases(self) -> list[Case]:
        return self.jsonl_cases(DATA_FILE, RECORD, self._case)

    def _case(self, record: dict, lineno: int, where: str) -> Case:
        instructions = tuple(Instruction.parse(r, where) for r in record["instructions"])
        if not instructions:
            raise ValueError(f"case {record['id']!r} has no instructions")
        return Case(
            str(record["id"]),
            (ChatMessage("user", record["prompt"]),),
            self.sampling,
            1,
            {"instructions": instructions},
        )

    def cases(self) -> list[Case]:
        return self._cases

    def score(self, case: Case, completion: str) -> SampleScore:
        instructions: Sequence[Instruction] = case.context["instructions"]
        strict = [follows_strict(i, completion) for i in instructions]
        loose = [follows_loose(i, completion) for i in instructions]
        values = {
            "prompt_strict": float(all(strict)),
            "prompt_loose": float(all(loose)),
            "instruction_strict": sum(strict) / len(strict),
            "instruction_loose": sum(loose) / len(loose),
        }
        details = {"instructions": [i.id for i in instructions], "strict": strict, "loose": loose}
        return SampleScore(values, details)

    def summarize(self, per_case: Sequence[Sequence[SampleScore]]) -> dict[str, float]:
        metrics = summarize(per_case)
        totals: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # type -> [strict, loose, seen]
        for samples in per_case:
            for s in samples:
                for kind, st, lo in zip(
                    s.details["instructions"], s.details["strict"], s.details["loose"], strict=True
                ):
                    t = totals[kind]
                    t[0] += st
                    t[1] += lo
                    t[2] += 1
        seen = sum(t[2] for t in totals.values())
        metrics["instruction_level_strict"] = sum(t[0] for t in totals.values()) / seen
        metrics["instruction_level_loose"] = sum(t[1] for t in totals.values()) / seen
        for kind, (st, lo, n) in sorted(totals.items()):
            metrics[f"type/{kind}/strict"] = st / n
            metrics[f"type/{kind}/loose"] = lo / n
        return metrics
