"""The evaluator against real vLLM (CPU build) behind the real router, sharing the session's
DeepSeek run (conftest.py: Redis, a router role process and one worker role process). One test runs
all three benchmarks end to end through the router and counts the requests the router proxied. The
other runs ROLE=evaluator as a process during a sequence of publishes (WeightPublisher of
common/weights/, publishing the original weights again so later tests see version-0 weights):
every evaluated version gets exactly one result row with its number, a version that moves during
its evaluation gets none, an evaluator killed (SIGKILL) mid-version and restarted regenerates only
the cases its cache lacked (counted by the router's /metrics), and `slipstream eval --config` against
the worker reproduces the score recorded for the version it serves, case by case. The last starts an
eval-pool worker role process (rollout.pool = "eval", same run and model) and the evaluator in pin
mode, then publishes versions faster than one evaluation takes: every version gets exactly one row,
measured on its own weights, while the train worker follows every publish untouched by the evaluator.
The final test needs no shared run: it makes a finished demo run (two published versions) and checks that
`slipstream eval --run-dir RUN --version N` starts a vLLM server as the run's workers were started,
loads the version into it and reproduces, completion for completion, the row the run's evaluator
recorded for it on that server, that `--url` does the same on a running server, and that nothing of the
server outlives the command."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import aiohttp
import psutil
import pytest
import safetensors.torch
import torch
from conftest import MAX_MODEL_LEN

import evaluator.cli
from common.config import load_config, to_toml
from common.metrics import MetricsWriter, read_metrics
from common.net import bearer
from common.run_secrets import ensure_secrets
from common.runs.cli import main as slipstream_main
from common.weights.publisher import WeightPublisher
from common.weights.workers import apply_version, served_version
from common.weights.writer import write_version
from evaluator.backend import Backend
from evaluator.benchmark import EvalOptions, load_benchmark
from evaluator.cache import ResultCache
from evaluator.cli import build_parser, run_cli
from evaluator.fleetview import FleetProbe
from evaluator.runner import PIN_PAUSE_MODE, WeightInfoProbe, eval_plan, evaluate, follows_chat_template
from tests.support.prom import total
from trainer.tinykit import resolve_model

pytestmark = [pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "evaluator" / "data"
ROUTE = "/v1/completions"


def proxied(run, route: str) -> int:
    """Requests the router proxied on `route` (any final status), from its Prometheus /metrics."""
    request = urllib.request.Request(f"{run.router_url()}/metrics", headers=bearer(run.secrets.router))
    with urllib.request.urlopen(request, timeout=5) as r:
        text = r.read().decode()
    return int(total(text, "slipstream_router_requests_total", route=route))


def original_weights(run) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    (path,) = (run.run_dir / "models").glob("*-*")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()


@pytest.mark.timeout(300)
async def test_all_benchmarks_run_end_to_end_through_the_router_against_vllm(deepseek_run, tmp_path):
    run = deepseek_run
    r = run.rz.info.async_client()
    before = {route: proxied(run, route) for route in (ROUTE, "/v1/chat/completions")}
    try:
        async with run.worker_session() as session:  # the fleet probe asks the workers; the backend the router
            backend = Backend(session, run.router_url(), "policy", token=run.secrets.router)
            served = await backend.describe()
            counter = await backend.choose_counter()
            assert served.max_model_len == MAX_MODEL_LEN and "tokenizer at" in repr(counter)
            probe = FleetProbe(r, run.keys, session)
            snap = await probe.read()
            assert snap.settled
            results = {}
            with ResultCache(tmp_path / "cache.jsonl") as cache:
                for name, limit in (("arithmetic", 10), ("gsm8k", 2), ("ifeval", 3)):
                    opts = EvalOptions(limit=limit, max_tokens=48)
                    results[name] = await evaluate(load_benchmark(name, DATA), backend, cache, tmp_path, probe, opts)
    finally:
        await r.aclose()
    for name, res in results.items():
        assert res.version == snap.version and res.generated == res.cases and res.prompt_too_long == 0
        lines = [json.loads(x) for x in Path(res.cases_path).read_text().splitlines()]
        assert len(lines) == res.cases and all(len(line["completions"]) == 1 for line in lines)
        assert all(line["finish_reasons"][0] in ("stop", "length") for line in lines)
        assert 0.0 <= res.score <= 1.0
        print(f"{name} at version {res.version}: {res.primary} = {res.score:.3f} ({res.seconds:.1f}s)")
    # max_tokens was clamped per prompt, never above the 48 asked for
    assert all(json.loads(x)["max_tokens"] == 48 for x in Path(results["gsm8k"].cases_path).read_text().splitlines())
    assert proxied(run, ROUTE) - before[ROUTE] == 10
    assert proxied(run, "/v1/chat/completions") - before["/v1/chat/completions"] == 5


def answered(cases_jsonl: Path) -> list[tuple[str, str, list[str]]]:
    """(case id, prompt, completions) of every line of a per-case JSONL."""
    lines = [json.loads(line) for line in cases_jsonl.read_text().splitlines()]
    return [(line["case"], line["prompt"], line["completions"]) for line in lines]


def evals(run) -> list[tuple[int, str]]:
    return [(int(f["version"]), f["benchmark"]) for _, f in run.redis.xrange(run.keys.evals)]


def cached_for(cache: Path, version: int) -> int:
    """Cache records of one version (a line being written right now is not counted)."""
    count = 0
    for line in cache.read_text().splitlines() if cache.exists() else []:
        try:
            count += json.loads(line)["version"] == str(version)
        except ValueError:
            pass
    return count


@pytest.mark.timeout(540)
async def test_live_evaluator_records_each_version_exactly_and_resumes_from_its_cache(
    deepseek_run, tmp_path, monkeypatch
):
    run = deepseek_run
    run.redis.delete(run.keys.evals)
    r = run.rz.info.async_client()
    v0 = int(await r.get(run.keys.weights_current) or 0)
    eval_dir = tmp_path / "evalrun"
    for key, value in {
        "run__dir": eval_dir,
        "evaluator__chunk_cases": 4,
        "evaluator__max_concurrent": 4,
        "evaluator__until_version": v0 + 3,
        "evaluator__router_wait_s": 60,
    }.items():
        monkeypatch.setenv(f"SLIPSTREAM__{key}", str(value))
    cache = eval_dir / "evals" / "cache.jsonl"
    n_cases = len(load_benchmark("arithmetic", DATA).cases())
    cfg = run.cfg()
    # The kit's tokenizer has a chat template and rollout.chat_template is "auto": held-out arithmetic is asked
    # as a chat turn, on vLLM's chat route.
    arithmetic_route = "/v1/chat/completions" if follows_chat_template(cfg, run.run_dir) else ROUTE
    weights = original_weights(run)
    evaluator = run.start_role("evaluator", "evaluator")
    try:
        async with WeightPublisher(r, run.keys, cfg.rollout, run.run_dir) as pub:
            run.wait_for("row of the starting version", lambda: (v0, "arithmetic") in evals(run), evaluator, 120)
            # A version that moves during its evaluation: discarded, never recorded.
            await pub.publish(v0 + 1, weights)
            run.wait_for("evaluation of v0+1 under way", lambda: cached_for(cache, v0 + 1) >= 4, evaluator, 60)
            await pub.publish(v0 + 2, weights)
            # Kill the evaluator in the middle of v0+2, then restart it.
            run.wait_for("evaluation of v0+2 under way", lambda: cached_for(cache, v0 + 2) >= 8, evaluator, 60)
            evaluator.send_signal(signal.SIGKILL)
            evaluator.wait(timeout=10)
            time.sleep(1.0)  # the router sees the dropped connections and counts them
            have = cached_for(cache, v0 + 2)
            assert 8 <= have < n_cases, "the kill came too late to test resumption"
            sent_before = proxied(run, arithmetic_route)
            evaluator = run.start_role("evaluator", "evaluator-restarted")
            run.wait_for("row of v0+2", lambda: (v0 + 2, "arithmetic") in evals(run), evaluator, 120)
            regenerated = proxied(run, arithmetic_route) - sent_before
            await pub.publish(v0 + 3, weights)
            assert evaluator.wait(timeout=120) == 0  # until_version = v0+3 reached
    finally:
        if evaluator.poll() is None:
            evaluator.send_signal(signal.SIGTERM)
            evaluator.wait(timeout=30)
        await r.aclose()
    print(f"restart: {have} of {n_cases} cases of version {v0 + 2} were cached; {regenerated} regenerated")
    assert regenerated == n_cases - have
    rows = evals(run)
    assert rows == [(v0, "arithmetic"), (v0 + 2, "arithmetic"), (v0 + 3, "arithmetic")]
    discarded = [
        json.loads(f["detail"]) for _, f in run.redis.xrange(run.keys.events) if f["event"] == "eval discarded"
    ]
    assert any(d["version"] == str(v0 + 1) for d in discarded)
    points = read_metrics(eval_dir, tags=["eval/arithmetic/accuracy/mean"])
    assert sorted(p.step for p in points) == [v0, v0 + 2, v0 + 3]
    for version in (v0, v0 + 2, v0 + 3):
        summary = json.loads((eval_dir / "evals" / f"arithmetic.v{version}.summary.json").read_text())
        assert summary["version"] == str(version) and summary["cases"] == n_cases
    assert os.path.exists(eval_dir / "evals" / f"arithmetic.v{v0 + 1}.summary.json") is False
    # `slipstream eval --config` against the worker (its /weight_info says which version) reproduces the row the
    # evaluator recorded for that version: same cases, same completions, the same score. Same config and
    # environment overrides as the role process, and its working directory (evaluator.data_root is relative).
    monkeypatch.chdir(ROOT)
    (worker_url,) = [rec["url"] for rec in run.workers().values()]
    cli_out = tmp_path / "cli"
    args = build_parser().parse_args(
        ["--url", worker_url, "--config", str(run.config), "--out", str(cli_out), "--token", run.secrets.workers]
    )
    (again,) = await run_cli(args)
    recorded = json.loads((eval_dir / "evals" / f"arithmetic.v{v0 + 3}.summary.json").read_text())
    assert (again.version, again.cases, again.generated) == (str(v0 + 3), n_cases, n_cases)
    print(f"slipstream eval --config at version {v0 + 3}: {again.score} (recorded {recorded['score']})")
    assert again.score == recorded["score"] and again.metrics == recorded["metrics"]
    assert answered(Path(again.cases_path)) == answered(eval_dir / "evals" / f"arithmetic.v{v0 + 3}.cases.jsonl")


def perturbed(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Other weights of the same shapes (fixed noise of half each tensor's spread): other greedy completions."""
    gen = torch.Generator().manual_seed(0)
    return {
        n: t + 0.5 * t.std() * torch.randn(t.shape, generator=gen) if t.is_floating_point() and t.numel() > 1 else t
        for n, t in weights.items()
    }


