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
it, so the command reproduces a score the run recorded for a version. `slipstream eval --run-dir RUN
--version N` measures one published version as the run's evaluator did in pin mode: it loads
`<weight dir>/v<N>/` into a worker with `rollout.weights.apply_version` (the `--url` server, or a vLLM
server it starts for the run's model with the run's worker command line and environment and stops
afterwards) and prints the score the run recorded for N beside its own.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp

from common.config import Config, ConfigError, EvaluatorConfig, TaskConfig, load_config
from common.fleet import WorkerError
from common.http import RetryPolicy
from common.log import setup as setup_logging
from common.metrics import step_series
from common.net import bearer, free_port
from evaluator.backend import Backend, Generation, RequestError
from evaluator.benchmark import BENCHMARKS, Benchmark, BenchmarkError, Case, EvalOptions, SampleScore, load_benchmark
from evaluator.cache import ResultCache, fingerprint
from rollout.weights.versions import committed_versions, version_dir, weight_root
from rollout.weights.workers import apply_version

log = logging.getLogger(__name__)

UNVERSIONED = "unversioned"
PROMPT_TOO_LONG = "prompt_too_long"
# How a version is loaded into a worker only the evaluator uses: a load aborts nothing but leftovers of a
# killed evaluator (the evaluator role's pin mode and `slipstream eval --version` load the same way).
PIN_PAUSE_MODE = "abort"
# Where `slipstream eval --run-dir RUN` writes by default (under RUN; the role's own results are in evals/).
CLI_OUT = "eval-cli"
LOOPBACK = "127.0.0.1"


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


