"""The `slipstream eval` command: benchmarks against an OpenAI-compatible URL, built as a run builds them.

With --config or --run-dir the benchmarks and generation settings come from `eval_plan` over the run's
config (flags win), so the command reproduces a score the run's evaluator role recorded for a version.
`slipstream eval --run-dir RUN --version N` measures one published version as the run's evaluator did in pin
mode: it loads `<weight dir>/v<N>/` into a worker with `common.weights.workers.apply_version` (the `--url` server, or
a vLLM server it starts for the run's model with the run's worker command line and environment and stops
afterwards) and prints the score the run recorded for N beside its own. Each benchmark is run by
evaluator/runner.py's `evaluate`; this module only reads the command line and the run, and reports.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import os
import secrets
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

from common.config import Config, ConfigError, EvaluatorConfig, add_set_argument, load_config
from common.http import RetryPolicy
from common.log import setup as setup_logging
from common.metrics import step_series
from common.net import free_port, vllm_session
from common.roles import resolve_meet_dir
from common.run_secrets import read_secrets
from common.weights.fleet import WorkerError
from common.weights.model_files import tokenizer_dir
from common.weights.versions import committed_versions, version_dir, weight_root
from common.weights.workers import apply_version
from evaluator.backend import Backend, RequestError
from evaluator.benchmark import BENCHMARKS, BenchmarkError
from evaluator.cache import ResultCache
from evaluator.runner import (
    PIN_PAUSE_MODE,
    EvalPlan,
    EvalResult,
    Snapshot,
    VersionMoved,
    eval_plan,
    evaluate,
    follows_chat_template,
    probe_for,
)

log = logging.getLogger(__name__)

# Where `slipstream eval --run-dir RUN` writes by default (under RUN; the role's own results are in evals/).
CLI_OUT = "eval-cli"
LOOPBACK = "127.0.0.1"


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
    p.add_argument(
        "--url",
        help="base URL of the server, e.g. http://127.0.0.1:8000 (with --version: a Slipstream "
        "vLLM worker serving the run's model, whose weights are replaced; default with --version: start "
        "one)",
    )
    run = p.add_mutually_exclusive_group()
    run.add_argument("--config", help="the run's TOML config (e.g. configs/demo.toml): evaluate as its evaluator does")
    run.add_argument("--run-dir", help="a run dir made by `slipstream launch`: use its config.toml as --config")
    p.add_argument(
        "--version",
        type=int,
        help="evaluate this published weight version of --run-dir's run, loaded from "
        "<weight dir>/v<N>/ as the run's evaluator loads it",
    )
    add_set_argument(p, "evaluator.limit=50")
    p.add_argument(
        "--benchmark",
        action="append",
        type=benchmark_name,
        help=f"benchmark to run: {', '.join(sorted(BENCHMARKS))} or lm_eval:<task> (repeat for several; default "
        "with a config: evaluator.benchmarks)",
    )
    p.add_argument(
        "--model",
        help="served model name (default: rollout.served_model_name with a config, else the only one the server lists)",
    )
    p.add_argument(
        "--out",
        help=f"output dir: cache.jsonl, per-case JSONL, summary JSON, the log of a vLLM server "
        f"it starts (default: <run dir>/{CLI_OUT} with a run dir, else runs/eval)",
    )
    p.add_argument(
        "--data-root", help="directory holding the benchmarks' data (default: evaluator.data_root, evaluator/data)"
    )
    p.add_argument(
        "--lm-eval-include-path",
        help="directory of lm-evaluation-harness task YAMLs for lm_eval:<task> (default: evaluator.lm_eval_include_path)",
    )
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
    p.add_argument(
        "--token", default=os.environ.get("SLIPSTREAM_TOKEN", ""), help="bearer token (default: $SLIPSTREAM_TOKEN)"
    )
    return p


def config_path(args: argparse.Namespace) -> Path | None:
    """The config file named by --run-dir (its config.toml) or --config; None when neither was given."""
    if args.run_dir is not None:
        path = Path(args.run_dir) / "config.toml"
        if not path.is_file():
            raise ConfigError(
                f"--run-dir {args.run_dir}: no config.toml there; give a run dir that "
                "`slipstream launch` created, or pass --config CONFIG"
            )
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
            "keeps its versions there with rollout.weight_backend = 'file' or 'collective'); evaluate a server as it is with "
            "--url URL and no --version"
        )
    if version > kept[-1]:
        raise ReproduceError(
            f"--version {version}: {location} does not exist; the run published versions up to "
            f"{kept[-1]} (kept: {_versions_text(kept)}); pick one of those"
        )
    raise ReproduceError(
        f"--version {version}: {location} does not exist: the run pruned it (it keeps the newest "
        f"rollout.keep_versions = {cfg.rollout.keep_versions} versions and the pinned ones); pick one of the kept "
        f"versions {_versions_text(kept)}, or raise rollout.keep_versions for a run whose every version stays "
        "reproducible"
    )


def version_tokenizer(args: argparse.Namespace, cfg: Config, run_dir: Path | None) -> Path | None:
    """The tokenizer directory of the version `--version` evaluates, when that version carries one (a run
    whose model came with tokenizer files copies them into every version); else None: rollout.model's."""
    if args.version is None or run_dir is None:
        return None
    return tokenizer_dir(version_files(cfg, run_dir, args.version))


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
    from rollout.worker import wait_ready, worker_vllm
    from trainer.tinykit import resolve_model

    wcfg, extra_env = worker_setup(path, overrides, cfg)
    ro = dataclasses.replace(wcfg.rollout, api_key=cfg.rollout.api_key)  # the key run_cli's session sends
    model_dir = await asyncio.to_thread(resolve_model, wcfg, run_dir)
    port = free_port(LOOPBACK)
    url = f"http://{LOOPBACK}:{port}"
    log_path = out / "vllm.log"
    vllm = worker_vllm(
        ro, run_dir, model_dir, (LOOPBACK, port), url, log_path, "eval-cli", os.environ | extra_env, echo=False
    )
    try:
        await vllm.start()
        log.info(
            "waiting up to %.0fs (rollout.startup_timeout_s) for vLLM serving %s at %s (log %s)",
            ro.startup_timeout_s,
            model_dir,
            url,
            log_path,
        )
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


