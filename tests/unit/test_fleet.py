"""The worker fleet's records in Redis (common/weights/fleet.py) against a real redis-server: a record round-trips
through its hash value, a bad value is refused naming the worker and the fix and is skipped by every reader,
a worker is live only while its liveness key exists, recording a version changes only the version, and
the fleet, the router, the evaluator and the worker role import without torch."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from common.keys import Keys
from common.weights.fleet import WorkerRecord, live_workers, read_records, register, set_worker_version, time_to_live

ROOT = Path(__file__).resolve().parents[2]


def test_a_record_round_trips_through_its_hash_value():
    record = WorkerRecord("w0", "http://h:1", "policy", 3, 12.5)
    assert WorkerRecord.from_json("w0", record.to_json()) == record
    assert WorkerRecord.from_json("w1", json.dumps({"url": "http://h:2/"})) == WorkerRecord("w1", "http://h:2")


def test_bad_worker_records_name_the_worker_and_the_fix():
    with pytest.raises(ValueError, match="worker 'x'.*url"):
        WorkerRecord.from_json("x", "not json")
    with pytest.raises(ValueError, match="'ftp://h'"):
        WorkerRecord.from_json("x", json.dumps({"url": "ftp://h"}))


@pytest.mark.timeout(30)
async def test_live_workers_are_the_readable_records_whose_liveness_key_exists(redis_client):
    r, keys = redis_client, Keys("t-fleet")
    for worker_id in ("b", "a", "dead"):
        await register(r, keys.workers, WorkerRecord(worker_id, f"http://127.0.0.1:1/{worker_id}"))
    await r.hset(keys.workers, "broken", "not json")
    await r.set(keys.worker_alive("a"), "1", px=10_000)
    await r.set(keys.worker_alive("b"), "1")  # no TTL
    await r.set(keys.worker_alive("broken"), "1")

    assert list(await read_records(r, keys.workers)) == ["a", "b", "dead"]
    assert await live_workers(r, keys) == {"a": "http://127.0.0.1:1/a", "b": "http://127.0.0.1:1/b"}
    ttls = await time_to_live(r, keys, ["a", "b", "dead"])
    assert set(ttls) == {"a", "b"} and 0 < ttls["a"] <= 10 and ttls["b"] == math.inf
    assert await live_workers(r, keys, keys.eval_workers) == {}


@pytest.mark.timeout(30)
async def test_recording_a_version_changes_only_the_version_and_never_registers_a_worker(redis_client):
    r, keys = redis_client, Keys("t-fleet")
    await register(r, keys.workers, WorkerRecord("a", "http://127.0.0.1:1", "policy", 0, 12.5))
    await set_worker_version(r, keys.workers, "a", 7)
    await set_worker_version(r, keys.workers, "gone", 7)
    assert await read_records(r, keys.workers) == {"a": WorkerRecord("a", "http://127.0.0.1:1", "policy", 7, 12.5)}


@pytest.mark.timeout(60)
def test_the_fleet_the_router_the_evaluator_and_the_worker_role_import_without_torch():
    code = (
        "import sys\n"
        "import common.weights.fleet, router.server, evaluator.role, evaluator.runner, rollout.worker, common.weights.publisher\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