class ReproduceError(RuntimeError):
    """`slipstream eval` was asked for something it cannot evaluate (a version without a run, a version whose
    files are gone, no server at all); the message names the path and the fix."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="slipstream eval",
        description="Run benchmarks against an OpenAI-compatible URL (the router, a vLLM server, ...). With "
        "--config or --run-dir, the benchmarks are built exactly as that run's evaluator role builds them "
        "(evaluator.benchmarks, data_root, limit, max_tokens, max_concurrent, the training task's knobs, "
        "rollout.served_model_name), so a score the run recorded for a version is reproduced; flags given on "
        "the command line win over the config. With --run-dir RUN --version N, version N of the run is "
        "loaded from its published files into the --url server, or into a vLLM server started for the run's "
        "model as its workers were (and stopped afterwards), and the score the run recorded for N is printed "
        "beside the one measured.",
    )
    p.add_argument("--url", help="base URL of the server, e.g. http://127.0.0.1:8000 (with --version: a Slipstream "
                   "vLLM worker serving the run's model, whose weights are replaced; default with --version: start "
                   "one)")  # fmt: skip
    run = p.add_mutually_exclusive_group()
    run.add_argument("--config", help="the run's TOML config (e.g. configs/demo.toml): evaluate as its evaluator does")
    run.add_argument("--run-dir", help="a run dir made by `slipstream launch`: use its config.toml as --config")
    p.add_argument("--version", type=int, help="evaluate this published weight version of --run-dir's run, loaded from "
                   "<weight dir>/v<N>/ as the run's evaluator loads it")  # fmt: skip
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a value of --config / --run-dir's config, e.g. --set evaluator.limit=50")  # fmt: skip
    p.add_argument("--benchmark", action="append", choices=sorted(BENCHMARKS),
                   help="benchmark to run (repeat for several; default with a config: evaluator.benchmarks)")  # fmt: skip
    p.add_argument("--model", help="served model name (default: rollout.served_model_name with a config, else the "
                   "only one the server lists)")  # fmt: skip
    p.add_argument("--out", help=f"output dir: cache.jsonl, per-case JSONL, summary JSON, the log of a vLLM server "
                   f"it starts (default: <run dir>/{CLI_OUT} with a run dir, else runs/eval)")  # fmt: skip
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


def config_path(args: argparse.Namespace) -> Path | None:
    """The config file named by --run-dir (its config.toml) or --config; None when neither was given."""
    if args.run_dir is not None:
        path = Path(args.run_dir) / "config.toml"
        if not path.is_file():
            raise ConfigError(f"--run-dir {args.run_dir}: no config.toml there; give a run dir that "
                              "`slipstream launch` created, or pass --config CONFIG")  # fmt: skip
        return path
    return None if args.config is None else Path(args.config)


def run_config(args: argparse.Namespace) -> Config | None:
    """The config named by --config or --run-dir (with --set applied), or None when neither was given."""
    path = config_path(args)
    if path is not None:
        return load_config(path, args.overrides)
    if args.overrides:
        raise ConfigError(f"--set {args.overrides[0]} needs a config to apply to; pass --config CONFIG or --run-dir")
    return None


def run_dir_of(args: argparse.Namespace, cfg: Config | None) -> Path | None:
    """The run whose published versions and recorded scores the command uses: --run-dir, else the run dir that
    --config's run.dir names when one is there (a run's own config.toml names its dir); None without a run."""
    if args.run_dir is not None:
        return Path(args.run_dir)
    if cfg is not None and cfg.run.dir and (Path(cfg.run.dir) / "config.toml").is_file():
        return Path(cfg.run.dir)
    return None


def _versions_text(versions: Sequence[int]) -> str:
    """`1..50`, or the list when there are gaps (pinned versions)."""
    if list(versions) == list(range(versions[0], versions[-1] + 1)):
        return f"{versions[0]}..{versions[-1]}"
    return ", ".join(map(str, versions))


def version_files(cfg: Config, run_dir: Path, version: int) -> Path:
    """The directory of a version the run published; ReproduceError naming the path and the fix if it is gone."""
    root = weight_root(cfg.rollout, run_dir)
    location = version_dir(root, version)
    if location.is_dir():
        return location
    kept = committed_versions(root) if root.is_dir() else []
    if not kept:
        raise ReproduceError(
            f"--version {version}: {root} holds no published weight versions, so there is nothing to load (a run "
            "keeps its versions there only with rollout.weight_backend = 'file'); evaluate a server as it is with "
            "--url URL and no --version"
        )
    if version > kept[-1]:
        raise ReproduceError(f"--version {version}: {location} does not exist; the run published versions up to "
                             f"{kept[-1]} (kept: {_versions_text(kept)}); pick one of those")  # fmt: skip
    raise ReproduceError(
        f"--version {version}: {location} does not exist: the run pruned it (it keeps the newest "
        f"rollout.keep_versions = {cfg.rollout.keep_versions} versions and the pinned ones); pick one of the kept "
        f"versions {_versions_text(kept)}, or raise rollout.keep_versions for a run whose every version stays "
        "reproducible"
    )


def worker_setup(path: Path, overrides: Sequence[str], cfg: Config) -> tuple[Config, dict[str, str]]:
    """The config and the extra environment `slipstream launch` gave the vLLM worker the run's evaluator measured
    on: its eval-pool worker's (`[launch.roles.*] env` may override config keys and set vLLM variables), a train
    worker's when the evaluator went through the router (evaluator.pin = "never", or no eval pool); the run's own
    config and nothing extra when it launched no vLLM role."""
    roles = [spec for name, spec in cfg.launch.roles.items() if (spec.role or name) == "vllm"]
    workers = [(load_config(path, overrides, os.environ | spec.env), dict(spec.env)) for spec in roles]
    pool = "train" if cfg.evaluator.pin == "never" else "eval"
    chosen = [w for w in workers if w[0].rollout.pool == pool] or workers
    return chosen[0] if chosen else (cfg, {})


@contextlib.asynccontextmanager
async def started_worker(
    session: aiohttp.ClientSession, path: Path, overrides: Sequence[str], cfg: Config, run_dir: Path, out: Path
) -> AsyncIterator[str]:
    """A vLLM server for the run's model, started as the run's workers were (`rollout.worker.worker_vllm`) on a
    free loopback port, with its log under `out`; its URL once it has answered a completion. Stopped on exit,
    whatever happened."""
    from rollout.tinykit import resolve_model
    from rollout.worker import wait_ready, worker_vllm

    wcfg, extra_env = worker_setup(path, overrides, cfg)
    ro = wcfg.rollout
    model_dir = await asyncio.to_thread(resolve_model, wcfg, run_dir)
    port = free_port(LOOPBACK)
    url = f"http://{LOOPBACK}:{port}"
    log_path = out / "vllm.log"
    vllm = worker_vllm(ro, run_dir, model_dir, (LOOPBACK, port), url, log_path, "eval-cli", os.environ | extra_env,
                       echo=False)  # fmt: skip
    try:
        await vllm.start()
        log.info("waiting up to %.0fs (rollout.startup_timeout_s) for vLLM serving %s at %s (log %s)",
                 ro.startup_timeout_s, model_dir, url, log_path)  # fmt: skip
        took = await wait_ready(session, vllm, ro.served_model_name, ro.startup_timeout_s)
        log.info("vLLM ready after %.1fs", took)
        yield url
    finally:
        await vllm.stop()


async def load_version(session: aiohttp.ClientSession, url: str, version: int, location: Path) -> None:
    """Load a published version into the worker at url the way the evaluator role's pin mode does."""
    took = await apply_version(session, url, version, str(location), PIN_PAUSE_MODE)
    log.info("loaded weight version %d (%s) into %s in %.3fs", version, location, url, took)


