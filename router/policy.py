"""Routing policy: which healthy worker gets the next request. Pure functions over the workers'
identities and outstanding-request counts, with no I/O, so they are tested directly. Three policies:
least outstanding requests (ties broken by rotation so an idle pool is still spread evenly), round
robin, and group affinity, which sends every request of one affinity key to the same worker by
rendezvous (highest-random-weight) hashing, a consistent hash: when a worker leaves only its keys
move. Affinity gives way to least outstanding when the chosen worker is overloaded.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Sequence
from typing import Literal, Protocol, TypeVar

PolicyName = Literal["least_outstanding", "round_robin", "affinity"]
_MASK64 = (1 << 64) - 1


class Candidate(Protocol):
    """What a policy needs to know about a worker."""

    @property
    def id(self) -> str: ...

    @property
    def outstanding(self) -> int: ...


W = TypeVar("W", bound=Candidate)


def hash64(text: str) -> int:
    """A stable 64-bit hash (Python's hash() is salted per process, so routers would disagree)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little")


def _mix(x: int) -> int:
    # splitmix64 finaliser: turns (key hash ^ worker hash) into a well-spread score per pair.
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _MASK64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _MASK64
    return x ^ (x >> 31)


def least_outstanding(workers: Sequence[W], start: int = 0) -> W:
    """The worker with the fewest outstanding requests; among equals the first at or after `start`."""
    n = len(workers)
    best = workers[start % n]
    for i in range(1, n):
        w = workers[(start + i) % n]
        if w.outstanding < best.outstanding:
            best = w
    return best


def round_robin(workers: Sequence[W], counter: int) -> W:
    """The `counter`-th worker, cyclically."""
    return workers[counter % len(workers)]


@functools.lru_cache(maxsize=4096)
def _worker_hash(worker_id: str) -> int:
    return hash64(worker_id)  # the same few ids on every request: hash each once


def affinity_worker(workers: Sequence[W], key: str) -> W:
    """The worker that owns `key` under rendezvous hashing: the same key maps to the same worker as
    long as that worker is in the list, and removing a worker moves only the keys it owned."""
    k = hash64(key)
    return max(workers, key=lambda w: _mix(k ^ _worker_hash(w.id)))


def overloaded(candidate: Candidate, workers: Sequence[Candidate], factor: float) -> bool:
    """True when `candidate` has more than `factor` times the pool's least outstanding requests.
    The least counts as at least one, so an idle pool does not scatter a group's first requests."""
    least = min(w.outstanding for w in workers)
    return candidate.outstanding > factor * max(least, 1)


class Policy:
    """A policy with the little state it needs (the rotation counter); `choose` is the only entry."""

    def __init__(self, name: PolicyName, overload_factor: float = 2.0) -> None:
        if name not in ("least_outstanding", "round_robin", "affinity"):
            raise ValueError(f"unknown routing policy {name!r}; use least_outstanding, round_robin or affinity")
        if overload_factor < 1.0:
            raise ValueError(f"affinity overload factor {overload_factor} must be >= 1.0")
        self.name = name
        self.overload_factor = overload_factor
        self._counter = 0

    def choose(self, workers: Sequence[W], key: str | None = None) -> W | None:
        """The worker for one request, or None when `workers` is empty. `key` is the affinity key
        (ignored by the other policies; requests without one fall back to least outstanding)."""
        if not workers:
            return None
        self._counter += 1
        if self.name == "round_robin":
            return round_robin(workers, self._counter)
        if self.name == "affinity" and key is not None:
            owner = affinity_worker(workers, key)
            if not overloaded(owner, workers, self.overload_factor):
                return owner
        return least_outstanding(workers, self._counter)
