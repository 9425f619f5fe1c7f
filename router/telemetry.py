"""The router's telemetry, stored: every `router.telemetry_period_s` (1 s) the router writes its own figures
and each worker's engine metrics into the run's metrics (DuckDB, and the configured sinks) as role `router`.

Step k is the k-th period since the run's first router of this rank started (`origin`: its wall-clock start,
kept in `<run dir>/metrics/router-<rank>.origin`), so a restarted router goes on where the killed one
stopped instead of writing over its steps. Tags:
- `serve/requests_per_s`, `serve/errors_per_s`, `serve/retries_per_s`: counter rates over the period;
  `serve/latency_mean_s`: mean time to the last byte of the requests that finished in it (absent when none did);
  `serve/healthy_workers`, `serve/outstanding`: the pool now.
- `engine/<worker id>/running`, `/waiting` (vLLM's vllm:num_requests_running / _waiting), `/kv_cache_usage`
  (vllm:kv_cache_usage_perc, a fraction 0..1), `/prompt_tokens_per_s` and `/generation_tokens_per_s` (rates of
  vllm:prompt_tokens / vllm:generation_tokens), scraped from the worker's /metrics and read with
  prometheus_client's parser; gauges are summed over vLLM's label sets (engines of one server).
A worker that cannot be scraped is skipped for the period; the first failure and the recovery are logged once.
A counter that went backwards (a restarted server) gives no rate for that period.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from router.metrics import Metrics
from router.pool import WorkerPool

log = logging.getLogger(__name__)

ENGINE_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv_cache_usage",
}
ENGINE_COUNTERS = {"vllm:prompt_tokens": "prompt_tokens", "vllm:generation_tokens": "generation_tokens"}


class Writer(Protocol):
    def log(self, tag: str, step: int, value: float, ts_ms: int | None = None) -> None: ...


def engine_figures(page: str) -> dict[str, float]:
    """The engine figures of one vLLM /metrics page: the gauges (summed over label sets) and the counters'
    totals, under ENGINE_GAUGES' and ENGINE_COUNTERS' short names (a metric the page lacks is left out)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(page):
        if family.name in ENGINE_GAUGES:
            name, wanted = ENGINE_GAUGES[family.name], family.name
        elif family.name in ENGINE_COUNTERS:
            name, wanted = ENGINE_COUNTERS[family.name], family.name + "_total"
        else:
            continue
        values = [s.value for s in family.samples if s.name == wanted]
        if values:
            out[name] = out.get(name, 0.0) + sum(values)
    return out


def _rate(now: float, before: float | None, seconds: float) -> float | None:
    return None if before is None or now < before or seconds <= 0 else (now - before) / seconds


class Telemetry:
    """The sampler: `start()` runs it on the event loop until `stop()`."""

    def __init__(
        self,
        metrics: Metrics,
        pool: WorkerPool,
        session: aiohttp.ClientSession,
        writer: Writer,
        period_s: float = 1.0,
        timeout_s: float = 2.0,
        origin: float | None = None,
    ) -> None:
        """`origin`: the wall-clock time of step 0 (telemetry_origin), now when None."""
        self.metrics, self.pool, self.session, self.writer = metrics, pool, session, writer
        self.origin = time.time() if origin is None else origin
        self.period_s, self.timeout_s = period_s, timeout_s
        self._task: asyncio.Task[None] | None = None
        self._router_before: tuple[float, float, float, float, float] | None = None
        self._latency_before = 0.0  # seconds of the finished requests, summed, at the previous sample
        self._engine_before: dict[str, tuple[float, dict[str, float]]] = {}
        self._failing: set[str] = set()

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="router-telemetry")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _run(self) -> None:
        step = int((time.time() - self.origin) / self.period_s)
        while True:
            step = max(step + 1, int((time.time() - self.origin) / self.period_s) + 1)
            await asyncio.sleep(max(0.0, self.origin + step * self.period_s - time.time()))
            try:
                await self.sample(step)
            except Exception:  # a bug here must not take the router down; say it once per sample
                log.exception("router telemetry: sample %d failed", step)

    async def sample(self, step: int) -> None:
        """Write step `step`'s figures (see the module docstring)."""
        now = time.monotonic()
        m = self.metrics
        totals = (
            now,
            float(sum(m.requests.values())),
            float(sum(m.errors.values())),
            float(m.retries),
            float(sum(sum(h.counts) for h in m.latency.values())),
        )
        seconds_total = sum(h.total for h in m.latency.values())
        figures: dict[str, float] = {
            "serve/healthy_workers": float(len(self.pool.healthy)),
            "serve/outstanding": float(sum(w.outstanding for w in self.pool.workers.values())),
        }
        before = self._router_before
        if before is not None:
            dt = now - before[0]
            for tag, i in (("serve/requests_per_s", 1), ("serve/errors_per_s", 2), ("serve/retries_per_s", 3)):
                rate = _rate(totals[i], before[i], dt)
                if rate is not None:
                    figures[tag] = rate
            finished = totals[4] - before[4]
            if finished > 0:
                figures["serve/latency_mean_s"] = (seconds_total - self._latency_before) / finished
        self._router_before, self._latency_before = totals, seconds_total
        workers = list(self.pool.workers.values())
        pages = await asyncio.gather(*(self._scrape(w.id, w.url) for w in workers))
        for worker, page in zip(workers, pages, strict=True):
            if page is not None:
                figures |= self._engine(worker.id, now, page)
        ts_ms = int(time.time() * 1000)
        for tag, value in figures.items():
            if math.isfinite(value):
                self.writer.log(tag, step, value, ts_ms)

    def _engine(self, worker: str, now: float, figures: Mapping[str, float]) -> dict[str, float]:
        out = {f"engine/{worker}/{name}": figures[name] for name in ENGINE_GAUGES.values() if name in figures}
        before = self._engine_before.get(worker)
        if before is not None:
            for name in ENGINE_COUNTERS.values():
                rate = _rate(figures.get(name, math.nan), before[1].get(name), now - before[0])
                if rate is not None and math.isfinite(rate):
                    out[f"engine/{worker}/{name}_per_s"] = rate
        self._engine_before[worker] = (now, dict(figures))
        return out

    async def _scrape(self, worker: str, url: str) -> dict[str, float] | None:
        try:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with self.session.get(f"{url}/metrics", timeout=timeout) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}")
                figures = engine_figures(await resp.text())
        except (aiohttp.ClientError, TimeoutError, RuntimeError, ValueError) as exc:
            if worker not in self._failing:
                self._failing.add(worker)
                log.warning("router telemetry: cannot read %s/metrics of worker %s: %s", url, worker, exc)
            return None
        if worker in self._failing:
            self._failing.discard(worker)
            log.info("router telemetry: reading worker %s's /metrics again", worker)
        return figures


def telemetry_origin(run_dir: str | Path, rank: int) -> float:
    """The wall-clock start of router `rank`'s telemetry in this run: read from its origin file, or now (written
    there) for the run's first router of that rank."""
    path = Path(run_dir) / "metrics" / f"router-{rank}.origin"
    try:
        return float(path.read_text())
    except FileNotFoundError:
        pass
    except ValueError as exc:
        raise ValueError(f"{path}: not a time ({exc}); remove the file to start the router's telemetry anew") from None
    now = time.time()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".origin.tmp")
    tmp.write_text(repr(now))
    tmp.replace(path)
    return now