def recorded_score(run_dir: Path, result: EvalResult) -> float | None:
    """The score the run's evaluator recorded for the version and benchmark of `result` (its metrics), if any."""
    if not result.version.isdigit():
        return None
    tag = f"eval/{result.benchmark}/{result.primary}"
    return step_series(run_dir, [tag], role="evaluator").get(tag, {}).get(int(result.version))


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


def check_target(args: argparse.Namespace, run_dir: Path | None) -> None:
    """What to evaluate must be clear: a --url, or a run's --version (which starts a server when --url is absent)."""
    if args.version is not None and args.version < 0:
        raise ReproduceError(f"--version {args.version}: weight versions are numbered from 0")
    if args.version is not None and run_dir is None:
        raise ReproduceError(f"--version {args.version} needs the run that published it: pass --run-dir RUN (a dir "
                             "made by `slipstream launch`), or a --config whose run.dir names that run")  # fmt: skip
    if args.version is not None and args.weight_version:
        raise ReproduceError(f"--weight-version {args.weight_version} labels a server without /weight_info, but "
                             f"--version {args.version} loads the version and reads it back there: drop one")  # fmt: skip
    if args.url is None and args.version is None:
        raise ReproduceError("nothing to evaluate: pass --url URL of a server, or --run-dir RUN --version N to "
                             "evaluate a published version of a run on a vLLM server started for it")  # fmt: skip


async def run_cli(args: argparse.Namespace) -> list[EvalResult]:
    cfg = run_config(args)
    run_dir = run_dir_of(args, cfg)
    check_target(args, run_dir)
    todo = cli_plan(args, cfg)
    model = args.model or (cfg.rollout.served_model_name if cfg is not None else None)
    if args.out:
        out = Path(args.out)
    else:
        out = Path("runs/eval") if run_dir is None else run_dir / CLI_OUT
    location = None
    if args.version is not None:
        assert cfg is not None and run_dir is not None
        location = version_files(cfg, run_dir, args.version)
    results = []
    # A run's workers may require its rollout.api_key; requests given --token send that instead.
    headers = bearer(cfg.rollout.api_key) if cfg is not None and location is not None else {}
    async with aiohttp.ClientSession(headers=headers) as session, contextlib.AsyncExitStack() as stack:
        url = args.url
        if url is None:
            path = config_path(args)
            assert cfg is not None and run_dir is not None and path is not None
            url = await stack.enter_async_context(started_worker(session, path, args.overrides, cfg, run_dir, out))
        backend = Backend(session, url, model, args.timeout, RetryPolicy(args.max_retries), args.token)
        await backend.describe()
        await backend.choose_counter(args.tokenizer)
        expect = None
        if location is not None:
            await load_version(session, backend.url, args.version, location)
            expect = Snapshot(str(args.version))
        probe = await probe_for(backend, args.weight_version)
        with ResultCache(out / "cache.jsonl") as cache:
            for bench in todo.benchmarks:
                results.append(await evaluate(bench, backend, cache, out, probe, todo.options, todo.max_concurrent,
                                              todo.chunk_cases, expect))  # fmt: skip
    return results


def cli_main(argv: Sequence[str]) -> int:
    """`slipstream eval ...`: print one line per benchmark (with the score the run recorded for the version, when
    it has one); exit 1 on a request, data, server or weight-load error, 2 on a config or usage error."""
    args = build_parser().parse_args(list(argv))
    setup_logging("eval", "-")
    failures: tuple[type[Exception], ...] = (RequestError, BenchmarkError, VersionMoved)
    if args.version is not None:
        # Only a --version run starts a vLLM server (rollout.worker) and loads weights into it.
        from rollout.worker import WorkerStartError

        failures += (WorkerStartError, WorkerError)
    try:
        results = asyncio.run(run_cli(args))
        run_dir = run_dir_of(args, run_config(args))
    except ConfigError as exc:
        print(f"slipstream eval: config error: {exc}", file=sys.stderr)
        return 2
    except ReproduceError as exc:
        print(f"slipstream eval: {exc}", file=sys.stderr)
        return 2
    except failures as exc:
        print(f"slipstream eval: {exc}", file=sys.stderr)
        return 1
    for r in results:
        recorded = recorded_score(run_dir, r) if run_dir is not None else None
        versus = ""
        if recorded is not None:
            versus = f" recorded {recorded:.4f}: {'same' if recorded == r.score else 'DIFFERENT'}"
        print(f"{r.benchmark} version={r.version} {r.primary}={r.score:.4f}{versus} cases={r.cases} "
              f"generated={r.generated} cached={r.cached} summary={r.summary_path}")  # fmt: skip
    return 0
