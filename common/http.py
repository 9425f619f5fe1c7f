"""The one retry policy of every HTTP caller: which answers are worth trying again and how long to wait.

A 408, 425, 429 or any 5xx says "try elsewhere or later"; any other status is the answer. Transport
errors are retryable too, but each caller names its own (aiohttp's, the router's UpstreamError), so
they are not listed here. Left out: the retry loop itself, which differs per caller (the router retries
at once on another worker and never once bytes reached its client; the others wait `RetryPolicy.delay`).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

# The router names the worker that answered a proxied request (its id, `<host>-<pid>-<replica>`) in this header.
WORKER_HEADER = "X-Slipstream-Worker"
RETRYABLE_4XX = frozenset({408, 425, 429})  # request timeout, too early, too many requests
BACKOFF_CAP_S = 10.0


def worker_replica(worker_id: str) -> int:
    """The replica index of a Slipstream worker id (`<host>-<pid>-<replica>`, common.roles' instance name):
    stable across the worker's restarts; -1 for an id of another form (a server not started by Slipstream)."""
    last = worker_id.rsplit("-", 1)[-1]
    return int(last) if "-" in worker_id and last.isdigit() else -1


def retryable_status(status: int) -> bool:
    """True for an answer worth retrying: 408, 425, 429 and every 5xx."""
    return status >= 500 or status in RETRYABLE_4XX


@dataclass(frozen=True)
class RetryPolicy:
    """How often to try again after a retryable failure, and how long to wait before each retry."""

    max_retries: int = 6
    """Retries after the first attempt (attempts = max_retries + 1)."""
    backoff_s: float = 0.5
    """The wait before the first retry; it doubles with every retry, up to cap_s."""
    cap_s: float = BACKOFF_CAP_S
    """The longest wait, also for a server's Retry-After."""
    rng: random.Random = field(default_factory=random.Random, repr=False, compare=False)
    """The jitter's source; pass random.Random(seed) for a reproducible schedule."""

    def delay(self, attempt: int, retry_after: str | None = None) -> float:
        """Seconds to wait before retry number `attempt` (0-based): the server's Retry-After in seconds if it
        sent one, else capped exponential backoff scaled by a jitter in [0.5, 1) so that many clients do not
        retry in lockstep."""
        if retry_after is not None:
            try:
                return min(self.cap_s, max(0.0, float(retry_after)))
            except ValueError:
                pass  # an HTTP-date; fall back to our own backoff
        return min(self.cap_s, self.backoff_s * 2**attempt) * (0.5 + self.rng.random() / 2)
