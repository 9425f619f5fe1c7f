"""Where a listening process binds, and the address it tells the others to use.

Every listening part of a run (Redis, the router, vLLM workers, trainer rank 0's process-group store, the
collective weight transport's store) has a bind host and an advertise host. Loopback is the default for both, so a run stays on one machine
unless the config says otherwise. `advertise_host = "auto"` advertises the bind host when it is one
address; for a wildcard bind (0.0.0.0, ::) it advertises the address of the interface that routes
toward the experiment's Redis, found with a connected UDP socket (the kernel picks the route; no packet
is sent). Redis itself has no Redis to route toward: with a wildcard bind it advertises the host's one
non-loopback address, and asks for an explicit advertise host when there are several.
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
from typing import TYPE_CHECKING

import aiohttp
import psutil

if TYPE_CHECKING:
    from torch.distributed import TCPStore

AUTO = "auto"
WILDCARDS = ("0.0.0.0", "::", "")


class AddressError(ValueError):
    """No address to advertise could be chosen; the message names the config field to set."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def is_wildcard(host: str) -> bool:
    return host in WILDCARDS


def route_source(toward: str) -> str:
    """The local address this host uses to reach `toward` (a connected UDP socket; nothing is sent)."""
    family = socket.AF_INET6 if ":" in toward else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        try:
            s.connect((toward, 9))
        except OSError as exc:
            raise AddressError(f"no route from this host to {toward} ({exc})") from None
        return str(s.getsockname()[0])


def host_addresses() -> list[str]:
    """This host's non-loopback IPv4 addresses, interface by interface."""
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not is_loopback(a.address):
                found.append(a.address)
    return found


def advertised(bind: str, advertise: str, toward: str | None, field: str) -> str:
    """The address to publish for a listener bound to `bind`. `toward` is the Redis host the readers of
    the address also reach (None for Redis itself); `field` names the advertise setting for errors."""
    if advertise != AUTO:
        return advertise
    if not is_wildcard(bind):
        return bind
    if toward is not None:
        return route_source(toward)
    found = host_addresses()
    if len(found) != 1:
        have = ", ".join(found) or "none"
        raise AddressError(
            f"{field} = 'auto' cannot choose an address for a wildcard bind: this host has {len(found)} "
            f"non-loopback IPv4 addresses ({have}); set {field} to the one the other hosts reach"
        )
    return found[0]


def url_host(host: str) -> str:
    """`host` as it goes into a URL (IPv6 literals in brackets)."""
    return f"[{host}]" if ":" in host else host


def free_port(host: str) -> int:
    """A TCP port free on `host` right now (the caller binds it soon after)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def refuses(host: str, port: int, timeout_s: float = 1.0) -> bool:
    """True when nothing listens at host:port (connection refused): proof that a server there is gone.
    A timeout or an unreachable network proves nothing and gives False."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False


def bearer(token: str) -> dict[str, str]:
    """The Authorization header carrying `token`; none when the token is empty."""
    return {"Authorization": f"Bearer {token}"} if token else {}


# vLLM's API server (uvicorn) closes a keep-alive connection idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE seconds (5 by
# default); aiohttp keeps idle connections 15 s, so a request sent on one the server is closing fails ("Can not
# write request body") and is retried with a warning. Clients of vLLM servers drop idle connections sooner.
VLLM_CLIENT_KEEPALIVE_S = 2.0


def vllm_session(token: str = "") -> aiohttp.ClientSession:
    """A client session for vLLM servers (carrying `token`): idle connections are dropped before vLLM drops them."""
    return aiohttp.ClientSession(
        headers=bearer(token), connector=aiohttp.TCPConnector(keepalive_timeout=VLLM_CLIENT_KEEPALIVE_S)
    )


def serve_store(host: str, port: int, world: int, timeout: datetime.timedelta) -> TCPStore:
    """A torch TCPStore server listening on `host` only (port 0: a free one; its `.port` says which). torch's
    store server binds every interface when it opens its own socket; handed a listening socket
    (`master_listen_fd`, libuv backend) it serves that one instead. OSError when `host` is not this machine's."""
    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(max(128, world))
    except OSError:
        sock.close()
        raise
    bound = int(sock.getsockname()[1])
    # torch owns the descriptor from here (detach: Python must not close it under the store).
    return dist.TCPStore(
        host, bound, world, is_master=True, timeout=timeout, wait_for_workers=False, master_listen_fd=sock.detach()
    )
