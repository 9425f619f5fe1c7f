"""Rank 0's process-group store listens on the rank's advertised address only, and gloo/NCCL are pointed at that
address's interface (trainer/ranks.py); the other ranks' paths through it are tests/e2e/test_trainer_ranks.py's.
The control group waits for rank 0's next command longer than the training collectives' timeout."""

from __future__ import annotations

import datetime
import os
import time

import psutil
import pytest
import torch
import torch.multiprocessing as mp

from trainer.ranks import RankError, RankInfo, _serve_store, form_group, pin_socket_interface, torchrun_listen_host

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


class _FileAddress:
    """The store address through a file (the launcher's ranks pass it through Redis): rank 1 connects only once
    rank 0's store listens."""

    def __init__(self, path: str) -> None:
        self.path = path

    def publish(self, addr: str) -> None:
        with open(self.path + ".tmp", "w") as f:
            f.write(addr)
        os.rename(self.path + ".tmp", self.path)

    def wait(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while not os.path.exists(self.path):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no store address in {self.path}")
            time.sleep(0.05)
        with open(self.path) as f:
            return f.read()


COLLECTIVE_S, COMMAND_S, IDLE_S = 4.0, 60.0, 7.0


def _command_after_a_long_wait(rank: int, path: str, out: str) -> None:
    ranks = form_group(
        RankInfo(rank, 2, rank, "launcher"),
        torch.device("cpu"),
        _FileAddress(path),
        COLLECTIVE_S,
        "127.0.0.1",
        COMMAND_S,
    )
    if rank == 0:
        time.sleep(IDLE_S)  # rank 0 waiting for rollouts, longer than the collectives' timeout
    got = ranks.broadcast({"command": "step"} if rank == 0 else None)
    with open(f"{out}.{rank}", "w") as f:
        f.write(repr(got))
    ranks.barrier()
    ranks.close()


def test_the_other_ranks_wait_for_rank_zeros_next_command_longer_than_the_collectives_timeout(tmp_path):
    """Rank 0 sends its next command after more than the gradient group's timeout: the control group waits
    trainer.parallel.command_timeout_s (a control group on the gradient group's timeout fails this)."""
    mp.spawn(_command_after_a_long_wait, args=(str(tmp_path / "store"), str(tmp_path / "got")), nprocs=2, join=True)
    assert (tmp_path / "got.1").read_text() == repr({"command": "step"})
