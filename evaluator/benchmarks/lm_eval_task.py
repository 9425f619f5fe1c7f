"""lm-evaluation-harness tasks as benchmarks: `evaluator.benchmarks = ["lm_eval:<task>"]`.

lm-eval builds its own requests and scores its own responses, so such a benchmark has no `Case`s: the runner
hands it the whole evaluation (`LmEvalTask.run`). It calls `lm_eval.simple_evaluate` with lm-eval's
OpenAI-compatible `local-completions` model pointed at the same endpoint our benchmarks use (the router in
verify mode, the eval worker loaded with the version in pin mode), the served model name, and the served
model's own tokenizer directory (requests are sent as token ids, so lm-eval's context lengths for
loglikelihood are exactly the server's). Version exactness is the runner's rule with the whole task as one
chunk: the served version is read before and after, and a task during which it moved raises VersionMoved
(nothing is recorded). lm-eval has no part in our result cache: a discarded or interrupted task is run again
whole. Datasets are read offline (HF_DATASETS_OFFLINE=1), with every Hugging Face cache under the evaluation's
output directory (<run dir>/evals/lm_eval_cache/); tasks of one's own come from
`evaluator.lm_eval_include_path` (a directory of task YAMLs, e.g. `dataset_path: json` over a local JSONL).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import logging
import math
import os
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from evaluator.benchmark import Benchmark, BenchmarkError, Case, EvalOptions, SampleScore

if TYPE_CHECKING:
    from evaluator.backend import Backend
    from evaluator.runner import EvalResult, Snapshot, VersionProbe

log = logging.getLogger(__name__)

PREFIX = "lm_eval:"
INSTALL_HINT = "pip install 'slipstream[lmeval]' (or pip install 'lm-eval[api]>=0.4')"


def is_lm_eval(name: str) -> bool:
    return name.startswith(PREFIX)


def require_lm_eval(name: str) -> None:
    """lm-eval importable, else a BenchmarkError naming the benchmark and the install command."""
    try:
        spec = importlib.util.find_spec("lm_eval")
    except ValueError:  # sys.modules["lm_eval"] is None: importing it raises ImportError
        spec = None
    if spec is None:
        raise BenchmarkError(f"benchmark {name!r} needs lm-evaluation-harness, which is not installed; {INSTALL_HINT}")


def cache_env(cache_dir: Path) -> dict[str, str]:
    """The environment that keeps lm-eval and Hugging Face datasets offline and their caches under cache_dir."""
    return {
        "HF_HOME": str(cache_dir / "hf"),
        "HF_DATASETS_CACHE": str(cache_dir / "hf" / "datasets"),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "LM_HARNESS_CACHE_PATH": str(cache_dir / "lm_eval"),
    }


def apply_cache_env(cache_dir: Path) -> None:
    """Set `cache_env` in this process. `datasets` and `huggingface_hub` read these variables once, at import: if
    they are already imported (transformers does), their constants are set too, else they would keep $HOME and
    try the network (each try waiting for its timeout where there is none)."""
    env = cache_env(cache_dir)
    os.environ.update(env)
    if "huggingface_hub" in sys.modules:
        import huggingface_hub.constants

        huggingface_hub.constants.HF_HUB_OFFLINE = True
    if "datasets" in sys.modules:
        import datasets.config

        datasets.config.HF_DATASETS_CACHE = Path(env["HF_DATASETS_CACHE"])
        datasets.config.HF_DATASETS_OFFLINE = True
        datasets.config.HF_HUB_OFFLINE = True


def metric_name(key: str) -> str | None:
    """Our metric name for a key of lm-eval's per-task results: "exact_match,none" -> "exact_match",
    "acc,strict" -> "acc/strict", "acc_stderr,none" -> "acc/stderr"; None for entries that are not metrics."""
    if "," not in key:
        return None
    metric, filt = key.split(",", 1)
    stderr = metric.endswith("_stderr")
    base = metric.removesuffix("_stderr")
    name = base if filt == "none" else f"{base}/{filt}"
    return f"{name}/stderr" if stderr else name


def task_metrics(results: Mapping[str, Any]) -> tuple[dict[str, float], str]:
    """Our metrics of one task's lm-eval results and the primary one (the first lm-eval reports, in the order of
    the task's metric_list). A stderr lm-eval could not compute ("N/A") is left out."""
    metrics: dict[str, float] = {}
    primary = ""
    for key, value in results.items():
        name = metric_name(key)
        if name is None or not isinstance(value, int | float) or isinstance(value, bool):
            continue
        metrics[name] = float(value)
        if not primary and not name.endswith("/stderr"):
            primary = name
    if not primary:
        raise BenchmarkError(f"lm-eval reported no metric for the task: {dict(results)}")
    return metrics, primary


