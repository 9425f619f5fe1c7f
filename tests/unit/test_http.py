"""The shared retry policy (common/http.py): which statuses are retried and the backoff schedule."""

from __future__ import annotations

import random

import pytest

from common.http import RetryPolicy, retryable_status


def test_timeouts_too_early_overload_and_every_5xx_are_retryable_and_other_answers_are_not():
    statuses = (200, 204, 301, 400, 401, 404, 408, 413, 422, 425, 429, 500, 501, 502, 503, 504, 505, 599)
    assert [s for s in statuses if retryable_status(s)] == [408, 425, 429, 500, 501, 502, 503, 504, 505, 599]


def test_backoff_doubles_per_retry_with_a_jitter_of_half_to_all_of_the_step():
    policy = RetryPolicy(backoff_s=0.5, cap_s=100.0, rng=random.Random(0))
    for attempt in range(6):
        step = 0.5 * 2**attempt
        assert step / 2 <= policy.delay(attempt) < step


def test_backoff_stops_growing_at_the_cap():
    policy = RetryPolicy(backoff_s=1.0, cap_s=4.0, rng=random.Random(0))
    assert max(policy.delay(attempt) for attempt in range(2, 30)) < 4.0
    assert min(policy.delay(attempt) for attempt in range(2, 30)) >= 2.0


def test_the_same_seed_gives_the_same_schedule():
    def schedule(seed: int) -> list[float]:
        policy = RetryPolicy(rng=random.Random(seed))
        return [policy.delay(attempt) for attempt in range(8)]

    assert schedule(7) == schedule(7)
    assert schedule(7) != schedule(8)


@pytest.mark.parametrize(("retry_after", "delay"), [("3", 3.0), ("0.25", 0.25), ("-2", 0.0), ("3600", 10.0)])
def test_retry_after_in_seconds_is_obeyed_up_to_the_cap(retry_after, delay):
    assert RetryPolicy(backoff_s=0.5).delay(0, retry_after) == delay


def test_retry_after_as_an_http_date_falls_back_to_the_backoff():
    policy = RetryPolicy(backoff_s=0.5, rng=random.Random(0))
    assert 0.25 <= policy.delay(0, "Wed, 21 Oct 2015 07:28:00 GMT") < 0.5
