"""Running one benchmark against one OpenAI-compatible URL, and the `slipstream eval` command.

`evaluate` takes a benchmark's cases, serves what it can from the result cache (keyed by weight
version, model, prompt and sampling), generates the rest through a `Backend` with at most
`max_concurrent` requests in flight, scores every sample and writes `<name>[.v<version>].cases.jsonl`
(one line per case: prompt, completions, scores) and `<name>[.v<version>].summary.json` under the
output directory. Version-exactness: the served weight version is read by a `VersionProbe` before and
after each chunk of requests; a chunk is cached only when both readings equal the version the
evaluation started at, otherwise `VersionMoved` is raised and nothing of that chunk is kept (the
watcher then moves on to the newest version). Against a plain URL the probe is its /weight_info (vLLM
dev mode) or, when that route is absent, a fixed label (`--weight-version`, else "unversioned",
stated in the summary).

`eval_plan` is the one place that turns a run's `[evaluator]` section and its `rollout.task` into
benchmarks and generation settings: the evaluator role and `slipstream eval --config` both build from
it, so the command reproduces a score the run recorded for a version.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from common.config import Config, ConfigError, EvaluatorConfig, TaskConfig, load_config
from common.log import setup as setup_logging
from evaluator.backend import Backend, Generation, RequestError, RetryPolicy
from evaluator.benchmark import BENCHMARKS, Benchmark, BenchmarkError, Case, EvalOptions, SampleScore, load_benchmark
from evaluator.cache import ResultCache, fingerprint

log = logging.getLogger(__name__)

UNVERSIONED = "unversioned"
PROMPT_TOO_LONG = "prompt_too_long"


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


def eval_plan(ev: EvaluatorConfig, train_task: TaskConfig | None) -> EvalPlan:
    """The evaluations `ev` asks for, each benchmark built over `ev.data_root` and following `train_task`
    (None: the benchmarks' own data files decide, e.g. held-out arithmetic's knobs)."""
    return EvalPlan(
        benchmarks=[load_benchmark(name, ev.data_root, train_task) for name in ev.benchmarks],
        options=EvalOptions(limit=ev.limit or None, max_tokens=ev.max_tokens or None),
        max_concurrent=ev.max_concurrent,
        chunk_cases=ev.chunk_cases,
    )


def output_paths(out_dir: Path, benchmark: str, version: str) -> tuple[Path, Path]:
    stem = benchmark if version == UNVERSIONED else f"{benchmark}.v{version}"
    return out_dir / f"{stem}.summary.json", out_dir / f"{stem}.cases.jsonl"


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


async def _generate(backend: Backend, case: Case, max_model_len: int) -> tuple[Generation, int, int]:
    """(generation, prompt tokens, max_tokens sent); a prompt that leaves no room yields empty samples."""
    assert backend.counter is not None
    prompt_tokens = await backend.counter.count(case)
    max_tokens = min(case.sampling.max_tokens, max_model_len - prompt_tokens)
    if max_tokens < 1:
        log.warning("case %s: prompt of %d tokens leaves no room in max_model_len %d; scored as empty",
                    case.id, prompt_tokens, max_model_len)  # fmt: skip
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
    log.info("%s at version %s: %d cases, %d cached, %d to generate", benchmark.name, version, len(cases), cached,
             len(todo))  # fmt: skip
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
            cache.put(keys[case.id], {"version": version, "case": case.id, "texts": gen.texts,
                                      "finish_reasons": gen.finish_reasons, "prompt_tokens": prompt_tokens,
                                      "max_tokens": max_tokens, "completion_tokens": gen.completion_tokens})  # fmt: skip

    def score_all() -> tuple[list[list[SampleScore]], list[dict[str, Any]]]:
        per_case, lines = [], []
        for case in cases:
            rec = cache.get(keys[case.id])
            assert rec is not None
            scores = [benchmark.score(case, text) for text in rec["texts"]]
            per_case.append(scores)
            lines.append({
                "case": case.id, "version": version, "prompt": case.prompt_json(), "max_tokens": rec["max_tokens"],
                "prompt_tokens": rec["prompt_tokens"], "completions": rec["texts"],
                "finish_reasons": rec["finish_reasons"], "scores": [dict(s.values) for s in scores],
                "details": [dict(s.details) for s in scores], "cached": case.id not in todo_ids,
            })  # fmt: skip
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
    _write_atomic(cases_path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
    _write_atomic(summary_path, json.dumps(asdict(result), indent=2) + "\n")
    log.info("%s at version %s: %s = %.4f (%d generated, %d cached, %.1fs)", benchmark.name, version,
             benchmark.primary, result.score, result.generated, result.cached, result.seconds)  # fmt: skip
    return result


# ----------------------------------------------------------------------------------------------
# slipstream eval
# ----------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream eval",
        description="Run benchmarks against an OpenAI-compatible URL (the router, a vLLM server, ...). With "
        "--config or --run-dir, the benchmarks are built exactly as that run's evaluator role builds them "
        "(evaluator.benchmarks, data_root, limit, max_tokens, max_concurrent, the training task's knobs, "
        "rollout.served_model_name), so a score the run recorded for a version is reproduced; flags given on "
        "the command line win over the config.",
    )
    p.add_argument("--url", required=True, help="base URL of the server, e.g. http://127.0.0.1:8000")
    run = p.add_mutually_exclusive_group()
    run.add_argument("--config", help="the run's TOML config (e.g. configs/demo.toml): evaluate as its evaluator does")
    run.add_argument("--run-dir", help="a run dir made by `slipstream launch`: use its config.toml as --config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value of --config / --run-dir's config, e.g. --set evaluator.limit=50")  # fmt: skip
    p.add_argument("--benchmark", action="append", choices=sorted(BENCHMARKS),
                   help="benchmark to run (repeat for several; default with a config: evaluator.benchmarks)")  # fmt: skip
    p.add_argument("--model", help="served model name (default: rollout.served_model_name with a config, else the "
                   "only one the server lists)")  # fmt: skip
    p.add_argument("--out", default="runs/eval", help="output dir: cache.jsonl, per-case JSONL, summary JSON")
    p.add_argument("--data-root", help="directory holding the benchmarks' data (default: evaluator.data_root, "
                   "evaluator/data)")  # fmt: skip
    p.add_argument("--samples", type=int, help="samples per prompt (enables pass@k)")
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--max-tokens", type=int, help="largest completion; clamped to max_model_len - prompt tokens")
    p.add_argument("--seed", type=int, help="sampling seed sent with every request")
    p.add_argument("--limit", type=int, help="evaluate only the first N cases")
    p.add_argument("--max-concurrent", type=int, help="requests in flight at once (default: evaluator.max_concurrent)")
    p.add_argument("--tokenizer", help="tokenizer dir for counting prompt tokens (default: the served model's)")
    p.add_argument("--weight-version", help="version label when the server has no /weight_info route")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request before it is retried")
    p.add_argument("--max-retries", type=int, default=6, help="retries of transport errors and 408/425/429/5xx")
    p.add_argument("--token", default=os.environ.get("SLIPSTREAM_TOKEN", ""),
                   help="bearer token (default: $SLIPSTREAM_TOKEN)")  # fmt: skip
    return p


def run_config(args: argparse.Namespace) -> Config | None:
    """The config named by --config or --run-dir (with --set applied), or None when neither was given."""
    if args.run_dir is not None:
        path = Path(args.run_dir) / "config.toml"
        if not path.is_file():
            raise ConfigError(f"--run-dir {args.run_dir}: no config.toml there; give a run dir that "
                              "`slipstream launch` created, or pass --config CONFIG")  # fmt: skip
        return load_config(path, args.overrides)
    if args.config is not None:
        return load_config(args.config, args.overrides)
    if args.overrides:
        raise ConfigError(f"--set {args.overrides[0]} needs a config to apply to; pass --config CONFIG or --run-dir")
    return None


def cli_plan(args: argparse.Namespace, cfg: Config | None) -> EvalPlan:
    """What `slipstream eval` evaluates: `eval_plan` of the config's evaluator section and training task, with
    the flags given applied on top. Without a config: the flags over EvaluatorConfig's defaults, and no
    training task (held-out arithmetic then takes its data file's knobs)."""
    ev = cfg.evaluator if cfg is not None else EvaluatorConfig(benchmarks=[])
    flags = {"benchmarks": args.benchmark, "data_root": args.data_root, "limit": args.limit,
             "max_tokens": args.max_tokens, "max_concurrent": args.max_concurrent}  # fmt: skip
    ev = dataclasses.replace(ev, **{k: v for k, v in flags.items() if v is not None})
    if not ev.benchmarks:
        raise BenchmarkError("no benchmark to run: pass --benchmark NAME (or --config CONFIG to run the config's "
                             "evaluator.benchmarks)")  # fmt: skip
    result = eval_plan(ev, cfg.rollout.task if cfg is not None else None)
    extra = {"samples": args.samples, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    options = dataclasses.replace(result.options, **{k: v for k, v in extra.items() if v is not None})
    return dataclasses.replace(result, options=options)


async def probe_for(backend: Backend, label: str | None) -> VersionProbe:
    """/weight_info of the URL when it has one (and no label was given), else the label or UNVERSIONED."""
    if label:
        return FixedVersion(label)
    probe = WeightInfoProbe(backend, backend.url)
    try:
        await probe.read()
        return probe
    except RequestError as exc:
        log.warning("%s has no usable /weight_info (%s); results are labelled %r and the cache assumes the "
                    "served weights do not change; pass --weight-version to label them", backend.url, exc,
                    UNVERSIONED)  # fmt: skip
        return FixedVersion(UNVERSIONED)


async def run_cli(args: argparse.Namespace) -> list[EvalResult]:
    cfg = run_config(args)
    todo = cli_plan(args, cfg)
    model = args.model or (cfg.rollout.served_model_name if cfg is not None else None)
    out = Path(args.out)
    results = []
    async with aiohttp.ClientSession() as session:
        backend = Backend(session, args.url, model, args.timeout, RetryPolicy(args.max_retries), args.token)
        await backend.describe()
        await backend.choose_counter(args.tokenizer)
        probe = await probe_for(backend, args.weight_version)
        with ResultCache(out / "cache.jsonl") as cache:
            for bench in todo.benchmarks:
                results.append(await evaluate(bench, backend, cache, out, probe, todo.options, todo.max_concurrent,
                                              todo.chunk_cases))  # fmt: skip
    return results


def cli_main(argv: Sequence[str]) -> int:
    """`slipstream eval ...`: print one line per benchmark; exit 1 on a request or data error, 2 on a config error."""
    args = build_parser().parse_args(list(argv))
    setup_logging("eval", "-")
    try:
        results = asyncio.run(run_cli(args))
    except ConfigError as exc:
        print(f"slipstream eval: config error: {exc}", file=sys.stderr)
        return 2
    except (RequestError, BenchmarkError, VersionMoved) as exc:
        print(f"slipstream eval: {exc}", file=sys.stderr)
        return 1
    for r in results:
        print(f"{r.benchmark} version={r.version} {r.primary}={r.score:.4f} cases={r.cases} generated={r.generated} "
              f"cached={r.cached} summary={r.summary_path}")  # fmt: skip
    return 0
