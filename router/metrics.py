"""The router's counters and their Prometheus text exposition (format 0.0.4): requests by route and
status, errors by class, retries, a request-latency histogram per route, and per-worker gauges
(healthy, outstanding requests) with a per-worker request counter. Plain integers and lists updated
on the hot path without locks (one event loop); rendering happens only when /metrics is scraped.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

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


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


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
        """The Prometheus text exposition of every metric."""
        out = [
            "# HELP slipstream_router_requests_total Proxied requests by route and final status.",
            "# TYPE slipstream_router_requests_total counter",
        ]
        for (route, status), n in sorted(self.requests.items()):
            out.append(f'slipstream_router_requests_total{{route="{_label(route)}",code="{status}"}} {n}')
        out += [
            "# HELP slipstream_router_errors_total Failed or refused requests by error class.",
            "# TYPE slipstream_router_errors_total counter",
        ]
        for cls, n in sorted(self.errors.items()):
            out.append(f'slipstream_router_errors_total{{class="{cls}"}} {n}')
        out += [
            "# HELP slipstream_router_retries_total Requests sent again to another worker.",
            "# TYPE slipstream_router_retries_total counter",
            f"slipstream_router_retries_total {self.retries}",
            "# HELP slipstream_router_request_seconds Time from request to last response byte.",
            "# TYPE slipstream_router_request_seconds histogram",
        ]
        for route, hist in sorted(self.latency.items()):
            r = _label(route)
            cumulative = 0
            for bound, n in zip(LATENCY_BUCKETS, hist.counts, strict=False):
                cumulative += n
                out.append(f'slipstream_router_request_seconds_bucket{{route="{r}",le="{bound}"}} {cumulative}')
            cumulative += hist.counts[-1]
            out.append(f'slipstream_router_request_seconds_bucket{{route="{r}",le="+Inf"}} {cumulative}')
            out.append(f'slipstream_router_request_seconds_sum{{route="{r}"}} {hist.total:.6f}')
            out.append(f'slipstream_router_request_seconds_count{{route="{r}"}} {cumulative}')
        workers = sorted(workers, key=lambda w: w.id)
        gauges = (
            ("worker_outstanding", "gauge", "Requests in flight at each worker.", lambda w: w.outstanding),
            ("worker_healthy", "gauge", "1 while the worker passes its health checks.", lambda w: int(w.healthy)),
            (
                "worker_requests_total",
                "counter",
                "Requests sent to each worker (retries included).",
                lambda w: w.requests,
            ),
        )
        for name, kind, help_text, value in gauges:
            out += [f"# HELP slipstream_router_{name} {help_text}", f"# TYPE slipstream_router_{name} {kind}"]
            for w in workers:
                out.append(f'slipstream_router_{name}{{worker="{_label(w.id)}",url="{_label(w.url)}"}} {value(w)}')
        return "\n".join(out) + "\n"