def sample_line(sample: Mapping[str, Any], metric_keys: list[str], version: str) -> dict[str, Any]:
    """One line of the per-case JSONL from one of lm-eval's logged samples: the request arguments (the prompt
    and, for loglikelihood, the continuation), what the server answered, the target and the sample's scores."""
    arguments = sample.get("arguments") or []
    args = list(arguments.values()) if isinstance(arguments, Mapping) else list(arguments)
    prompts = [list(a.values()) if isinstance(a, Mapping) else list(a) for a in args]
    return {
        "case": str(sample["doc_id"]),
        "version": version,
        "prompt": [p[0] for p in prompts],
        "requests": [[x for x in p if isinstance(x, str)] for p in prompts],
        "completions": sample.get("resps"),
        "filtered": sample.get("filtered_resps"),
        "target": sample.get("target"),
        "scores": {k: sample[k] for k in metric_keys if k in sample},
        "cached": False,
    }


class LmEvalTask(Benchmark):
    """One lm-eval task, run by lm-eval against the endpoint the runner evaluates (see the module docstring)."""

    runs_whole = True

    def __init__(self, name: str, include_path: str = "") -> None:
        super().__init__(".")
        if not is_lm_eval(name) or not name[len(PREFIX) :]:
            raise BenchmarkError(f"benchmark {name!r}: an lm-eval task is named 'lm_eval:<task>', e.g. 'lm_eval:gsm8k'")
        require_lm_eval(name)
        if include_path and not Path(include_path).is_dir():
            raise BenchmarkError(
                f"evaluator.lm_eval_include_path = {include_path!r} is not a directory; point it at the directory "
                "holding your lm-eval task YAMLs (or leave it empty to use lm-eval's own tasks)"
            )
        self.name = name
        self.task = name[len(PREFIX) :]
        self.include_path = include_path
        self._manager: Any = None

    def cases(self) -> list[Case]:
        raise BenchmarkError(
            f"{self.name}: lm-eval builds its own requests; evaluate it with evaluator.runner.evaluate"
        )

    def score(self, case: Case, completion: str) -> SampleScore:
        raise BenchmarkError(
            f"{self.name}: lm-eval scores its own responses; evaluate it with evaluator.runner.evaluate"
        )

    def task_manager(self) -> Any:
        """lm-eval's TaskManager over its own tasks and the include path; an unknown task is an error here."""
        if self._manager is not None:
            return self._manager
        from lm_eval.tasks import TaskManager

        # Indexing lm-eval's thousands of task YAMLs takes seconds: once per benchmark, not once per version.
        manager = TaskManager(include_path=self.include_path or None)
        if self.task not in manager.all_tasks:
            where = f" or under evaluator.lm_eval_include_path = {self.include_path!r}" if self.include_path else ""
            raise BenchmarkError(
                f"benchmark {self.name!r}: lm-eval has no task {self.task!r} among its tasks{where}; set "
                "evaluator.lm_eval_include_path to the directory of a YAML that defines it"
            )
        self._manager = manager
        return manager

    def model_args(self, backend: Backend, tokenizer: str, max_model_len: int, max_concurrent: int) -> dict[str, Any]:
        """local-completions' arguments: our endpoint and served model, its tokenizer, its context length."""
        args: dict[str, Any] = {
            "base_url": backend.url + "/v1/completions",
            "model": backend.model,
            "tokenizer": tokenizer,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "max_length": max_model_len,
            "num_concurrent": max_concurrent,
            "max_retries": backend.retry.max_retries + 1,
            "timeout": int(backend.timeout.total or 600),
        }
        # The headers our own requests carry: the session's (a worker's rollout.api_key) and the backend's (the
        # router's token) win over lm-eval's default, a bearer of $OPENAI_API_KEY.
        headers = {**dict(backend.session.headers), **backend.headers}
        if headers:
            args["header"] = headers
        return args

    def simple_evaluate(self, model_args: dict[str, Any], options: EvalOptions) -> dict[str, Any]:
        """lm_eval.simple_evaluate of this task (blocking: run off the event loop)."""
        import lm_eval

        gen_kwargs = {
            k: v
            for k, v in {"max_gen_toks": options.max_tokens, "temperature": options.temperature}.items()
            if v is not None
        }
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=model_args,
            tasks=[self.task],
            task_manager=self.task_manager(),
            limit=options.limit,
            gen_kwargs=gen_kwargs or None,
            log_samples=True,
            random_seed=options.seed if options.seed is not None else 0,
            bootstrap_iters=1000,
        )
        if results is None:
            raise BenchmarkError(f"{self.name}: lm-eval returned no results")
        return results

    async def run(
        self,
        backend: Backend,
        out_dir: Path,
        probe: VersionProbe,
        options: EvalOptions,
        max_concurrent: int,
        expect: Snapshot | None,
    ) -> EvalResult:
        """Evaluate the task at the version `probe` reports now (which must equal `expect` when given), as one
        chunk: VersionMoved if the served version changed by the end. Writes the runner's two files."""
        from evaluator.runner import EvalResult, VersionMoved, output_paths, write_atomic

        if options.samples not in (None, 1) or options.top_p is not None:
            raise BenchmarkError(
                f"{self.name}: lm-eval tasks take their sampling from the task YAML; samples and top_p cannot be "
                "overridden (leave --samples and --top-p unset)"
            )
        started = time.monotonic()
        served = backend.served or await backend.describe()
        tokenizer = getattr(backend.counter, "path", None) or served.root
        if not tokenizer or not (Path(tokenizer) / "tokenizer_config.json").is_file():
            raise BenchmarkError(
                f"{self.name}: lm-eval needs the served model's tokenizer directory here; {tokenizer!r} has no "
                "tokenizer_config.json (pass --tokenizer DIR to slipstream eval, or run the evaluator where the "
                "model directory is readable)"
            )
        apply_cache_env(out_dir / "lm_eval_cache")
        start = await probe.read()
        version = start.version
        if not getattr(start, "settled", True) or (expect is not None and start != expect):
            raise VersionMoved(expect.version if expect is not None else version, version)
        args = self.model_args(backend, tokenizer, served.max_model_len, max_concurrent)
        log.info("%s at version %s: running lm-eval against %s", self.name, version, args["base_url"])
        results = await asyncio.to_thread(self.simple_evaluate, args, options)
        after = await probe.read()
        if after != start:
            raise VersionMoved(version, after.version)
        metrics, primary = task_metrics(results["results"][self.task])
        samples = results.get("samples", {}).get(self.task, [])
        keys = [k for k in results["results"][self.task] if "," in k and "_stderr" not in k.split(",")[0]]
        metric_keys = sorted({k.split(",")[0] for k in keys})
        lines = [sample_line(s, metric_keys, version) for s in samples]
        metrics["cases"] = float(len(lines))
        metrics["samples"] = float(len(lines))
        summary_path, cases_path = output_paths(out_dir, self.name, version)
        score = metrics[primary]
        if math.isnan(score):
            raise BenchmarkError(f"{self.name}: lm-eval's {primary} is NaN at version {version}")
        result = EvalResult(
            benchmark=self.name,
            version=version,
            model=served.id,
            url=backend.url,
            primary=primary,
            score=score,
            metrics=metrics,
            cases=len(lines),
            generated=len(lines),
            cached=0,
            prompt_too_long=0,
            seconds=time.monotonic() - started,
            summary_path=str(summary_path),
            cases_path=str(cases_path),
            options={k: v for k, v in asdict(options).items() if v is not None},
        )
        write_atomic(cases_path, "".join(json.dumps(line, ensure_ascii=False, default=str) + "\n" for line in lines))
        write_atomic(summary_path, json.dumps(asdict(result), indent=2) + "\n")
        log.info(
            "%s at version %s: %s = %.4f (%d cases, %.1fs)",
            self.name,
            version,
            primary,
            score,
            len(lines),
            result.seconds,
        )
        return result
