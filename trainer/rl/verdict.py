"""The RL driver's bounded wait, at the end of a run, for the evaluator's verdict on the last versions: a
blocking read of the experiment's `evals` stream (no polling) until the results are in or the time is up.
The report (trainer/report.py) then reads whatever was recorded; it never waits on another role."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import redis

from common.config import EvaluatorConfig
from common.keys import Keys
from common.redis_client import entries

log = logging.getLogger(__name__)


def wait_for_verdict(
    client: redis.Redis, keys: Keys, ev: EvaluatorConfig, final_version: int, versions: Iterable[int], wait_s: float
) -> None:
    """Wait at most `wait_s` in all for every benchmark's result on the last version the evaluator measures
    (the newest multiple of every_n_versions up to `final_version`) and, with a pinning evaluator, on every
    due one of the run's `versions`; logs what is still missing. No wait without a live evaluator. Every
    benchmark, not only the first: the evaluator runs them one after another, and a run that stopped at the
    first one's result tore the evaluator down in the middle of the next (its last version never measured)."""
    evaluator_alive = bool(list(client.scan_iter(keys.role_pattern("evaluator"), count=100)))
    if not ev.benchmarks or not evaluator_alive:
        return
    last = final_version - final_version % ev.every_n_versions
    names = ", ".join(ev.benchmarks)
    log.info("waiting up to %.0fs for the evaluator's results (%s) of version %d", wait_s, names, last)
    deadline = time.monotonic() + wait_s

    def left() -> float:
        return max(0.0, deadline - time.monotonic())

    late = [b for b in ev.benchmarks if not wait_for_eval(client, keys, last, b, left())]
    if late:
        log.warning("no %s result for version %d yet; the table shows what was evaluated", ", ".join(late), last)
    elif client.hlen(keys.eval_workers):
        # A pinning evaluator measures every due version, newest first, then backfills the older ones.
        due = {v for v in versions if v % ev.every_n_versions == 0 and v <= last}
        for benchmark in ev.benchmarks:
            if missing := wait_for_evals(client, keys, due, benchmark, left()):
                log.warning(
                    "no %s result yet for version(s) %s; the table shows what was evaluated", benchmark, sorted(missing)
                )


def wait_for_eval(client: redis.Redis, keys: Keys, version: int, benchmark: str, timeout_s: float) -> bool:
    """Block (on the stream, no polling) until `benchmark` has a result for `version` or a newer one,
    or the timeout. The blocking read continues from the last entry already seen, so a result that
    lands between the first read and the blocking one is not missed."""
    return not _wait_stream(
        client, keys, lambda f: f.get("benchmark") == benchmark and int(f["version"]) >= version, timeout_s, 1
    )


def wait_for_evals(client: redis.Redis, keys: Keys, versions: set[int], benchmark: str, timeout_s: float) -> set[int]:
    """Block until `benchmark` has a result for every one of `versions`, or the timeout; the versions
    still without one (an evaluator that pins each version backfills older ones after the newest)."""
    pending = set(versions)

    def answers(fields: dict[str, str]) -> bool:
        if fields.get("benchmark") == benchmark and int(fields["version"]) in pending:
            pending.discard(int(fields["version"]))
            return True
        return False

    _wait_stream(client, keys, answers, timeout_s, len(pending))
    return pending


def _wait_stream(
    client: redis.Redis, keys: Keys, answers: Callable[[dict[str, str]], bool], timeout_s: float, needed: int
) -> int:
    """Read the evals stream from its start, then block on it, until `needed` entries answered or the
    timeout; how many are still needed."""
    if needed <= 0:
        return 0
    last_id = "0-0"
    for entry_id, fields in entries(client.xrange(keys.evals)):
        needed -= answers(fields)
        if needed <= 0:
            return 0
        last_id = entry_id
    deadline = time.monotonic() + timeout_s
    while (left_ms := int((deadline - time.monotonic()) * 1000)) > 0:
        reply = client.xread({keys.evals: last_id}, block=min(left_ms, 1000), count=100)
        assert not isinstance(reply, dict), "our clients speak RESP2: [[stream, [(id, fields), ...]], ...] or None"
        for _, got in reply or []:
            for entry_id, fields in entries(got):
                needed -= answers(fields)
                if needed <= 0:
                    return 0
                last_id = entry_id
    return needed
