"""Math word problems in GSM8K's JSONL format: one {"question", "answer"} per line, the reference
answer's final value after its last `#### `. The model is asked (one chat user message) to finish with
the answer in \\boxed{}; a completion's answer is its last \\boxed{} content, else its last number, and it
is compared with the reference by the verifier the RL task uses (`rollout.tasks.mathanswer`), so
training reward and evaluation agree. Data: `<data_root>/gsm8k/test.jsonl`.
"""

from __future__ import annotations

from functools import cached_property

from evaluator.benchmark import Benchmark, Case, ChatMessage, SampleScore, Sampling
from rollout.tasks.mathanswer import answers_equal, extract_answer

DATA_FILE = "gsm8k/test.jsonl"
RECORD = "a JSON object with 'question' and an 'answer' ending in '#### N'"
INSTRUCTION = "Solve the problem step by step. Write the final answer as \\boxed{N} at the end."


def final_answer(answer: str) -> str:
    """The reference value of a GSM8K answer: the text after its last '####', without thousands commas."""
    head, sep, tail = answer.rpartition("####")
    if not sep or not tail.strip():
        raise ValueError(f"GSM8K answer {answer[-80:]!r} has no final value after '####'")
    return tail.strip().replace(",", "")


class GSM8K(Benchmark):
    name = "gsm8k"
    primary = "accuracy/mean"
    sampling = Sampling(temperature=0.0, max_tokens=256)

    @cached_property
    def _cases(self) -> list[Case]:
        return self.jsonl_cases(DATA_FILE, RECORD, self._case)

    def _case(self, record: dict, lineno: int, where: str) -> Case:
        question, gold = record["question"], final_answer(record["answer"])
        prompt = (ChatMessage("user", f"{question}\n{INSTRUCTION}"),)
        return Case(str(record.get("id", f"gsm8k-{lineno}")), prompt, self.sampling, 1, {"answer": gold})

    def cases(self) -> list[Case]:
        return self._cases

    def score(self, case: Case, completion: str) -> SampleScore:
        pred = extract_answer(completion)
        correct = answers_equal(pred, case.context["answer"])
        return SampleScore({"accuracy": float(correct)}, {"extracted": pred})
