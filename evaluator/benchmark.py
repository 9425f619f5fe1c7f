"""The benchmark protocol: a benchmark yields `Case`s (a prompt as text or chat messages, sampling
parameters, how many samples to draw, and a scoring context that is never sent to the model) and
scores each sampled completion into named per-sample values in [0, 1]. `summarize` turns those into
the metrics every benchmark reports: for each value its mean and standard deviation over all samples
and, for 0/1 values, the unbiased pass@k estimate averaged over items. Benchmarks are looked up by
name in `BENCHMARKS` and imported on first use; constructing one only records its options (data is
parsed, and heavy libraries imported, when `cases()` or `score()` first needs them). All data lives
under one root directory (`evaluator.data_root`); nothing is downloaded.
"""

from __future__ import annotations

import importlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import EpisodeConfig, TaskConfig
from common.jsonl import read_jsonl

if TYPE_CHECKING:
    from evaluator.backend import Backend
    from evaluator.runner import EvalResult, Snapshot, VersionProbe

# name -> "module:class"; imported lazily by `load_benchmark` so listing names costs nothing.
BENCHMARKS = {
    "arithmetic": "evaluator.benchmarks.arithmetic:HeldOutArithmetic",
    "arithmetic_train": "evaluator.benchmarks.arithmetic:TrainingArithmetic",
    "gsm8k": "evaluator.benchmarks.gsm8k:GSM8K",
    "ifeval": "evaluator.benchmarks.ifeval:IFEval",
    "ifeval_google": "evaluator.benchmarks.ifeval_published:IFEvalPublished",
    "tool_arithmetic": "evaluator.benchmarks.tool_arithmetic:ToolArithmetic",
}


class BenchmarkError(ValueError):
    """A benchmark name, option or data file is wrong; the message names it and the fix."""


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class Sampling:
    """Sampling parameters of one case (OpenAI request fields)."""

    temperature: float = 0.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None

    def request_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"temperature": self.temperature, "top_p": self.top_p, "max_tokens": self.max_tokens}
        if self.stop:
            fields["stop"] = list(self.stop)
        if self.seed is not None:
            fields["seed"] = self.seed
        return fields


@dataclass(frozen=True)
class Case:
    """One prompt of a benchmark. `prompt` is text (sent to /v1/completions) or chat messages (sent to
    /v1/chat/completions); `context` is what the scorer needs (the reference answer, the
    instructions) and never leaves this process."""

    id: str
    prompt: str | tuple[ChatMessage, ...]
    sampling: Sampling
    samples: int = 1
    context: Mapping[str, Any] = field(default_factory=dict)

    @property
    def chat(self) -> bool:
        return not isinstance(self.prompt, str)

    def prompt_json(self) -> str | list[dict[str, str]]:
        """The prompt as it goes into a request body."""
        if isinstance(self.prompt, str):
            return self.prompt
        return [{"role": m.role, "content": m.content} for m in self.prompt]


