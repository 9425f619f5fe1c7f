"""Parsing of vLLM's token-route responses into Samples: per-token versions from version spans,
the abort flag, routed experts (one row per position), and errors (never zeros) when log-probs or
version labels are missing or the routed experts do not fit the tokens."""

from __future__ import annotations

import base64
import io
from collections.abc import Awaitable, Callable

import numpy as np
import pytest
from aiohttp import web

from rollout.client import RolloutClient, RolloutError, parse_choice


def choice(tokens, logprobs, spans, finish="length"):
    content = [{"token_id": t, "logprob": lp} for t, lp in zip(tokens, logprobs, strict=True)]
    return {
        "index": 0,
        "token_ids": tokens,
        "logprobs": {"content": content},
        "weight_versions": spans,
        "finish_reason": finish,
    }


def test_version_spans_become_one_version_per_token():
    c = choice(
        [7, 8, 9], [-0.1, -0.2, -0.3], [{"version": "2", "start": 0, "end": 2}, {"version": "3", "start": 2, "end": 3}]
    )
    s = parse_choice([1, 2], c)
    assert s.token_ids == [7, 8, 9] and s.logprobs == [-0.1, -0.2, -0.3]
    assert s.versions == [2, 2, 3] and s.oldest_version == 2 and not s.aborted


def test_abort_finish_reason_marks_the_sample_partial():
    s = parse_choice([1], choice([7], [-1.0], [{"version": "0", "start": 0, "end": 1}], finish="abort"))
    assert s.aborted and s.finish_reason == "abort"


def test_a_response_without_logprobs_is_an_error():
    c = choice([7, 8], [-0.1, -0.2], [{"version": "0", "start": 0, "end": 2}])
    c["logprobs"] = None
    with pytest.raises(RolloutError, match="0 log-probs for 2 tokens"):
        parse_choice([1], c)


def test_a_logprob_for_another_token_or_an_unlabelled_token_is_an_error():
    c = choice([7, 8], [-0.1, -0.2], [{"version": "0", "start": 0, "end": 2}])
    c["logprobs"]["content"][1]["token_id"] = 9
    with pytest.raises(RolloutError, match="not the sampled 8"):
        parse_choice([1], c)
    with pytest.raises(RolloutError, match="1 of 2 tokens"):
        parse_choice([1], choice([7, 8], [-0.1, -0.2], [{"version": "0", "start": 0, "end": 1}]))


def npy_base64(a: np.ndarray) -> str:
    """How vLLM's token route encodes routed experts."""
    buf = io.BytesIO()
    np.save(buf, a)
    return base64.b64encode(buf.getvalue()).decode()


def test_routed_experts_become_an_array_with_a_row_per_position_and_are_none_when_absent():
    rows = np.arange(4 * 3 * 2, dtype=np.uint8).reshape(4, 3, 2)  # prompt 2 + completion 3 - 1 positions
    c = choice([7, 8, 9], [-0.1, -0.2, -0.3], [{"version": "0", "start": 0, "end": 3}])
    assert parse_choice([1, 2], c).routed_experts is None
    c["routed_experts"] = npy_base64(rows)
    got = parse_choice([1, 2], c).routed_experts
    assert got.dtype == np.uint8 and (got == rows).all()


def test_routed_experts_that_do_not_fit_the_tokens_are_an_error():
    c = choice([7, 8, 9], [-0.1, -0.2, -0.3], [{"version": "0", "start": 0, "end": 3}])
    c["routed_experts"] = npy_base64(np.zeros((3, 3, 2), dtype=np.uint8))
    with pytest.raises(RolloutError, match="3 rows for 4 positions"):
        parse_choice([1, 2], c)
    c["routed_experts"] = "not base64!"
    with pytest.raises(RolloutError, match="not base64 of a .npy array"):
        parse_choice([1, 2], c)


def test_client_needs_a_url_or_redis_to_find_the_router():
    with pytest.raises(ValueError, match="needs a url"):
        RolloutClient("policy")


