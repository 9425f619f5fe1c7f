"""Router benchmark (issue 3): the latency the router adds and the throughput it sustains, side by
side with the Rust vLLM router (PyPI `vllm-router`) in the same run. Two fake OpenAI backends
(tests/support/fake_openai.py) listen on loopback and register in a private Redis; the Slipstream router
runs as its role process (`ROLE=router python -m common.runs.cli run`), vllm-router with
`--policy round_robin` over the same two URLs, and ours with the same policy. The load generator is
a lean keep-alive HTTP/1.1 client on uvloop in this process, so that it, not the routers, costs as
little CPU as possible; everything shares one machine. Latency: one client, sequential requests,
p50/p99 against calling the backends directly. Throughput: N concurrent clients for a fixed time.
Targets are interleaved over several rounds (medians reported) so background load hits all alike.

    .venv/bin/python bench/router_bench.py [--rounds 3] [--seconds 4] [--clients 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import uvloop

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.keys import Keys  # noqa: E402
from common.rendezvous import Rendezvous  # noqa: E402
from tests.support.fake_openai import (  # noqa: E402
    Backend,
    start_backends,
    start_router_process,
    token,
    wait_published,
)

EXP = "bench"
BODY = json.dumps({"model": "policy", "prompt": "Say hello.", "max_tokens": 1}).encode()


# ----------------------------------------------------------------------------------------------
# Load generator: one keep-alive connection per client, a pre-built request, framing by
# Content-Length or the chunked terminator. Nothing else, so its CPU cost stays small and equal
# for every target.
# ----------------------------------------------------------------------------------------------


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.buf = bytearray()
        self.done: asyncio.Future[int] | None = None
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0 or self.done is None or self.done.done():
            return
        head = bytes(self.buf[:end]).lower()
        i = head.find(b"content-length:")
        if i >= 0:
            j = head.find(b"\r\n", i)
            length = int(head[i + 15 : j if j >= 0 else len(head)])
            complete = len(self.buf) >= end + 4 + length
        else:
            complete = self.buf.endswith(b"0\r\n\r\n")
        if complete:
            status = int(self.buf[9:12])
            self.buf.clear()
            self.done.set_result(status)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done is not None and not self.done.done():
            self.done.set_exception(ConnectionError(f"connection lost: {exc}"))


class Client:
    def __init__(self, url: str, token: str = "", path: str = "/v1/completions") -> None:
        self.host, port = url.removeprefix("http://").rsplit(":", 1)
        self.port = int(port)
        auth = f"Authorization: Bearer {token}\r\n" if token else ""
        self.request = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(BODY)}\r\n\r\n"
        ).encode() + BODY
        self.conn: _Conn | None = None

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        _, self.conn = await loop.create_connection(_Conn, self.host, self.port)
        self.conn.transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def call(self) -> int:
        assert self.conn is not None and self.conn.transport is not None
        self.conn.done = asyncio.get_running_loop().create_future()
        self.conn.transport.write(self.request)
        return await self.conn.done

    def close(self) -> None:
        if self.conn is not None and self.conn.transport is not None:
            self.conn.transport.close()


async def latencies(urls: list[str], n: int, token: str = "") -> list[float]:
    """Seconds per request of one client sending `n` requests one after another (alternating urls)."""
    clients = [Client(u, token) for u in urls]
    for c in clients:
        await c.connect()
    out = []
    try:
        for i in range(n):
            c = clients[i % len(clients)]
            t = time.perf_counter()
            status = await c.call()
            out.append(time.perf_counter() - t)
            if status != 200:
                raise RuntimeError(f"status {status} from {c.host}:{c.port}")
    finally:
        for c in clients:
            c.close()
    return out


async def throughput(urls: list[str], clients: int, seconds: float, token: str = "") -> tuple[float, int]:
    """Requests per second of `clients` concurrent clients over `seconds`, and the count of non-200s."""
    conns = [Client(urls[i % len(urls)], token) for i in range(clients)]
    await asyncio.gather(*(c.connect() for c in conns))
    counts = [0] * clients
    errors = 0
    deadline = time.perf_counter() + seconds

    async def loop(i: int) -> None:
        nonlocal errors
        c = conns[i]
        while time.perf_counter() < deadline:
            if await c.call() != 200:
                errors += 1
            counts[i] += 1

    start = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(clients)))
    elapsed = time.perf_counter() - start
    for c in conns:
        c.close()
    return sum(counts) / elapsed, errors


# ----------------------------------------------------------------------------------------------
# The routers under test
# ----------------------------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    urls: list[str]
    pid: int | None = None  # the router process, for its CPU time
    token: str = ""  # the bearer token it asks for (the Slipstream router: the run's generated one)
    lat: list[float] = field(default_factory=list)
    rps: list[float] = field(default_factory=list)
    cpu_us: list[float] = field(default_factory=list)
    errors: int = 0


def _wait_http(url: str, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return f"exited with code {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=1) as resp:
                if resp.status == 200:
                    return ""
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.1)
    return f"not answering {url} after {timeout_s:.0f} s ({last})"


def start_slipstream(tmp: Path, meet: Path) -> subprocess.Popen[str]:
    config = tmp / "router.toml"
    config.write_text(
        f'[run]\nname = "bench"\nroot = "{tmp / "runs"}"\nlog_level = "warning"\n'
        '[router]\npolicy = "round_robin"\nhealth_interval_s = 1.0\n'
    )
    return start_router_process(config, meet, EXP)


def start_vllm_router(backends: list[Backend], log: Path) -> tuple[subprocess.Popen[bytes] | None, str, str]:
    """(process, url, "") or (None, "", why it cannot run here)."""
    binary = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    if not Path(binary).exists():
        return None, "", "vllm-router is not installed: run `.venv/bin/pip install vllm-router`"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [binary, "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[b.url for b in backends]]
    cmd += ["--policy", "round_robin", "--log-level", "warning"]
    with log.open("wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    why = _wait_http(url + "/health", proc, 60)
    if why:
        proc.kill()
        proc.wait()
        return None, "", f"vllm-router {why}; its log ends: {log.read_text()[-500:]!r}"
    return proc, url, ""


def measure(target: Target, args: argparse.Namespace) -> None:
    proc = psutil.Process(target.pid) if target.pid else None
    lat = uvloop.run(latencies(target.urls, args.latency_requests, target.token))
    target.lat += lat[len(lat) // 10 :]  # the first tenth warms connections and caches
    cpu0 = sum(proc.cpu_times()[:2]) if proc else 0.0
    rps, errors = uvloop.run(throughput(target.urls, args.clients, args.seconds, target.token))
    if proc:
        target.cpu_us.append((sum(proc.cpu_times()[:2]) - cpu0) / (rps * args.seconds) * 1e6)
    target.rps.append(rps)
    target.errors += errors


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per target (medians reported)")
    parser.add_argument("--seconds", type=float, default=4.0, help="duration of one throughput measurement")
    parser.add_argument("--clients", type=int, default=64, help="concurrent clients of the throughput test")
    parser.add_argument("--latency-requests", type=int, default=2000, help="sequential requests per latency round")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="router-bench-") as tmp_name:
        tmp = Path(tmp_name)
        rz = Rendezvous(tmp / "meet")
        redis = rz.connect(timeout_s=10)
        backends = start_backends(["b0", "b1"], rz.meet, EXP, period_s=1.0, ttl_s=5.0)
        procs: list[subprocess.Popen] = []
        try:
            ours = start_slipstream(tmp, rz.meet)
            procs.append(ours)
            url = wait_published(ours, redis, Keys(EXP).router())
            deadline = time.monotonic() + 30
            while "2 healthy" not in _health(url):
                if time.monotonic() > deadline:
                    raise SystemExit(f"the Slipstream router at {url} did not admit both backends")
                time.sleep(0.1)
            targets = [
                Target("direct", [b.url for b in backends]),
                Target("slipstream", [url], ours.pid, token(rz.meet)["Authorization"].removeprefix("Bearer ")),
            ]
            vr, vr_url, vr_why = start_vllm_router(backends, tmp / "vllm-router.log")
            if vr is not None:
                procs.append(vr)
                targets.append(Target("vllm-router", [vr_url], vr.pid))
            for _ in range(args.rounds):
                for target in targets:
                    measure(target, args)
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=10)
            for b in backends:
                b.stop()
            rz.close()

    report(targets, args, vr_why)
    return 0


def _health(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/health", timeout=1) as resp:
            return f"{json.loads(resp.read())['healthy']} healthy"
    except (urllib.error.URLError, OSError):
        return ""


def report(targets: list[Target], args: argparse.Namespace, vr_why: str) -> None:
    direct = targets[0]
    d50, d99 = pct(direct.lat, 0.5) * 1e3, pct(direct.lat, 0.99) * 1e3
    print(
        f"\n{args.rounds} rounds; latency: 1 client, {args.latency_requests} sequential requests per round; "
        f"throughput: {args.clients} clients x {args.seconds:g} s per round (median of rounds)\n"
    )
    print("| target | p50 ms | p99 ms | added p50 ms | added p99 ms | req/s | router CPU us/req | non-200 |")
    print("|---|---|---|---|---|---|---|---|")
    for t in targets:
        p50, p99 = pct(t.lat, 0.5) * 1e3, pct(t.lat, 0.99) * 1e3
        added = "-" if t is direct else f"{p50 - d50:.3f}"
        added99 = "-" if t is direct else f"{p99 - d99:.3f}"
        cpu = f"{statistics.median(t.cpu_us):.0f}" if t.cpu_us else "-"
        print(
            f"| {t.name} | {p50:.3f} | {p99:.3f} | {added} | {added99} | {statistics.median(t.rps):.0f} "
            f"| {cpu} | {t.errors} |"
        )
    ours = targets[1]
    print()
    for t in targets:
        print(f"{t.name} req/s per round: {', '.join(f'{r:.0f}' for r in t.rps)}")
    print(f"slipstream added p50: {(pct(ours.lat, 0.5) * 1e3 - d50):.3f} ms (target <= 0.5 ms)")
    if len(targets) > 2:
        vr = targets[2]
        ratio = statistics.median(ours.rps) / statistics.median(vr.rps)
        print(f"throughput slipstream / vllm-router: {ratio:.2f} (target >= 0.8)")
        print(
            f"throughput slipstream / direct: {statistics.median(ours.rps) / statistics.median(direct.rps):.2f}; "
            f"vllm-router / direct: {statistics.median(vr.rps) / statistics.median(direct.rps):.2f}"
        )
    else:
        print(f"vllm-router not measured: {vr_why}")


if __name__ == "__main__":
    sys.exit(main())
