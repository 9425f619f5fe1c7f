"""The router's HTTP/1.1 client for its hop to the workers: keep-alive connections pooled per worker,
one request at a time per connection, response bodies framed by Content-Length, chunked encoding
or the connection's end, and read either whole or piece by piece as they arrive (SSE). It exists
because this hop is the router's hot path: aiohttp's ClientSession spent about 140 us of CPU per
proxied request in bench/router_bench.py, four times what aiohttp's server side spends, while
this client does only what the hop needs. It adds no timeout except on connecting; a caller that
is cancelled closes the connection, which is how the worker learns that the client went away.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

MAX_HEAD_BYTES = 64 * 1024
# Reading from a worker pauses while this much of its answer waits for a slow client.
HIGH_WATER_BYTES = 1024 * 1024

_FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive"})
# Connection states.
_IDLE, _HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_CRLF, _TRAILERS, _UNTIL_CLOSE, _DONE = range(9)


class UpstreamError(Exception):
    """A transport-level failure talking to a worker: it could not be reached (`connect_failed`),
    the connection broke, or the answer was not valid HTTP/1.1."""

    def __init__(self, message: str, connect_failed: bool = False) -> None:
        super().__init__(message)
        self.connect_failed = connect_failed


class _Malformed(Exception):
    pass


@dataclass(frozen=True)
class _Target:
    host: str
    port: int
    tls: bool
    host_header: str
    prefix: str  # a path the worker is mounted under, usually empty


def _target(url: str) -> _Target:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"worker URL {url!r} must be http://host:port or https://host:port")
    tls = parts.scheme == "https"
    port = parts.port or (443 if tls else 80)
    return _Target(parts.hostname, port, tls, parts.netloc, parts.path.rstrip("/"))


def _parse_head(head: bytes) -> tuple[int, list[tuple[str, str]], int | None, bool, bool]:
    """Status line and headers -> (status, headers, content length, chunked, keep-alive). The framing
    headers (Content-Length, Transfer-Encoding, Connection, Keep-Alive) describe this connection only
    and are consumed here; the rest are returned as sent."""
    lines = head.decode("utf-8", "surrogateescape").split("\r\n")
    status_line = lines[0]
    if not status_line.startswith("HTTP/1.") or len(status_line) < 12:
        raise _Malformed(f"bad status line {status_line[:80]!r}")
    status = int(status_line[9:12])
    keep_alive = status_line[7] == "1"  # HTTP/1.1 keeps the connection unless told otherwise
    headers: list[tuple[str, str]] = []
    length: int | None = None
    chunked = False
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name[-1] in " \t":
            raise _Malformed(f"bad header line {line[:80]!r}")
        value = value.strip(" \t")
        lower = name.lower()
        if lower not in _FRAMING:
            headers.append((name, value))
        elif lower == "content-length":
            length = int(value)
        elif lower == "transfer-encoding":
            chunked = value.lower().endswith("chunked")
        elif lower == "connection":
            tokens = value.lower()
            keep_alive = "close" not in tokens and (keep_alive or "keep-alive" in tokens)
    if chunked:
        length = None  # RFC 9112 6.3: chunked framing wins over a Content-Length
    return status, headers, length, chunked, keep_alive


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one worker: parses what arrives and wakes the reader."""

    def __init__(self, target: _Target) -> None:
        self.target = target
        self.transport: asyncio.Transport | None = None
        self.state = _IDLE
        self.buf = bytearray()
        self.parts: list[bytes] = []
        self.buffered = 0
        self.remaining = 0
        self.received = 0
        self.keep_alive = True
        self.paused = False
        self.error: UpstreamError | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.head: tuple[int, list[tuple[str, str]], int | None] | None = None
        self.idle_since = 0.0

    # -- asyncio.Protocol ----------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.keep_alive = False
        if self.state == _UNTIL_CLOSE:
            self.state = _DONE
        elif self.state not in (_IDLE, _DONE) and self.error is None:
            where = "before the response head" if self.state == _HEAD else f"after {self.received} body bytes"
            self.error = UpstreamError(f"connection closed {where}" + (f" ({exc})" if exc else ""))
        self._wake()

    def data_received(self, data: bytes) -> None:
        if self.state in (_IDLE, _DONE):
            self.keep_alive = False  # bytes nobody asked for: this connection is not reusable
            return
        if self.state == _LENGTH and not self.buf:
            self._take_length(data)  # the common case, without copying into the buffer
        else:
            self.buf += data
            try:
                self._parse()
            except (_Malformed, ValueError) as exc:
                self.error = UpstreamError(f"invalid HTTP answer: {exc}")
                self.close()
        if self.buffered > HIGH_WATER_BYTES and self.transport is not None and not self.paused:
            self.paused = True
            self.transport.pause_reading()
        self._wake()

    # -- parsing -------------------------------------------------------------------------------

    def _parse(self) -> None:
        buf = self.buf
        while True:
            state = self.state
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise _Malformed(f"response head longer than {MAX_HEAD_BYTES} bytes")
                    return
                status, headers, length, chunked, keep_alive = _parse_head(bytes(buf[:end]))
                del buf[: end + 4]
                if 100 <= status < 200:
                    continue  # an interim answer (100 Continue): the real one follows
                self.head = (status, headers, length)
                self.keep_alive = keep_alive
                if status in (204, 304) or length == 0:
                    self.state = _DONE
                elif chunked:
                    self.state = _CHUNK_SIZE
                elif length is not None:
                    self.state, self.remaining = _LENGTH, length
                else:
                    self.state, self.keep_alive = _UNTIL_CLOSE, False
            elif state == _LENGTH:
                if buf:
                    data = bytes(buf)
                    buf.clear()
                    self._take_length(data)
                return
            elif state == _UNTIL_CLOSE:
                if buf:
                    self._body(bytes(buf))
                    buf.clear()
                return
            elif state == _CHUNK_SIZE or state == _TRAILERS:
                nl = buf.find(b"\r\n")
                if nl < 0:
                    if len(buf) > MAX_HEAD_BYTES:
                        raise _Malformed("chunk size line too long")
                    return
                line = bytes(buf[:nl])
                del buf[: nl + 2]
                if state == _TRAILERS:
                    if not line:
                        self._finish()
                        return
                    continue
                size = int(line.split(b";", 1)[0].strip(), 16)
                if size == 0:
                    self.state = _TRAILERS
                else:
                    self.state, self.remaining = _CHUNK_DATA, size
            elif state == _CHUNK_DATA:
                if not buf:
                    return
                n = min(len(buf), self.remaining)
                self._body(bytes(buf[:n]))
                del buf[:n]
                self.remaining -= n
                if self.remaining == 0:
                    self.state = _CHUNK_CRLF
            elif state == _CHUNK_CRLF:
                if len(buf) < 2:
                    return
                if buf[:2] != b"\r\n":
                    raise _Malformed("chunk not followed by CRLF")
                del buf[:2]
                self.state = _CHUNK_SIZE
            else:  # _DONE or _IDLE with bytes left over
                if buf:
                    self.keep_alive = False
                return

    def _take_length(self, data: bytes) -> None:
        n = self.remaining
        if len(data) > n:
            self.keep_alive = False  # more than the answer: never reuse this connection
            data = data[:n]
        self._body(data)
        self.remaining = n - len(data)
        if self.remaining == 0:
            self._finish()

    def _body(self, data: bytes) -> None:
        self.parts.append(data)
        self.buffered += len(data)
        self.received += len(data)

    def _finish(self) -> None:
        self.state = _DONE
        if self.buf:
            self.keep_alive = False

    def _wake(self) -> None:
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None

    # -- use -----------------------------------------------------------------------------------

    def send(self, data: bytes) -> None:
        assert self.transport is not None
        self.state, self.head, self.received, self.error = _HEAD, None, 0, None
        self.transport.write(data)

    @property
    def reusable(self) -> bool:
        return self.state == _DONE and self.keep_alive and self.transport is not None and not self.parts

    def close(self) -> None:
        self.keep_alive = False
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """A worker's answer: status and end-to-end headers now, the body through `read` or `read_chunk`. Call
    `release` after reading to the end (the connection goes back to the pool) or `close`."""

    __slots__ = ("status", "headers", "content_length", "_conn", "_pool")

    def __init__(self, conn: _Connection, pool: UpstreamPool) -> None:
        assert conn.head is not None
        self.status, self.headers, self.content_length = conn.head
        self._conn: _Connection | None = conn
        self._pool = pool

    async def read_chunk(self) -> bytes:
        """The body bytes that arrived since the last call, waiting for some; b"" at the end."""
        conn = self._conn
        assert conn is not None, "read after release/close"
        while not conn.parts:
            if conn.error is not None:
                raise conn.error
            if conn.state == _DONE:
                return b""
            await conn.wait()
        parts = conn.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        conn.buffered = 0
        if conn.paused and conn.transport is not None:
            conn.paused = False
            conn.transport.resume_reading()
        return data

    async def read(self) -> bytes:
        """The whole body."""
        pieces = []
        while chunk := await self.read_chunk():
            pieces.append(chunk)
        return pieces[0] if len(pieces) == 1 else b"".join(pieces)

    def release(self) -> None:
        """Give the connection back for reuse if the answer was read to its end, else close it."""
        conn, self._conn = self._conn, None
        if conn is not None:
            self._pool._put(conn)

    def close(self) -> None:
        """Drop the connection (the worker sees the disconnect and aborts the request)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()


class UpstreamPool:
    """Idle keep-alive connections per worker, and the one method that sends a request."""

    def __init__(self, connect_timeout_s: float = 5.0, keepalive_s: float = 4.0) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.keepalive_s = keepalive_s
        self._idle: dict[_Target, list[_Connection]] = {}
        self._targets: dict[str, _Target] = {}
        self._tls: ssl.SSLContext | None = None
        self._last_sweep = time.monotonic()

    async def request(
        self, base_url: str, method: str, path: str, headers: list[tuple[str, str]], body: bytes
    ) -> UpstreamResponse:
        """Send one request to the worker at `base_url` and wait for its response head (no timeout:
        generation takes as long as it takes). Raises UpstreamError on any transport failure."""
        target = self._targets.get(base_url)
        if target is None:
            target = self._targets[base_url] = _target(base_url)
        lines = [f"{method} {target.prefix}{path} HTTP/1.1\r\nHost: {target.host_header}\r\n"]
        lines += [f"{name}: {value}\r\n" for name, value in headers]
        if body or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body)}\r\n")
        lines.append("\r\n")
        data = "".join(lines).encode("utf-8", "surrogateescape") + body
        conn = self._get(target) or await self._connect(target)
        try:
            conn.send(data)
            while conn.head is None:
                if conn.error is not None:
                    raise conn.error
                await conn.wait()
        except BaseException:
            conn.close()  # cancelled or failed: the worker must see the disconnect
            raise
        return UpstreamResponse(conn, self)

    def _get(self, target: _Target) -> _Connection | None:
        idle = self._idle.get(target)
        deadline = time.monotonic() - self.keepalive_s
        while idle:
            conn = idle.pop()
            if conn.transport is not None and conn.keep_alive and conn.idle_since > deadline:
                return conn
            conn.close()
        return None

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if target.tls:
            tls = self._tls = self._tls or ssl.create_default_context()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(target), target.host, target.port, ssl=tls)
        except TimeoutError:
            raise UpstreamError(
                f"connecting to {target.host_header} took over {self.connect_timeout_s} s", connect_failed=True
            ) from None
        except OSError as exc:
            raise UpstreamError(f"cannot connect to {target.host_header}: {exc}", connect_failed=True) from None
        return conn

    def _put(self, conn: _Connection) -> None:
        if not conn.reusable:
            conn.close()
            return
        now = time.monotonic()
        conn.state, conn.idle_since = _IDLE, now
        self._idle.setdefault(conn.target, []).append(conn)
        if now - self._last_sweep > self.keepalive_s:
            self._sweep(now)

    def _sweep(self, now: float) -> None:
        """Close connections idle past the keep-alive (so vanished workers hold no sockets)."""
        self._last_sweep = now
        deadline = now - self.keepalive_s
        for target, idle in list(self._idle.items()):
            keep = []
            for conn in idle:
                if conn.idle_since > deadline and conn.transport is not None:
                    keep.append(conn)
                else:
                    conn.close()
            if keep:
                self._idle[target] = keep
            else:
                del self._idle[target]

    def close(self) -> None:
        """Close every idle connection (connections in use close when their request ends)."""
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()