@pytest.mark.parametrize(
    ("status", "transient"),
    [
        (500, True),
        (501, True),
        (502, True),
        (503, True),
        (505, True),
        (429, True),
        (425, True),
        (408, True),
        (400, False),
        (404, False),
        (None, False),
    ],
)
def test_http_errors_worth_retrying_are_transient_for_the_controller(status, transient):
    from rollout.outcomes import is_transient

    assert is_transient(RolloutError("x", status=status)) is transient


async def one_token_worker(seen: Callable[[dict], Awaitable[None]]) -> tuple[web.AppRunner, str]:
    """A worker on loopback whose generate route answers every request with one token (version 0), after
    handing its JSON body to `seen`; returns its runner (to clean up) and its URL."""

    async def generate(request: web.Request) -> web.Response:
        await seen(await request.json())
        return web.json_response({"choices": [choice([5], [-0.5], [{"version": "0", "start": 0, "end": 1}])]})

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    return runner, f"http://127.0.0.1:{port}"


async def test_the_router_url_is_read_once_per_ttl_and_again_at_once_after_a_failed_request(redis_client):
    """Two routers stand-ins (real aiohttp servers on loopback) and the experiment's real Redis: the client reads
    the published URL once for many requests, and a request that fails on a gone router makes the next one read
    the URL again, so a restarted router is found without waiting for the TTL."""
    import aiohttp

    from common.keys import Keys

    served: list[str] = []

    async def start(name: str) -> tuple[web.AppRunner, str]:
        async def seen(body: dict) -> None:
            served.append(name)

        return await one_token_worker(seen)

    keys = Keys("url-cache")
    first, first_url = await start("first")
    second, second_url = await start("second")
    await redis_client.set(keys.router("default"), first_url)
    client = RolloutClient("m", redis_client=redis_client, keys=keys)
    try:
        gets = (await redis_client.info("commandstats")).get("cmdstat_get", {}).get("calls", 0)
        for _ in range(20):
            await client.generate([1, 2], max_tokens=1)
        after = (await redis_client.info("commandstats"))["cmdstat_get"]["calls"]
        assert served == ["first"] * 20 and after - gets == 1, (served, after - gets)
        # The router restarts elsewhere: the cached URL fails once, and the next request finds the new one.
        await redis_client.set(keys.router("default"), second_url)
        await first.cleanup()
        with pytest.raises(aiohttp.ClientConnectionError):
            await client.generate([1, 2], max_tokens=1)
        await client.generate([1, 2], max_tokens=1)
        assert served[-1] == "second", served
    finally:
        await client.close()
        await second.cleanup()


async def test_every_sampling_parameter_is_sent_and_each_sample_records_its_own():
    """A parameter left out of a request may take the model's generation_config.json default, which the
    trainer would not reproduce: every one is sent, those the trainer does not model at neutral values."""
    bodies: list[dict] = []

    async def seen(body: dict) -> None:
        bodies.append(body)

    runner, url = await one_token_worker(seen)
    try:
        async with RolloutClient("m", url=url) as client:
            (sample,) = await client.generate([1, 2], temperature=0.7, top_k=20, top_p=0.9, max_tokens=1)
    finally:
        await runner.cleanup()
    params = bodies[0]["sampling_params"]
    assert {k: params[k] for k in ("temperature", "top_k", "top_p", "max_tokens")} == {
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
        "max_tokens": 1,
    }
    assert params["min_p"] == 0 and params["repetition_penalty"] == 1
    assert params["presence_penalty"] == 0 and params["frequency_penalty"] == 0
    assert (sample.temperature, sample.top_k, sample.top_p) == (0.7, 20, 0.9)


def test_a_sample_pickled_before_it_recorded_its_sampling_parameters_loads_with_the_neutral_ones():
    import pickle

    s = parse_choice([1], choice([7], [-1.0], [{"version": "0", "start": 0, "end": 1}]))
    for name in ("temperature", "top_k", "top_p"):
        del s.__dict__[name]  # as a Sample of the class before these fields pickled itself
    old = pickle.loads(pickle.dumps(s))
    assert (old.temperature, old.top_k, old.top_p) == (1.0, 0, 1.0)