def completions(eval_dir: Path, version: int) -> list[list[str]]:
    lines = (eval_dir / "evals" / f"arithmetic.v{version}.cases.jsonl").read_text().splitlines()
    return [json.loads(line)["completions"] for line in lines]


@pytest.mark.timeout(480)
async def test_pinned_evaluator_records_each_version_once_while_publishes_outpace_it(
    deepseek_run, tmp_path, monkeypatch
):
    run = deepseek_run
    run.redis.delete(run.keys.evals)
    # The eval worker joins the fixture's run (same run dir, so the same generated model).
    monkeypatch.setenv("SLIPSTREAM__rollout__pool", "eval")
    eval_worker = run.start_role("vllm", "eval-worker")
    monkeypatch.delenv("SLIPSTREAM__rollout__pool")
    r = run.rz.info.async_client()
    evaluator = None
    try:
        (eval_id,) = run.wait_for(
            "eval worker registration", lambda: run.redis.hgetall(run.keys.eval_workers), eval_worker, 300
        )
        eval_url = json.loads(run.redis.hget(run.keys.eval_workers, eval_id))["url"]
        train = run.workers()
        assert eval_id not in train and eval_id not in {w["id"] for w in run.router_workers()}
        v0 = int(await r.get(run.keys.weights_current) or 0)
        # Older versions whose files are still on disk are due too (none evaluated yet): evaluated after ours.
        older = sorted(
            int(f["version"])
            for _, f in run.redis.xrange(run.keys.weights_log)
            if int(f["version"]) <= v0 and Path(f["location"]).is_dir()
        )
        ours = [v0 + 1, v0 + 2, v0 + 3, v0 + 4]
        eval_dir = tmp_path / "evalrun"
        limit = 80
        # One request at a time: an evaluation takes several seconds, and equal weights give equal completions.
        for key, value in {
            "run__dir": eval_dir,
            "evaluator__pin": "always",
            "evaluator__limit": limit,
            "evaluator__chunk_cases": 2,
            "evaluator__max_concurrent": 1,
            "evaluator__until_version": ours[-1],
            "evaluator__router_wait_s": 60,
        }.items():
            monkeypatch.setenv(f"SLIPSTREAM__{key}", str(value))
        cache = eval_dir / "evals" / "cache.jsonl"
        cfg = run.cfg()
        original = original_weights(run)
        other = perturbed(original)
        evaluator = run.start_role("evaluator", "evaluator-pinned")
        # keep_versions: every version stays loadable; the last publish restores the original weights for later tests.
        async with WeightPublisher(r, run.keys, replace(cfg.rollout, keep_versions=50), run.run_dir) as pub:
            results = [await pub.publish(ours[0], other)]
            run.wait_for("evaluation of v0+1 under way", lambda: cached_for(cache, ours[0]) >= 2, evaluator, 120)
            # Three more versions back to back, while v0+1 is being measured on the eval worker. (How far
            # the evaluation got by then depends on the machine's speed; what must hold whatever the timing
            # is asserted below: one row per version, each measured on its own weights.)
            for version, weights in zip(ours[1:], (original, other, original), strict=True):
                results.append(await pub.publish(version, weights))
            async with run.worker_session() as session:
                train_at = {w: await served_version(session, rec["url"]) for w, rec in train.items()}
            assert evaluator.wait(timeout=300) == 0  # until_version = v0+4 reached
    finally:
        for proc in (evaluator, eval_worker):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
        await r.aclose()
    # The train worker(s) moved on with every publish, which never drove the eval worker.
    assert set(train_at.values()) == {str(ours[-1])}
    assert all(sorted(o.worker_id for o in res.workers) == sorted(train) and not res.evicted for res in results)
    assert {w: rec["weight_version"] for w, rec in run.workers().items()} == dict.fromkeys(train, ours[-1])
    rows = [v for v, bench in evals(run) if bench == "arithmetic"]
    print(f"pinned rows in order: {rows} (older versions on disk: {older})")
    # Exactly one row per version (the order after v0+1 depends on when v0+3 and v0+4 land: test_eval_watcher.py).
    assert sorted(rows) == sorted(set(rows)) == sorted(older + ours)
    assert [v for v in rows if v in ours][0] == ours[0]
    points = read_metrics(eval_dir, tags=["eval/arithmetic/accuracy/mean"])
    assert sorted(p.step for p in points) == sorted(older + ours)
    for version in ours:
        summary = json.loads((eval_dir / "evals" / f"arithmetic.v{version}.summary.json").read_text())
        assert summary["version"] == str(version) and summary["cases"] == limit and summary["url"] == eval_url
    # Each row measured its own version's weights: equal weights, equal greedy completions; other weights, others.
    assert completions(eval_dir, ours[0]) == completions(eval_dir, ours[2])
    assert completions(eval_dir, ours[1]) == completions(eval_dir, ours[3])
    differ = sum(a != b for a, b in zip(completions(eval_dir, ours[0]), completions(eval_dir, ours[1]), strict=True))
    print(f"perturbed vs original weights: {differ} of {limit} completions differ")
    assert differ >= limit // 2