@dataclass(frozen=True)
class SampleScore:
    """Scores of one completion: named values in [0, 1], plus free-form details for the per-case log."""

    values: Mapping[str, float]
    details: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalOptions:
    """Overrides a run applies to every case of a benchmark (None keeps the benchmark's own)."""

    samples: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if self.samples is not None and self.samples < 1:
            raise BenchmarkError(f"samples = {self.samples}: draw at least 1 sample per prompt")
        if self.limit is not None and self.limit < 1:
            raise BenchmarkError(f"limit = {self.limit}: evaluate at least 1 case (or leave limit unset)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise BenchmarkError(f"max_tokens = {self.max_tokens} must be at least 1")

    def apply(self, cases: Sequence[Case]) -> list[Case]:
        out = []
        for case in cases[: self.limit] if self.limit is not None else cases:
            s = case.sampling
            sampling = replace(
                s,
                temperature=s.temperature if self.temperature is None else self.temperature,
                top_p=s.top_p if self.top_p is None else self.top_p,
                max_tokens=s.max_tokens if self.max_tokens is None else self.max_tokens,
                seed=s.seed if self.seed is None else self.seed,
            )
            out.append(replace(case, sampling=sampling, samples=case.samples if self.samples is None else self.samples))
        return out


class Benchmark(ABC):
    """A named set of cases and the scorer of their completions."""

    name: str = ""
    primary: str = ""
    """The metric reported as the benchmark's score (in the evals stream), e.g. 'accuracy/mean'."""
    runs_whole = False
    """True for a benchmark that makes and scores its own requests (an lm-eval task): evaluator.runner.evaluate
    hands it the endpoint through its `run` method instead of generating its cases."""

    def __init__(
        self,
        data_root: str | Path,
        train_task: TaskConfig | None = None,
        chat: bool = False,
        episode: EpisodeConfig | None = None,
    ) -> None:
        self.data_root = Path(data_root)
        # The run's RL task, for benchmarks that follow the training distribution (held-out arithmetic).
        self.train_task = train_task
        # Such a benchmark's prompts go through the chat template when the RL prompts do (rollout.chat).
        self.chat = chat
        # The run's rollout.episode, for benchmarks played as episodes of its tools (tool_arithmetic); None: the
        # section's defaults.
        self.episode = episode

    def data_file(self, relative: str) -> Path:
        """A file under the data root; a missing one is an error naming the path and the setting."""
        path = self.data_root / relative
        if not path.is_file():
            raise BenchmarkError(
                f"benchmark {self.name!r}: data file {path} does not exist; set evaluator.data_root (or --data-root) "
                "to the directory holding the benchmark data (the repo ships it in evaluator/data)"
            )
        return path

    def jsonl_cases(self, relative: str, expected: str, case_of: Callable[[dict, int, str], Case]) -> list[Case]:
        """The cases of a JSONL data file, one per record: `case_of(record, line, "path:line")` makes each, and a
        record it cannot read (KeyError, TypeError, ValueError) is a BenchmarkError naming the line and
        `expected`, as is a file with no record."""
        path = self.data_file(relative)
        cases = []
        for lineno, record in read_jsonl(path, expected, BenchmarkError):
            where = f"{path}:{lineno}"
            try:
                cases.append(case_of(record, lineno, where))
            except (KeyError, TypeError, ValueError) as exc:
                raise BenchmarkError(f"{where}: expected {expected} ({exc})") from None
        if not cases:
            raise BenchmarkError(f"{path} holds no cases")
        return cases

    @abstractmethod
    def cases(self) -> list[Case]:
        """Every case, in a fixed order (parsed on first call)."""

    @abstractmethod
    def score(self, case: Case, completion: str) -> SampleScore:
        """Scores of one completion of a case."""

    def summarize(self, per_case: Sequence[Sequence[SampleScore]]) -> dict[str, float]:
        """The benchmark's metrics from the scores of every sample of every case."""
        return summarize(per_case)

    async def run(
        self,
        backend: Backend,
        out_dir: Path,
        probe: VersionProbe,
        options: EvalOptions,
        max_concurrent: int,
        expect: Snapshot | None,
    ) -> EvalResult:
        """A `runs_whole` benchmark's own evaluation (evaluator.benchmarks.lm_eval_task says what it does)."""
        raise BenchmarkError(f"benchmark {self.name!r} has cases; evaluate it with evaluator.runner.evaluate")


def load_benchmark(
    name: str,
    data_root: str | Path,
    train_task: TaskConfig | None = None,
    chat: bool = False,
    lm_eval_include_path: str = "",
    episode: EpisodeConfig | None = None,
) -> Benchmark:
    """The benchmark registered under `name`, constructed over `data_root` (cheap: no data is read yet); `chat`:
    prompts that follow the training task are chat messages, as the RL prompts are templated. "lm_eval:<task>" is
    lm-evaluation-harness's task (evaluator/benchmarks/lm_eval_task.py), looked up also under
    `lm_eval_include_path`. `episode` is the run's rollout.episode, which a benchmark played as tool episodes
    (tool_arithmetic) follows: its tools, turn and token budget (None: the section's defaults)."""
    if name.startswith("lm_eval:"):
        # Imported by name, as BENCHMARKS are: lm_eval_task's run() builds on evaluator.runner, which imports this.
        lm_eval_task = importlib.import_module("evaluator.benchmarks.lm_eval_task")
        return lm_eval_task.LmEvalTask(name, lm_eval_include_path)
    target = BENCHMARKS.get(name)
    if target is None:
        raise BenchmarkError(
            f"unknown benchmark {name!r}; choose one of: {', '.join(sorted(BENCHMARKS))}, or 'lm_eval:<task>' for an "
            "lm-evaluation-harness task"
        )
    module_name, cls_name = target.split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    return cls(data_root, train_task, chat, episode)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one item with n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as a running product (Chen et al., 2021) so large n never overflows or loses precision.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_ks(n: int) -> list[int]:
    """The k reported for n samples per item: powers of two up to n, and n itself."""
    ks = [1 << i for i in range(n.bit_length()) if (1 << i) <= n]
    return ks if ks[-1] == n else ks + [n]


def summarize(per_case: Sequence[Sequence[SampleScore]]) -> dict[str, float]:
    """mean and std (population, over all samples) of every value; pass@k averaged over items for values
    that are all 0 or 1 and when every item has the same number of samples."""
    if not per_case or any(not samples for samples in per_case):
        raise ValueError("summarize needs at least one case, each with at least one scored sample")
    names = sorted({name for samples in per_case for s in samples for name in s.values})
    metrics: dict[str, float] = {}
    counts = {len(samples) for samples in per_case}
    for name in names:
        rows = [[float(s.values[name]) for s in samples] for samples in per_case]
        flat = [v for row in rows for v in row]
        mean = sum(flat) / len(flat)
        metrics[f"{name}/mean"] = mean
        metrics[f"{name}/std"] = math.sqrt(sum((v - mean) ** 2 for v in flat) / len(flat))
        if len(counts) == 1 and all(v in (0.0, 1.0) for v in flat):
            n = next(iter(counts))
            for k in pass_ks(n):
                metrics[f"{name}/pass@{k}"] = sum(pass_at_k(n, int(sum(row)), k) for row in rows) / len(rows)
    metrics["cases"] = float(len(per_case))
    metrics["samples"] = float(sum(len(samples) for samples in per_case))
    return metrics