def benchmark_name(name: str) -> str:
    """--benchmark's value: a built-in benchmark or an lm-evaluation-harness task, "lm_eval:<task>"."""
    if name in BENCHMARKS or (name.startswith("lm_eval:") and len(name) > len("lm_eval:")):
        return name
    raise argparse.ArgumentTypeError(f"{name!r}: choose one of {', '.join(sorted(BENCHMARKS))}, or lm_eval:<task>")


def cli_plan(args: argparse.Namespace, cfg: Config | None) -> EvalPlan:
    """What `slipstream eval` evaluates: `eval_plan` of the config's evaluator section and training task, with
    the flags given applied on top. Without a config: the flags over EvaluatorConfig's defaults, no training
    task (held-out arithmetic then takes its data file's knobs), no chat template and rollout.episode's defaults
    (tool_arithmetic's tools and budget)."""
    ev = cfg.evaluator if cfg is not None else EvaluatorConfig(benchmarks=[])
    flags = {
        "benchmarks": args.benchmark,
        "data_root": args.data_root,
        "lm_eval_include_path": args.lm_eval_include_path,
        "limit": args.limit,
        "max_tokens": args.max_tokens,
        "max_concurrent": args.max_concurrent,
    }
    ev = dataclasses.replace(ev, **{k: v for k, v in flags.items() if v is not None})
    if not ev.benchmarks:
        raise BenchmarkError(
            "no benchmark to run: pass --benchmark NAME (or --config CONFIG to run the config's evaluator.benchmarks)"
        )
    run_dir = run_dir_of(args, cfg) if cfg is not None else None
    chat = cfg is not None and follows_chat_template(cfg, run_dir, version_tokenizer(args, cfg, run_dir))
    result = eval_plan(
        ev, cfg.rollout.task if cfg is not None else None, chat, cfg.rollout.episode if cfg is not None else None
    )
    extra = {"samples": args.samples, "temperature": args.temperature, "top_p": args.top_p, "seed": args.seed}
    options = dataclasses.replace(result.options, **{k: v for k, v in extra.items() if v is not None})
    return dataclasses.replace(result, options=options)


def check_target(args: argparse.Namespace, run_dir: Path | None) -> None:
    """What to evaluate must be clear: a --url, or a run's --version (which starts a server when --url is absent)."""
    if args.version is not None and args.version < 0:
        raise ReproduceError(f"--version {args.version}: weight versions are numbered from 0")
    if args.version is not None and run_dir is None:
        raise ReproduceError(
            f"--version {args.version} needs the run that published it: pass --run-dir RUN (a dir "
            "made by `slipstream launch`), or a --config whose run.dir names that run"
        )
    if args.version is not None and args.weight_version:
        raise ReproduceError(
            f"--weight-version {args.weight_version} labels a server without /weight_info, but "
            f"--version {args.version} loads the version and reads it back there: drop one"
        )
    if args.url is None and args.version is None:
        raise ReproduceError(
            "nothing to evaluate: pass --url URL of a server, or --run-dir RUN --version N to "
            "evaluate a published version of a run on a vLLM server started for it"
        )


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
    # A run's workers ask for its rollout.api_key (the run's generated one unless set), and the server started
    # here for a --version asks for one too; requests given --token send that instead.
    token = ""
    if location is not None:
        assert cfg is not None and run_dir is not None
        stored = read_secrets(resolve_meet_dir(cfg, run_dir, os.environ))
        cfg.rollout.api_key = cfg.rollout.api_key or (stored.workers if stored else secrets.token_urlsafe(32))
        token = cfg.rollout.api_key
    async with vllm_session(token) as session, contextlib.AsyncExitStack() as stack:
        url = args.url
        if url is None:
            path = config_path(args)
            assert cfg is not None and run_dir is not None and path is not None
            url = await stack.enter_async_context(started_worker(session, path, args.overrides, cfg, run_dir, out))
        backend = Backend(session, url, model, args.timeout, RetryPolicy(args.max_retries), args.token)
        await backend.describe()
        # A version that carries its tokenizer counts with it (the one the worker serves the version with).
        version_tok = tokenizer_dir(location) if location is not None else None
        await backend.choose_counter(args.tokenizer or (str(version_tok) if version_tok is not None else None))
        expect = None
        if location is not None:
            await load_version(session, backend.url, args.version, location)
            expect = Snapshot(str(args.version))
        probe = await probe_for(backend, args.weight_version)
        with ResultCache(out / "cache.jsonl") as cache:
            for bench in todo.benchmarks:
                results.append(
                    await evaluate(
                        bench, backend, cache, out, probe, todo.options, todo.max_concurrent, todo.chunk_cases, expect
                    )
                )
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
        print(
            f"{r.benchmark} version={r.version} {r.primary}={r.score:.4f}{versus} cases={r.cases} "
            f"generated={r.generated} cached={r.cached} summary={r.summary_path}"
        )
    return 0
