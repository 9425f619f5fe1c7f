"""Advertised addresses (common/net.py) on this machine's real interfaces."""

from __future__ import annotations

import pytest

from common.net import AddressError, advertised, free_port, host_addresses, route_source, url_host, vllm_session
from common.weights.workers import WorkerDriver


def test_a_specific_bind_is_advertised_as_is_and_an_explicit_advertise_wins():
    assert advertised("127.0.0.1", "auto", "127.0.0.1", "x.advertise_host") == "127.0.0.1"
    assert advertised("192.0.2.5", "auto", None, "x.advertise_host") == "192.0.2.5"
    assert advertised("0.0.0.0", "node7.cluster", "127.0.0.1", "x.advertise_host") == "node7.cluster"


def test_a_wildcard_bind_advertises_the_address_that_routes_to_redis():
    assert route_source("127.0.0.1") == "127.0.0.1"
    assert advertised("0.0.0.0", "auto", "127.0.0.1", "x.advertise_host") == "127.0.0.1"


def test_redis_with_a_wildcard_bind_needs_one_address_or_an_explicit_setting():
    found = host_addresses()
    if len(found) == 1:
        assert advertised("0.0.0.0", "auto", None, "rendezvous.advertise_host") == found[0]
    else:
        with pytest.raises(AddressError, match=r"set rendezvous\.advertise_host to the one the other hosts reach"):
            advertised("0.0.0.0", "auto", None, "rendezvous.advertise_host")


def test_ipv6_hosts_are_bracketed_in_urls_and_ports_are_free():
    assert url_host("::1") == "[::1]" and url_host("192.0.2.1") == "192.0.2.1"
    assert 0 < free_port("127.0.0.1") < 65536


async def test_vllm_sessions_drop_idle_connections_before_vllms_server_does():
    """vLLM's uvicorn closes idle keep-alive connections after VLLM_HTTP_TIMEOUT_KEEP_ALIVE; a client keeping them
    longer sends requests on connections being closed ("Can not write request body", retried with a warning)."""
    from vllm import envs

    async with vllm_session("t") as session:
        assert (
            session.connector is not None and session.connector._keepalive_timeout < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
        )
        assert session.headers["Authorization"] == "Bearer t"
    # The publishers' driver of the workers' weight routes: a publish reused a connection the worker was closing,
    # its /pause failed with a reset and the worker was evicted (test_rl_e2e's EP 2 run).
    driver = WorkerDriver(None, None, "k")  # type: ignore[arg-type]  # the session needs neither Redis nor keys
    session = driver.session()
    assert session.connector is not None and session.connector._keepalive_timeout < envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE
    assert session.headers["Authorization"] == "Bearer k"
    await driver.close()
