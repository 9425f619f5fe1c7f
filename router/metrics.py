"""The router's counters and their Prometheus text exposition (format 0.0.4, written by prometheus_client):
requests by route and status, errors by class, retries, a request-latency histogram per route, and
per-worker gauges (healthy, outstanding requests) with a per-worker request counter. Plain integers and
lists updated on the hot path without locks (one event loop); a custom collector turns them into metric
families only when /metrics is scraped, so the hot path pays nothing for the library.
"""

from __future__ import annotations

import bisect
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from router.pool import Worker

# Seconds. Generations run from milliseconds (cached, short) to minutes (long rollouts).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

# Every error class the router counts, so a scrape shows zeros instead of missing series.
ERROR_CLASSES = (
    "transport",  # connecting to or reading from a worker failed before the client saw a byte
    "upstream_status",  # a worker answered 408/425/429/5xx
    "stream_broken",  # a worker failed after bytes reached the client; the client connection is cut
    "worker_gone",  # a request waited on a worker that left the pool and stopped answering; retried elsewhere
    "no_worker",  # no healthy worker (503)
    "unauthorized",  # missing or wrong bearer token (401)
    "body_too_large",  # request body over router.max_body_bytes (413)
    "client_disconnect",  # the client went away; the upstream request was cancelled
)


@dataclass
class Histogram:
    """Cumulative-bucket latency histogram of one route."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(LATENCY_BUCKETS, seconds)] += 1
        self.total += seconds


class Metrics:
    """Everything /metrics reports except the pool gauges, which are read from the workers at scrape time."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, int]] = Counter()
        self.errors: Counter[str] = Counter({cls: 0 for cls in ERROR_CLASSES})
        self.retries = 0
        self.latency: dict[str, Histogram] = {}

    def observe(self, route: str, status: int, seconds: float) -> None:
        """Count one finished request and its duration (to the last byte, streams included)."""
        self.requests[(route, status)] += 1
        hist = self.latency.get(route)
        if hist is None:
            hist = self.latency[route] = Histogram()
        hist.observe(seconds)

    def error(self, cls: str) -> None:
        if cls not in self.errors:
            raise ValueError(f"unknown error class {cls!r}; add it to router.metrics.ERROR_CLASSES")
        self.errors[cls] += 1

    def render(self, workers: Iterable[Worker]) -> str:
        """The Prometheus text exposition (format 0.0.4) of every metric, written by prometheus_client from a
        registry of this router's own (tests run several routers in one process)."""
        registry = CollectorRegistry()
        registry.register(_Snapshot(self, sorted(workers, key=lambda w: w.id)))
        return generate_latest(registry).decode()


class _Snapshot(Collector):
    """The router's counters and the pool's gauges as metric families, read when a scrape collects them."""

    def __init__(self, metrics: Metrics, workers: list[Worker]) -> None:
        self.metrics, self.workers = metrics, workers

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        requests = CounterMetricFamily(
            "slipstream_router_requests", "Proxied requests by route and final status.", labels=["route", "code"]
        )
        for (route, status), n in sorted(m.requests.items()):
            requests.add_metric([route, str(status)], n)
        errors = CounterMetricFamily(
            "slipstream_router_errors", "Failed or refused requests by error class.", labels=["class"]
        )
        for cls, n in sorted(m.errors.items()):
            errors.add_metric([cls], n)
        retries = CounterMetricFamily("slipstream_router_retries", "Requests sent again to another worker.")
        retries.add_metric([], m.retries)
        latency = HistogramMetricFamily(
            "slipstream_router_request_seconds", "Time from request to last response byte.", labels=["route"]
        )
        for route, hist in sorted(m.latency.items()):
            cumulative = list(itertools.accumulate(hist.counts))
            buckets = [(str(b), float(n)) for b, n in zip(LATENCY_BUCKETS, cumulative, strict=False)]
            latency.add_metric([route], [*buckets, ("+Inf", float(cumulative[-1]))], sum_value=hist.total)
        yield from (requests, errors, retries, latency)
        per_worker = (
            (GaugeMetricFamily, "worker_outstanding", "Requests in flight at each worker.", lambda w: w.outstanding),
            (GaugeMetricFamily, "worker_healthy", "1 while the worker passes its health checks.", lambda w: w.healthy),
            (
                CounterMetricFamily,
                "worker_requests",
                "Requests sent to each worker (retries included).",
                lambda w: w.requests,
            ),
        )
        for family, name, help_text, value in per_worker:
            metric = family(f"slipstream_router_{name}", help_text, labels=["worker", "url"])
            for w in self.workers:
                metric.add_metric([w.id, w.url], float(value(w)))
            yield metric