QA = [("1 + 1", "2"), ("2 + 3", "5"), ("4 + 4", "8"), ("9 - 3", "6"), ("7 + 0", "7")]
MC = [("1 + 1 =", [" 2", " 3"], 0), ("2 + 3 =", [" 4", " 5", " 6"], 1), ("6 - 2 =", [" 4", " 1"], 0)]


def lm_eval_tasks(root: Path) -> Path:
    """A directory of two lm-eval task YAMLs over local JSONL files (no download): slip_qa, generate_until scored by
    exact_match, and slip_mc, multiple_choice (loglikelihood requests: echo + logprobs) scored by acc."""
    (root / "qa.jsonl").write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in QA))
    (root / "mc.jsonl").write_text(
        "".join(json.dumps({"question": q, "choices": c, "label": g}) + "\n" for q, c, g in MC)
    )
    tasks = root / "tasks"
    tasks.mkdir()
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    (tasks / "qa.yaml").write_text(
        "task: slip_qa\n"
        + common.format(root / "qa.jsonl")
        + 'output_type: generate_until\ndoc_to_text: "Q: {{question}}\\nA:"\ndoc_to_target: "{{answer}}"\n'
        + 'generation_kwargs:\n  until: ["\\n"]\n  max_gen_toks: 8\n  do_sample: false\n'
        + "metric_list:\n  - metric: exact_match\n    aggregation: mean\n    higher_is_better: true\n"
    )
    (tasks / "mc.yaml").write_text(
        "task: slip_mc\n"
        + common.format(root / "mc.jsonl")
        + 'output_type: multiple_choice\ndoc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\n'
        + "doc_to_target: label\nmetric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return tasks


def lm_eval_lines(eval_dir: Path, task: str, version: int) -> list[dict]:
    path = eval_dir / "evals" / f"lm_eval:{task}.v{version}.cases.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(540)
async def test_lm_eval_tasks_are_recorded_per_version_by_the_live_evaluator(deepseek_run, tmp_path, monkeypatch):
    """ROLE=evaluator with two lm-evaluation-harness tasks of our own (a local YAML directory) through the router:
    v0 (the original weights), v0+1 (perturbed) and v0+2 (the original again) each get one row per task, in the
    evals stream and DuckDB; each score equals what we compute from the logged responses; the loglikelihoods of
    v0 and v0+2 are equal and those of v0+1 differ (each row measured its own version); every lm-eval request
    went through the router; nothing was written under $HOME."""
    run = deepseek_run
    run.redis.delete(run.keys.evals)
    r = run.rz.info.async_client()
    v0 = int(await r.get(run.keys.weights_current) or 0)
    eval_dir = tmp_path / "evalrun"
    home = tmp_path / "home"
    home.mkdir()
    for key, value in {
        "run__dir": eval_dir,
        "evaluator__benchmarks": '["lm_eval:slip_qa", "lm_eval:slip_mc"]',
        "evaluator__lm_eval_include_path": lm_eval_tasks(tmp_path),
        "evaluator__pin": "never",
        "evaluator__until_version": v0 + 2,
        "evaluator__router_wait_s": 60,
    }.items():
        monkeypatch.setenv(f"SLIPSTREAM__{key}", str(value))
    monkeypatch.setenv("HOME", str(home))
    cfg = run.cfg()
    weights = original_weights(run)
    sent_before = proxied(run, ROUTE)
    evaluator = run.start_role("evaluator", "evaluator-lm-eval")
    started = time.monotonic()
    try:
        async with WeightPublisher(r, run.keys, cfg.rollout, run.run_dir) as pub:
            for version, published in ((v0 + 1, perturbed(weights)), (v0 + 2, weights)):
                run.wait_for(
                    f"rows of version {version - 1}",
                    lambda v=version - 1: (v, "lm_eval:slip_mc") in evals(run),
                    evaluator,
                    240,
                )
                await pub.publish(version, published)
            assert evaluator.wait(timeout=240) == 0  # until_version = v0+2 reached
    finally:
        if evaluator.poll() is None:
            evaluator.send_signal(signal.SIGTERM)
            evaluator.wait(timeout=30)
        await r.aclose()
    took = time.monotonic() - started
    versions = [v0, v0 + 1, v0 + 2]
    assert evals(run) == [(v, t) for v in versions for t in ("lm_eval:slip_qa", "lm_eval:slip_mc")]
    assert sorted(p.step for p in read_metrics(eval_dir, tags=["eval/lm_eval:slip_mc/acc"])) == versions
    assert sorted(p.step for p in read_metrics(eval_dir, tags=["eval/lm_eval:slip_qa/exact_match"])) == versions
    loglik = {}
    for v in versions:
        qa, mc = lm_eval_lines(eval_dir, "slip_qa", v), lm_eval_lines(eval_dir, "slip_mc", v)
        assert len(qa) == len(QA) and len(mc) == len(MC) and {line["version"] for line in qa + mc} == {str(v)}
        # exact_match: the generated text (lm-eval's filter "none" keeps it as is) equals the target.
        ours_qa = sum(line["filtered"][0] == line["target"] for line in qa) / len(QA)
        # acc: the choice of highest loglikelihood (the server's echoed prompt log-probs) is the gold label.
        picks = [max(range(len(line["filtered"])), key=lambda i, ln=line: ln["filtered"][i][0]) for line in mc]
        ours_mc = sum(p == line["target"] for p, line in zip(picks, mc, strict=True)) / len(MC)
        qa_sum = json.loads((eval_dir / "evals" / f"lm_eval:slip_qa.v{v}.summary.json").read_text())
        mc_sum = json.loads((eval_dir / "evals" / f"lm_eval:slip_mc.v{v}.summary.json").read_text())
        assert (qa_sum["primary"], mc_sum["primary"]) == ("exact_match", "acc")
        assert qa_sum["score"] == ours_qa and mc_sum["score"] == ours_mc
        assert all(isinstance(ll, float) and ll < 0 for line in mc for ll, _greedy in line["filtered"])
        loglik[v] = [ll for line in mc for ll, _greedy in line["filtered"]]
        print(f"version {v}: slip_qa exact_match = {ours_qa}, slip_mc acc = {ours_mc}, loglik {loglik[v]}")
    assert loglik[v0] == pytest.approx(loglik[v0 + 2], abs=1e-4)
    assert all(abs(a - b) > 1e-3 for a, b in zip(loglik[v0], loglik[v0 + 1], strict=True))
    # One /v1/completions request per generation and per choice, for each of the three versions.
    assert proxied(run, ROUTE) - sent_before == 3 * (len(QA) + sum(len(c) for _, c, _ in MC))
    assert list(home.iterdir()) == []
    assert (eval_dir / "evals" / "lm_eval_cache" / "hf" / "datasets").is_dir()
    print(f"lm-eval live evaluator: 3 versions x 2 tasks in {took:.0f}s")


@pytest.mark.timeout(300)
async def test_eval_of_a_run_version_reproduces_the_recorded_row(tmp_path, tmp_path_factory, capsys, monkeypatch):
    """Eval of a run's version starts a server, loads the version and reproduces the recorded row."""
    # A finished demo run: its config, its base model, two published versions (v0: the model's own weights, v1:
    # other weights of the same shapes). A short path: vLLM's IPC sockets live under it.
    run_dir = tmp_path_factory.mktemp("evrun")
    cfg = load_config(
        ROOT / "configs" / "demo.toml", [f"run.dir={run_dir}", f"evaluator.data_root={DATA}", "evaluator.limit=40"]
    )
    (run_dir / "config.toml").write_text(to_toml(cfg))
    ensure_secrets(run_dir / "meet")  # what the run's roles left: the server started for --version asks for its key
    own = safetensors.torch.load_file(resolve_model(cfg, run_dir) / "model.safetensors")
    for version, weights in ((0, own), (1, perturbed(own))):
        write_version(run_dir / "weights", version, weights)
    plan = eval_plan(cfg.evaluator, cfg.rollout.task)
    (bench,) = plan.benchmarks
    recorded = {}
    started_worker = evaluator.cli.started_worker

    @contextlib.asynccontextmanager
    async def recorded_first(session: aiohttp.ClientSession, *args):
        """The server the command starts; before the command uses it, the run's evaluator records versions 0 and 1
        on it (as its pin mode does on an eval worker), and `--url` reproduces version 0 there."""
        async with started_worker(session, *args) as url:
            backend = Backend(session, url, "policy")
            await backend.describe()
            await backend.choose_counter()
            with (
                ResultCache(tmp_path / "recorded" / "cache.jsonl") as cache,
                MetricsWriter(run_dir, "demo", "evaluator") as metrics,
            ):
                for version in (0, 1):
                    await apply_version(session, url, version, str(run_dir / "weights" / f"v{version}"), PIN_PAUSE_MODE)
                    recorded[version] = await evaluate(
                        bench,
                        backend,
                        cache,
                        tmp_path / "recorded",
                        WeightInfoProbe(backend, url),
                        plan.options,
                        plan.max_concurrent,
                        plan.chunk_cases,
                    )
                    metrics.log_many(
                        version, {f"eval/{bench.name}/{k}": v for k, v in recorded[version].metrics.items()}
                    )
            # --url: the server holds version 1 now, so matching version 0's row takes loading it.
            args = ["--url", url, "--run-dir", str(run_dir), "--version", "0", "--out", str(tmp_path / "url")]
            (again,) = await run_cli(build_parser().parse_args(args))
            assert again.score == recorded[0].score
            assert answered(Path(again.cases_path)) == answered(Path(recorded[0].cases_path))
            yield url  # holding version 0: matching version 1's row takes loading it

    monkeypatch.setattr(evaluator.cli, "started_worker", recorded_first)
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    started = time.monotonic()
    assert await asyncio.to_thread(slipstream_main, ["eval", "--run-dir", str(run_dir), "--version", "1"]) == 0
    took = time.monotonic() - started
    score = recorded[1].score
    assert f"version=1 accuracy/mean={score:.4f} recorded {score:.4f}: same" in capsys.readouterr().out
    out = run_dir / "eval-cli"
    got = answered(out / "arithmetic.v1.cases.jsonl")
    assert got == answered(Path(recorded[1].cases_path))
    # The version loaded is the one evaluated: version 0's weights answer otherwise.
    differ = sum(a != b for a, b in zip(got, answered(Path(recorded[0].cases_path)), strict=True))
    print(f"eval --version 1 with its own server: {took:.0f}s; {differ} of 40 completions differ from version 0's")
    assert differ >= 20
    assert str(run_dir / "models") in (out / "vllm.log").read_text()  # the server's log, under the output dir
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()
