"""Running one benchmark against one OpenAI-compatible URL, and the plan of a run's evaluations.

`evaluate` serves what it can from the result cache (keyed by weight version, model, prompt and sampling),
generates the rest through a `Backend` with at most `max_concurrent` requests in flight, scores every sample
and writes `<name>[.v<version>].cases.jsonl` and `.summary.json`. It is version-exact: a `VersionProbe`
reads the served version before and after each chunk of requests, and a chunk is kept only when both equal
the version the evaluation started at (else `VersionMoved`). Against a plain URL the probe is /weight_info,
or a fixed label stated in the summary.

`eval_plan` turns a run's `[evaluator]` section and `rollout.task` into benchmarks and generation settings;
the evaluator role and `slipstream eval` both build from it, so the command reproduces a recorded score.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

from common.config import Config, EpisodeConfig, EvaluatorConfig, TaskConfig
from evaluator.backend import Backend, Generation, RequestError
from evaluator.benchmark import Benchmark, BenchmarkError, Case, EvalOptions, SampleScore, load_benchmark
from evaluator.cache import ResultCache, fingerprint
from rollout.chat import uses_chat_template

log = logging.getLogger(__name__)

UNVERSIONED = "unversioned"
PROMPT_TOO_LONG = "prompt_too_long"
# How a version is loaded into a worker only the evaluator uses: a load aborts nothing but leftovers of a
# killed evaluator (the evaluator role's pin mode and `slipstream eval --version` load the same way).
PIN_PAUSE_MODE = "abort"


class VersionMoved(RuntimeError):
    """The served weight version changed while a chunk was being generated; its results were discarded."""

    def __init__(self, expected: str, seen: str) -> None:
        super().__init__(f"weight version moved from {expected} to {seen} during the evaluation")
        self.expected, self.seen = expected, seen


class VersionProbe(Protocol):
    async def read(self) -> Any:
        """A snapshot of what is served: equal snapshots mean nothing changed; `.version` is the label."""
        ...


@dataclass(frozen=True)
class Snapshot:
    version: str
    detail: tuple[Any, ...] = ()


class FixedVersion:
    """A version label given by the caller (no way to observe the server's)."""

    def __init__(self, version: str) -> None:
        self.snapshot = Snapshot(version)

    async def read(self) -> Snapshot:
        return self.snapshot


class WeightInfoProbe:
    """The version a single vLLM server reports on GET /weight_info."""

    def __init__(self, backend: Backend, url: str) -> None:
        self.backend, self.url = backend, url.rstrip("/")

    async def read(self) -> Snapshot:
        info = await self.backend.get_json(self.url + "/weight_info")
        return Snapshot(str(info["weight_version"]))


async def probe_for(backend: Backend, label: str | None) -> VersionProbe:
    """/weight_info of the URL when it has one (and no label was given), else the label or UNVERSIONED."""
    if label:
        return FixedVersion(label)
    probe = WeightInfoProbe(backend, backend.url)
    try:
        await probe.read()
        return probe
    except RequestError as exc:
        log.warning(
            "%s has no usable /weight_info (%s); results are labelled %r and the cache assumes the "
            "served weights do not change; pass --weight-version to label them",
            backend.url,
            exc,
            UNVERSIONED,
        )
        return FixedVersion(UNVERSIONED)


@dataclass
class EvalResult:
    """What one evaluation of one benchmark at one version produced."""

    benchmark: str
    version: str
    model: str
    url: str
    primary: str
    score: float
    metrics: dict[str, float]
    cases: int
    generated: int
    cached: int
    prompt_too_long: int
    seconds: float
    summary_path: str
    cases_path: str
    options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalPlan:
    """Benchmarks and generation settings of a run's evaluations."""

    benchmarks: list[Benchmark]
    options: EvalOptions
    max_concurrent: int
    chunk_cases: int


def eval_plan(
    ev: EvaluatorConfig, train_task: TaskConfig | None, chat: bool = False, episode: EpisodeConfig | None = None
) -> EvalPlan:
    """The evaluations `ev` asks for, each benchmark built over `ev.data_root` and following `train_task`
    (None: the benchmarks' own data files decide, e.g. held-out arithmetic's knobs), with `chat`
    (`follows_chat_template`) its prompts templated as the RL prompts are, and a benchmark played as tool
    episodes following the run's `episode` section (rollout.episode; None: its defaults)."""
    return EvalPlan(
        benchmarks=[
            load_benchmark(name, ev.data_root, train_task, chat, ev.lm_eval_include_path, episode)
            for name in ev.benchmarks
        ],
        options=EvalOptions(limit=ev.limit or None, max_tokens=ev.max_tokens or None),
        max_concurrent=ev.max_concurrent,
        chunk_cases=ev.chunk_cases,
    )


def follows_chat_template(cfg: Config, run_dir: Path | None, tokenizer_dir: Path | None = None) -> bool:
    """Whether the run's RL prompts go through the policy tokenizer's chat template (rollout.chat_template
    "auto" and the tokenizer has one), so that the benchmarks following the training task template theirs.
    The tokenizer is rollout.model's, or that of `tokenizer_dir` when given (a published version carries its
    model's tokenizer and chat template: common/weights/model_files.py)."""
    if cfg.rollout.chat_template == "off":
        return False
    from transformers import AutoTokenizer

    from trainer.tinykit import resolve_model

    if tokenizer_dir is not None:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    else:
        # Without a run, a tiny kit's files are made in a scratch directory just to read its tokenizer.
        with tempfile.TemporaryDirectory() as scratch:
            tokenizer = AutoTokenizer.from_pretrained(resolve_model(cfg, run_dir or Path(scratch)))
    return uses_chat_template(tokenizer, cfg.rollout.chat_template)


def output_paths(out_dir: Path, benchmark: str, version: str) -> tuple[Path, Path]:
    stem = benchmark if version == UNVERSIONED else f"{benchmark}.v{version}"
    return out_dir / f"{stem}.summary.json", out_dir / f"{stem}.cases.jsonl"


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def _generate(backend: Backend, case: Case, max_model_len: int) -> tuple[Generation, int, int]:
    """(generation, prompt tokens, max_tokens sent); a prompt that leaves no room yields empty samples."""
    assert backend.counter is not None
    prompt_tokens = await backend.counter.count(case)
    max_tokens = min(case.sampling.max_tokens, max_model_len - prompt_tokens)
    if max_tokens < 1:
        log.warning(
            "case %s: prompt of %d tokens leaves no room in max_model_len %d; scored as empty",
            case.id,
            prompt_tokens,
            max_model_len,
        )
        return Generation([""] * case.samples, [PROMPT_TOO_LONG] * case.samples, prompt_tokens, 0), prompt_tokens, 0
    return await backend.generate(case, max_tokens), prompt_tokens, max_tokens


async def evaluate(
    benchmark: Benchmark,
    backend: Backend,
    cache: ResultCache,
    out_dir: str | Path,
    probe: VersionProbe,
    options: EvalOptions | None = None,
    max_concurrent: int = 32,
    chunk_cases: int = 64,
    expect: Snapshot | None = None,
) -> EvalResult:
    """Evaluate a benchmark at the version `probe` reports now (which must equal `expect` when given);
    see the module docstring."""
    started = time.monotonic()
    options = options or EvalOptions()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if benchmark.runs_whole:
        # lm-eval makes and scores its own requests: the task runs whole, version-checked as one chunk.
        return await benchmark.run(backend, out, probe, options, max_concurrent, expect)
    served = backend.served or await backend.describe()
    if backend.counter is None:
        await backend.choose_counter()
    cases = options.apply(await asyncio.to_thread(benchmark.cases))
    start = await probe.read()
    version = start.version
    if not getattr(start, "settled", True) or (expect is not None and start != expect):
        raise VersionMoved(expect.version if expect is not None else version, version)
    keys = {c.id: fingerprint(version, served.id, c) for c in cases}
    if len(keys) != len(cases):
        raise BenchmarkError(f"benchmark {benchmark.name!r} has duplicate case ids; ids must be unique")
    todo = [c for c in cases if cache.get(keys[c.id]) is None]
    todo_ids = {c.id for c in todo}
    cached = len(cases) - len(todo)
    log.info(
        "%s at version %s: %d cases, %d cached, %d to generate", benchmark.name, version, len(cases), cached, len(todo)
    )
    gate = asyncio.Semaphore(max_concurrent)

    async def one(case: Case) -> tuple[Case, Generation, int, int]:
        async with gate:
            return (case, *await _generate(backend, case, served.max_model_len))

    for lo in range(0, len(todo), chunk_cases):
        chunk = todo[lo : lo + chunk_cases]
        before = await probe.read()
        if before != start:
            raise VersionMoved(version, before.version)
        done = await asyncio.gather(*(one(c) for c in chunk))
        after = await probe.read()
        if after != start:
            raise VersionMoved(version, after.version)
        for case, gen, prompt_tokens, max_tokens in done:
            cache.put(
                keys[case.id],
                {
                    "version": version,
                    "case": case.id,
                    "texts": gen.texts,
                    "finish_reasons": gen.finish_reasons,
                    "prompt_tokens": prompt_tokens,
                    "max_tokens": max_tokens,
                    "completion_tokens": gen.completion_tokens,
                },
            )

    def score_all() -> tuple[list[list[SampleScore]], list[dict[str, Any]]]:
        per_case, lines = [], []
        for case in cases:
            rec = cache.get(keys[case.id])
            assert rec is not None
            scores = [benchmark.score(case, text) for text in rec["texts"]]
            per_case.append(scores)
            lines.append(
                {
                    "case": case.id,
                    "version": version,
                    "prompt": case.prompt_json(),
                    "max_tokens": rec["max_tokens"],
                    "prompt_tokens": rec["prompt_tokens"],
                    "completions": rec["texts"],
                    "finish_reasons": rec["finish_reasons"],
                    "scores": [dict(s.values) for s in scores],
                    "details": [dict(s.details) for s in scores],
                    "cached": case.id not in todo_ids,
                }
            )
        return per_case, lines

    per_case, lines = await asyncio.to_thread(score_all)
    metrics = benchmark.summarize(per_case)
    too_long = sum(1 for line in lines if PROMPT_TOO_LONG in line["finish_reasons"])
    summary_path, cases_path = output_paths(out, benchmark.name, version)
    result = EvalResult(
        benchmark=benchmark.name,
        version=version,
        model=served.id,
        url=backend.url,
        primary=benchmark.primary,
        score=metrics[benchmark.primary],
        metrics=metrics,
        cases=len(cases),
        generated=len(todo),
        cached=cached,
        prompt_too_long=too_long,
        seconds=time.monotonic() - started,
        summary_path=str(summary_path),
        cases_path=str(cases_path),
        options={k: v for k, v in asdict(options).items() if v is not None},
    )
    write_atomic(cases_path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    write_atomic(summary_path, json.dumps(asdict(result), indent=2) + "\n")
    log.info(
        "%s at version %s: %s = %.4f (%d generated, %d cached, %.1fs)",
        benchmark.name,
        version,
        benchmark.primary,
        result.score,
        result.generated,
        result.cached,
        result.seconds,
    )
    return result
