"""The router's stored telemetry (router/telemetry.py): its own figures and each worker's engine metrics, read
from the worker's /metrics over real HTTP, land in the run's DuckDB per period; a worker that cannot be read is
skipped and named once. The engine page here is written by prometheus_client in vLLM's metric names and label
sets (a stand-in for a vLLM server, which tests/e2e/test_rl_e2e.py's launched run scrapes for real)."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from common.metrics import MetricsWriter, step_series
from router.metrics import Metrics
from router.pool import WorkerPool
from router.telemetry import Telemetry, engine_figures, telemetry_origin
from tests.unit.test_router_policy import record

LABELS = ["model_name", "engine"]


class Engine:
    """A /metrics page with vLLM's engine metrics, two engines of one server (gauges are summed)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.running = Gauge("vllm:num_requests_running", "running", LABELS, registry=self.registry)
        self.waiting = Gauge("vllm:num_requests_waiting", "waiting", LABELS, registry=self.registry)
        self.kv = Gauge("vllm:kv_cache_usage_perc", "kv", LABELS, registry=self.registry)
        self.generated = Counter("vllm:generation_tokens", "generated", LABELS, registry=self.registry)
        self.prompt = Counter("vllm:prompt_tokens", "prompt", LABELS, registry=self.registry)

    def app(self) -> web.Application:
        async def metrics(request: web.Request) -> web.Response:
            return web.Response(body=generate_latest(self.registry), content_type="text/plain")

        app = web.Application()
        app.router.add_get("/metrics", metrics)
        return app


def test_engine_figures_sum_gauges_over_engines_and_read_counter_totals():
    e = Engine()
    e.running.labels("m", "0").set(3)
    e.running.labels("m", "1").set(2)
    e.kv.labels("m", "0").set(0.25)
    e.generated.labels("m", "0").inc(100)
    page = generate_latest(e.registry).decode()
    # waiting has no label set yet, so no sample: left out, not 0
    assert engine_figures(page) == {"running": 5.0, "kv_cache_usage": 0.25, "generation_tokens": 100.0}
    with pytest.raises(ValueError):
        engine_figures("vllm:num_requests_running{ 3\n")


async def test_each_period_stores_the_routers_figures_and_each_engines(tmp_path, caplog):
    engine = Engine()
    runner = web.AppRunner(engine.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    pool = WorkerPool()
    pool.apply({"w0": record("w0", url), "gone": record("gone", "http://127.0.0.1:1")}, alive={"w0", "gone"})
    pool.set_health(pool.workers["w0"], True)
    pool.workers["w0"].outstanding = 3
    metrics = Metrics()
    writer = MetricsWriter(tmp_path, "exp", "router", 0)
    try:
        async with aiohttp.ClientSession() as session:
            telemetry = Telemetry(metrics, pool, session, writer, period_s=1.0, timeout_s=2.0)
            engine.running.labels("m", "0").set(4)
            engine.generated.labels("m", "0").inc(1000)
            with caplog.at_level(logging.WARNING, logger="router.telemetry"):
                await telemetry.sample(1)
                for _ in range(6):
                    metrics.observe("/v1/completions", 200, 0.5)
                metrics.error("transport")
                engine.generated.labels("m", "0").inc(600)
                engine.waiting.labels("m", "1").set(2)
                await telemetry.sample(2)
    finally:
        writer.close()
        await runner.cleanup()
    # The refusing worker was skipped and named once, not per period.
    named = [r.getMessage() for r in caplog.records if "worker gone" in r.getMessage()]
    assert len(named) == 1 and named[0].startswith("router telemetry: cannot read http://127.0.0.1:1/metrics"), named
    tags = [
        "serve/healthy_workers",
        "serve/outstanding",
        "serve/requests_per_s",
        "serve/errors_per_s",
        "serve/latency_mean_s",
        "engine/w0/running",
        "engine/w0/waiting",
        "engine/w0/generation_tokens_per_s",
    ]
    got = step_series(tmp_path, tags, role="router")
    assert got["serve/healthy_workers"] == {1: 1.0, 2: 1.0} and got["serve/outstanding"] == {1: 3.0, 2: 3.0}
    assert got["engine/w0/running"] == {1: 4.0, 2: 4.0} and got["engine/w0/waiting"] == {2: 2.0}
    assert got["serve/latency_mean_s"] == {2: 0.5}
    # Rates need two samples: the period between them is real time (the two samples ran back to back here).
    assert set(got["serve/requests_per_s"]) == {2} and got["serve/requests_per_s"][2] > 6
    gen = got["engine/w0/generation_tokens_per_s"][2]
    assert gen / got["serve/requests_per_s"][2] == pytest.approx(100.0, rel=1e-6)
    assert got["serve/errors_per_s"][2] / got["serve/requests_per_s"][2] == pytest.approx(1 / 6, rel=1e-6)
    assert not any(t.startswith("engine/gone/") for t in got)


def test_a_restarted_router_goes_on_from_the_run_s_telemetry_origin(tmp_path):
    first = telemetry_origin(tmp_path, 0)
    assert telemetry_origin(tmp_path, 0) == first  # a restart reads it back
    assert telemetry_origin(tmp_path, 1) >= first  # another rank has its own
    (tmp_path / "metrics" / "router-0.origin").write_text("soon")
    with pytest.raises(ValueError, match=r"router-0.origin: not a time .* remove the file"):
        telemetry_origin(tmp_path, 0)
