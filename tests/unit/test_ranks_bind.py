"""Rank 0's process-group store listens on the rank's advertised address only, and gloo/NCCL are pointed at that
address's interface (trainer/ranks.py); the other ranks' paths through it are tests/e2e/test_trainer_ranks.py's."""

from __future__ import annotations

import datetime
import os

import psutil
import pytest

from trainer.ranks import RankError, _serve_store, pin_socket_interface, torchrun_listen_host

TIMEOUT = datetime.timedelta(seconds=10)


def listening(port: int) -> set[str]:
    """The local addresses this process listens on at `port`."""
    me = psutil.Process(os.getpid())
    return {c.laddr.ip for c in me.net_connections("tcp") if c.status == psutil.CONN_LISTEN and c.laddr.port == port}


def test_rank_zeros_store_listens_on_its_address_only_and_serves():
    store = _serve_store("127.0.0.1", 0, 1, TIMEOUT, "trainer.parallel.store_advertise_host")
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert listening(store.port) == {"127.0.0.1"}  # torch's own server socket would be 0.0.0.0 / ::


def test_an_address_of_another_machine_is_refused_naming_the_setting():
    with pytest.raises(RankError, match=r"cannot listen on 192\.0\.2\.7:0 .*store_advertise_host must be an address"):
        _serve_store("192.0.2.7", 0, 1, TIMEOUT, "trainer.parallel.store_advertise_host")


def test_gloo_and_nccl_are_pointed_at_the_interface_of_the_address_unless_set():
    loopback = next(n for n, addrs in psutil.net_if_addrs().items() if any(a.address == "127.0.0.1" for a in addrs))
    env: dict[str, str] = {"NCCL_SOCKET_IFNAME": "ib0"}
    pin_socket_interface("127.0.0.1", env)
    assert env == {"GLOO_SOCKET_IFNAME": loopback, "NCCL_SOCKET_IFNAME": "ib0"}
    env = {}
    pin_socket_interface("192.0.2.7", env)  # not this machine's: left to gloo and NCCL, with a warning
    assert env == {}


def test_a_torchrun_rank_zero_listens_on_the_address_master_addr_names_when_it_names_one_of_its_own(caplog):
    assert torchrun_listen_host("127.0.0.1") == "127.0.0.1"
    assert torchrun_listen_host("localhost") in ("127.0.0.1", "::1")
    # Not this machine's, or not resolvable here: torch's own socket (every interface), said in a warning.
    assert torchrun_listen_host("192.0.2.7") is None
    assert torchrun_listen_host("no-such-host.invalid") is None
    assert "listens on every interface: MASTER_ADDR = 'no-such-host.invalid'" in caplog.text
