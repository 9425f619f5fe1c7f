"""The router's HTTP/1.1 client to its workers (router/upstream.py) against a raw loopback server
that sends exactly the bytes each test scripts: framing by Content-Length, chunked encoding (split
at awkward places, with extensions and trailers) and connection end, keep-alive reuse, interim
answers, malformed answers, broken connections, refused connections and cancellation."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from router.upstream import UpstreamError, UpstreamPool

pytestmark = pytest.mark.timeout(20)


class RawServer:
    """Answers each request read from a connection with the next scripted list of byte pieces."""

    def __init__(self, answers: list[list[bytes]]) -> None:
        self.answers = answers
        self.connections = 0
        self.requests: list[bytes] = []
        self.disconnected = asyncio.Event()
        self.url = ""

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while self.answers:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                self.requests.append(head + await reader.readexactly(length))
                for piece in self.answers.pop(0):
                    if piece == b"<close>":
                        writer.close()
                        return
                    writer.write(piece)
                    await writer.drain()
                    await asyncio.sleep(0.01)
            await reader.read()  # until the client closes
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            self.disconnected.set()
            writer.close()


@contextlib.asynccontextmanager
async def raw_server(answers: list[list[bytes]]) -> AsyncIterator[RawServer]:
    server = RawServer(answers)
    srv = await asyncio.start_server(server.handle, "127.0.0.1", 0)
    server.url = f"http://127.0.0.1:{srv.sockets[0].getsockname()[1]}"
    try:
        yield server
    finally:
        srv.close()


OK_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"


async def test_content_length_answers_reuse_one_connection():
    answers = [[OK_HEAD + b"Content-Length: 5\r\n\r\nhel", b"lo"], [OK_HEAD + b"Content-Length: 2\r\n\r\nok"]]
    async with raw_server(answers) as server:
        pool = UpstreamPool()
        for expected in (b"hello", b"ok"):
            resp = await pool.request(server.url, "POST", "/v1/completions", [("X-A", "1")], b'{"p": 1}')
            assert (resp.status, resp.content_length, await resp.read()) == (200, len(expected), expected)
            assert resp.headers == [("Content-Type", "application/json")]  # framing headers consumed
            resp.release()
        pool.close()
    assert server.connections == 1
    assert server.requests[0].startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"\r\nX-A: 1\r\nContent-Length: 8\r\n\r\n" in server.requests[0]


async def test_chunked_answer_is_decoded_across_awkward_splits():
    pieces = [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Type: text/event-stream\r\n\r\n",
        b"5;ext=1\r\nda",
        b"ta:\r",
        b"\n1",
        b"0\r\n" + b"x" * 16 + b"\r\n0\r\nTrailer-A: b\r\n",
        b"\r\n",
    ]
    async with raw_server([pieces, [OK_HEAD + b"Content-Length: 0\r\n\r\n"]]) as server:
        pool = UpstreamPool()
        resp = await pool.request(server.url, "POST", "/v1/completions", [], b"{}")
        assert resp.content_length is None
        got = [chunk async for chunk in _chunks(resp)]
        assert b"".join(got) == b"data:" + b"x" * 16 and len(got) > 1  # delivered as it came
        resp.release()
        again = await pool.request(server.url, "GET", "/v1/models", [], b"")
        assert await again.read() == b""
        again.release()
        pool.close()
    assert server.connections == 1
    assert b"Content-Length" not in server.requests[1]  # a GET without body carries none


async def _chunks(resp) -> AsyncIterator[bytes]:  # type: ignore[no-untyped-def]
    while chunk := await resp.read_chunk():
        yield chunk


async def test_connection_close_and_unframed_bodies_are_not_reused():
    answers = [
        [b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\na"],
        [b"HTTP/1.0 200 OK\r\n\r\nuntil the end", b"<close>"],
    ]
    async with raw_server(answers) as server:
        pool = UpstreamPool()
        resp = await pool.request(server.url, "POST", "/x", [], b"1")
        assert await resp.read() == b"a"
        resp.release()
        resp = await pool.request(server.url, "POST", "/x", [], b"2")
        assert await resp.read() == b"until the end"
        resp.release()
        pool.close()
    assert server.connections == 2


async def test_interim_100_continue_is_skipped():
    answers = [[b"HTTP/1.1 100 Continue\r\n\r\n", OK_HEAD + b"Content-Length: 2\r\n\r\nok"]]
    async with raw_server(answers) as server:
        pool = UpstreamPool()
        resp = await pool.request(server.url, "POST", "/x", [], b"1")
        assert (resp.status, await resp.read()) == (200, b"ok")
        resp.release()
        pool.close()


@pytest.mark.parametrize(
    ("pieces", "message"),
    [
        ([b"SPDY/3 200 OK\r\n\r\n"], "bad status line"),
        ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "bad header line"),
        ([b"<close>"], "closed before the response head"),
    ],
)
async def test_broken_answers_are_transport_errors(pieces, message):
    async with raw_server([pieces]) as server:
        pool = UpstreamPool()
        with pytest.raises(UpstreamError, match=message) as info:
            await pool.request(server.url, "POST", "/x", [], b"1")
        assert not info.value.connect_failed
        pool.close()


async def test_connection_lost_mid_body_raises_after_delivering_what_came():
    answers = [[OK_HEAD + b"Content-Length: 100\r\n\r\npartial", b"<close>"]]
    async with raw_server(answers) as server:
        pool = UpstreamPool()
        resp = await pool.request(server.url, "POST", "/x", [], b"1")
        assert await resp.read_chunk() == b"partial"
        with pytest.raises(UpstreamError, match="after 7 body bytes"):
            await resp.read_chunk()
        resp.close()
        pool.close()


async def test_refused_connection_is_a_connect_failure():
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = probe.sockets[0].getsockname()[1]
    probe.close()
    await probe.wait_closed()
    with pytest.raises(UpstreamError, match=f"cannot connect to 127.0.0.1:{port}") as info:
        await UpstreamPool().request(f"http://127.0.0.1:{port}", "POST", "/x", [], b"1")
    assert info.value.connect_failed


async def test_cancelling_a_request_closes_its_connection():
    async with raw_server([[]]) as server:  # reads the request, never answers
        pool = UpstreamPool()
        task = asyncio.create_task(pool.request(server.url, "POST", "/x", [], b"1"))
        while not server.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(server.disconnected.wait(), 2.0)
        pool.close()


async def test_a_large_answer_read_slowly_arrives_whole():
    body = bytes(range(256)) * 20_000  # 5 MB: reading pauses above the high-water mark and resumes
    answers = [[OK_HEAD + f"Content-Length: {len(body)}\r\n\r\n".encode() + body]]
    async with raw_server(answers) as server:
        pool = UpstreamPool()
        resp = await pool.request(server.url, "POST", "/x", [], b"1")
        await asyncio.sleep(0.2)
        assert await resp.read() == body
        resp.release()
        pool.close()


async def test_a_worker_mounted_under_a_path_gets_it_prefixed():
    async with raw_server([[OK_HEAD + b"Content-Length: 0\r\n\r\n"]]) as server:
        pool = UpstreamPool()
        resp = await pool.request(server.url + "/base", "POST", "/v1/completions?x=1", [], b"1")
        resp.release()
        pool.close()
    assert server.requests[0].startswith(b"POST /base/v1/completions?x=1 HTTP/1.1\r\n")
