"""Routing policies, the pool's bookkeeping and the metrics text: pure code, tested without I/O."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import pytest

from common.weights.fleet import WorkerRecord
from router.metrics import Metrics
from router.policy import Policy, affinity_worker, least_outstanding, overloaded
from router.pool import WorkerPool
from router.proxy import body_affinity_key
from tests.support.prom import value


@dataclass
class W:
    id: str
    outstanding: int = 0


def pool_of(n: int) -> list[W]:
    return [W(f"w{i}") for i in range(n)]


def test_least_outstanding_picks_the_least_loaded_worker():
    workers = [W("a", 3), W("b", 1), W("c", 2)]
    assert least_outstanding(workers, start=0).id == "b"
    assert least_outstanding(workers, start=2).id == "b"


def test_least_outstanding_spreads_ties_by_rotation():
    policy = Policy("least_outstanding")
    workers = pool_of(3)
    chosen = Counter(policy.choose(workers).id for _ in range(30))
    assert chosen == {"w0": 10, "w1": 10, "w2": 10}


def test_round_robin_cycles_through_workers_regardless_of_load():
    policy = Policy("round_robin")
    workers = [W("a", 100), W("b", 0)]
    assert [policy.choose(workers).id for _ in range(4)] in (["b", "a", "b", "a"], ["a", "b", "a", "b"])


def test_no_workers_means_no_choice():
    assert Policy("affinity").choose([], "g") is None


def test_affinity_sends_one_key_to_one_worker_and_spreads_keys():
    policy = Policy("affinity")
    workers = pool_of(4)
    owners = {}
    for key in (f"group-{i}" for i in range(200)):
        chosen = {policy.choose(workers, key).id for _ in range(5)}
        assert len(chosen) == 1, f"{key} went to {chosen}"
        owners[key] = chosen.pop()
    spread = Counter(owners.values())
    assert len(spread) == 4 and min(spread.values()) > 25, spread


def test_affinity_is_consistent_when_a_worker_leaves():
    workers = pool_of(4)
    before = {f"g{i}": affinity_worker(workers, f"g{i}").id for i in range(400)}
    remaining = [w for w in workers if w.id != "w2"]
    after = {key: affinity_worker(remaining, key).id for key in before}
    moved = {key for key in before if before[key] != after[key]}
    assert moved == {key for key, owner in before.items() if owner == "w2"}


def test_affinity_falls_back_to_least_loaded_when_its_worker_is_overloaded():
    workers = pool_of(3)
    policy = Policy("affinity", overload_factor=2.0)
    owner = affinity_worker(workers, "g")
    others = [w for w in workers if w is not owner]
    for w in others:
        w.outstanding = 3
    owner.outstanding = 6  # exactly factor x least: still the owner
    assert policy.choose(workers, "g") is owner
    owner.outstanding = 7
    others[1].outstanding = 2
    assert policy.choose(workers, "g") is others[1]


def test_an_idle_pool_counts_as_one_so_a_group_stays_together():
    owner, idle = W("a", 2), W("b", 0)
    assert not overloaded(owner, [owner, idle], factor=2.0)
    owner.outstanding = 3
    assert overloaded(owner, [owner, idle], factor=2.0)


def test_requests_without_affinity_key_use_least_outstanding():
    workers = [W("a", 5), W("b", 0), W("c", 5)]
    assert Policy("affinity").choose(workers, None).id == "b"


def test_policy_rejects_unknown_names_and_factors():
    with pytest.raises(ValueError, match="least_outstanding"):
        Policy("random")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="0.5"):
        Policy("affinity", overload_factor=0.5)


def record(worker_id: str, url: str = "", version: int = 0) -> WorkerRecord:
    raw = json.dumps({"url": url or f"http://127.0.0.1:1/{worker_id}", "model": "m", "weight_version": version})
    return WorkerRecord.from_json(worker_id, raw)


def test_pool_admits_only_after_health_and_only_with_a_live_heartbeat():
    pool = WorkerPool()
    changes = pool.apply({"a": record("a"), "b": record("b")}, alive={"a"})
    assert [w.id for w in changes.added] == ["a"]
    assert pool.healthy == ()
    assert pool.set_health(pool.workers["a"], True) == "admitted"
    assert [w.id for w in pool.healthy] == ["a"]
    assert pool.set_health(pool.workers["a"], True) is None


def test_pool_removes_expired_deregistered_and_moved_workers():
    pool = WorkerPool()
    pool.apply({i: record(i) for i in "abc"}, alive=set("abc"))
    for w in list(pool.workers.values()):
        pool.set_health(w, True)
    changes = pool.apply({"a": record("a"), "b": record("b", url="http://127.0.0.1:2")}, alive={"b"})
    reasons = {w.id: why for w, why in changes.removed}
    assert reasons == {"a": "heartbeat expired", "b": "re-registered at http://127.0.0.1:2", "c": "deregistered"}
    assert [w.id for w in changes.added] == ["b"]
    assert pool.healthy == ()  # the re-registered b waits for its own health check


def test_pool_updates_weight_version_in_place():
    pool = WorkerPool()
    pool.apply({"a": record("a", version=1)}, alive={"a"})
    worker = pool.workers["a"]
    pool.apply({"a": record("a", version=2)}, alive={"a"})
    assert pool.workers["a"] is worker and worker.record.weight_version == 2


def test_health_verdict_for_a_removed_worker_changes_nothing():
    pool = WorkerPool()
    pool.apply({"a": record("a")}, alive={"a"})
    stale = pool.workers["a"]
    pool.apply({}, alive=set())
    assert pool.set_health(stale, True) is None and pool.healthy == ()


def test_affinity_key_in_body_is_found_without_disturbing_other_bodies():
    assert body_affinity_key(b'{"prompt": "p", "slipstream_group": 17}') == "17"
    assert body_affinity_key(b'{"prompt": "p"}') is None
    assert body_affinity_key(b'{"slipstream_group": broken') is None


def test_metrics_text_has_counters_histogram_and_worker_gauges():
    metrics = Metrics()
    metrics.observe("/v1/completions", 200, 0.003)
    metrics.observe("/v1/completions", 200, 2.0)
    metrics.error("transport")
    pool = WorkerPool()
    pool.apply({"a": record("a")}, alive={"a"})
    pool.workers["a"].outstanding = 4
    text = metrics.render(pool.workers.values())
    route = "/v1/completions"
    assert value(text, "slipstream_router_requests_total", route=route, code="200") == 2
    assert value(text, "slipstream_router_errors_total", **{"class": "transport"}) == 1
    assert value(text, "slipstream_router_errors_total", **{"class": "no_worker"}) == 0
    assert value(text, "slipstream_router_request_seconds_bucket", route=route, le="0.005") == 1
    assert value(text, "slipstream_router_request_seconds_bucket", route=route, le="+Inf") == 2
    assert value(text, "slipstream_router_request_seconds_sum", route=route) == pytest.approx(2.003)
    assert value(text, "slipstream_router_worker_outstanding", worker="a", url="http://127.0.0.1:1/a") == 4
    with pytest.raises(ValueError, match="ERROR_CLASSES"):
        metrics.error("oops")
