"""Forwarding one client request to a worker: the router's hot path. It reads the body once (so it can
be sent again), picks a worker with the policy, relays the answer (buffered when the worker sent a
Content-Length, chunk by chunk otherwise, e.g. SSE), and retries at once on a different worker only
while no byte has reached the client and only after a transport error or an answer common.http calls
retryable (408/425/429/5xx). It adds no timeout to a generation (only connecting is bounded); a
client that disconnects cancels the handler and with it the upstream request. A worker removed from
the pool (its heartbeat expired) whose server fails a health check too gives up the requests still
waiting for its answer; they are retried elsewhere. Bodies are never parsed, except to find an
affinity key that the client put in the body instead of the header.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

from aiohttp import web
from multidict import CIMultiDict

from common.config import RouterConfig
from common.http import WORKER_HEADER, RetryPolicy, retryable_status
from common.net import bearer
from router.metrics import Metrics
from router.policy import Policy
from router.pool import PoolSync, Worker, WorkerPool
from router.upstream import UpstreamError, UpstreamPool

log = logging.getLogger(__name__)

BODY_AFFINITY_FIELD = "slipstream_group"
_BODY_AFFINITY_NEEDLE = f'"{BODY_AFFINITY_FIELD}"'.encode()
# Hop-by-hop headers (RFC 9110 7.6.1) belong to one connection; Host and Content-Length are rewritten.
HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
# The router's own server writes Server and Date; the worker's would be duplicates.
_RESPONSE_DROP = HOP_BY_HOP | {"server", "date"}


def error_body(message: str, kind: str, code: int) -> bytes:
    """An OpenAI-style error object, so OpenAI clients surface the message."""
    return json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}}).encode()


def json_error(status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=error_body(message, kind, status), content_type="application/json", headers=headers
    )


def body_affinity_key(body: bytes) -> str | None:
    """The `slipstream_group` field of a JSON body, or None. The byte search first keeps the JSON
    parse off every request that does not carry the field."""
    if _BODY_AFFINITY_NEEDLE not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None  # forwarded unchanged: the worker answers a malformed body with its own 400
    if not isinstance(data, dict) or data.get(BODY_AFFINITY_FIELD) is None:
        return None
    return str(data[BODY_AFFINITY_FIELD])


@dataclass
class Failure:
    """Why one attempt did not produce a response: a transport error, or a retryable worker answer
    (kept whole, so it is returned unchanged when no other worker is left to try)."""

    worker: Worker
    reason: str
    status: int = 0
    headers: list[tuple[str, str]] | None = None
    body: bytes = b""

    def response(self, attempts: int) -> web.Response:
        if self.status:
            return web.Response(status=self.status, body=self.body, headers=CIMultiDict(self.headers or ()))
        return json_error(
            502,
            f"worker {self.worker.id} at {self.worker.url} failed: {self.reason} ({attempts} attempt(s); see /workers)",
            "bad_gateway",
        )


class Proxy:
    """The request handler of every proxied route."""

    def __init__(
        self,
        cfg: RouterConfig,
        pool: WorkerPool,
        upstream: UpstreamPool,
        metrics: Metrics,
        sync: PoolSync | None = None,
        worker_api_key: str = "",
    ) -> None:
        self.pool, self.upstream, self.metrics, self.sync = pool, upstream, metrics, sync
        self.policy = Policy(cfg.policy, cfg.affinity_overload_factor)
        # Another worker is tried at once: the router uses the policy's count and statuses, never its delay.
        self.retry = RetryPolicy(max_retries=cfg.max_retries)
        self.max_body_bytes = cfg.max_body_bytes
        self.affinity_header = cfg.affinity_header if cfg.policy == "affinity" else ""
        # The router answered any Expect: 100-continue itself; its bearer token is for it alone, and the
        # workers' token (rollout.api_key) replaces whatever the client sent.
        drop = HOP_BY_HOP | {"expect"}
        self.drop_request_headers = drop | {"authorization"} if cfg.auth_token or worker_api_key else drop
        self.worker_headers = list(bearer(worker_api_key).items())

    async def handle(self, request: web.Request) -> web.StreamResponse:
        started = time.perf_counter()
        route = request.path
        status = 500
        try:
            response = await self._handle(request)
            status = response.status
            return response
        except (asyncio.CancelledError, ConnectionError):
            status = 499  # nginx's "client closed request"
            self.metrics.error("client_disconnect")
            raise
        finally:
            self.metrics.observe(route, status, time.perf_counter() - started)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        if request.content_length is not None and request.content_length > self.max_body_bytes:
            return self._too_large(request.content_length)
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:
            return self._too_large(None)  # a chunked body: its size is unknown beyond the limit
        key = None
        if self.affinity_header:
            key = request.headers.get(self.affinity_header)
            if key is None and body:
                key = body_affinity_key(body)
        drop = self.drop_request_headers
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in drop] + self.worker_headers
        url_path = request.raw_path  # path and query string, exactly as the client sent them

        tried: list[Worker] = []
        failure: Failure | None = None
        for attempt in range(self.retry.max_retries + 1):
            candidates = self.pool.healthy
            if tried:
                candidates = tuple(w for w in candidates if w not in tried)
            worker = self.policy.choose(candidates, key)
            if worker is None:
                break
            if attempt:
                self.metrics.retries += 1
            tried.append(worker)
            worker.outstanding += 1
            worker.requests += 1
            attempt_task = asyncio.ensure_future(self._attempt(request, worker, url_path, headers, body))
            worker.attempts.add(attempt_task)
            try:
                result = await attempt_task
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if not worker.gone or (current is not None and current.cancelling()):
                    raise  # the client went away (or the router stops): not a worker failure
                self.metrics.error("worker_gone")
                result = Failure(worker, f"the worker left the pool while answering ({worker.gone})")
            finally:
                worker.attempts.discard(attempt_task)
                worker.outstanding -= 1
            if not isinstance(result, Failure):
                return result
            failure = result
            log.info("attempt %d at worker %s failed: %s", attempt + 1, worker.id, result.reason)
        if failure is not None:
            return failure.response(len(tried))
        self.metrics.error("no_worker")
        known = len(self.pool.workers)
        return json_error(
            503,
            f"no healthy worker: {known} registered, none passing health checks (see /workers); "
            "start rollout workers or wait for them to become healthy",
            "service_unavailable",
            headers={"Retry-After": "1"},
        )

    def _too_large(self, size: int | None) -> web.Response:
        self.metrics.error("body_too_large")
        what = f"request body of {size} bytes" if size is not None else "request body"
        return json_error(
            413,
            f"{what} exceeds router.max_body_bytes = {self.max_body_bytes}; send less or raise the limit",
            "request_too_large",
        )

    async def _attempt(
        self, request: web.Request, worker: Worker, url_path: str, headers: list[tuple[str, str]], body: bytes
    ) -> web.StreamResponse | Failure:
        """One try at one worker: a response already sent or ready to send, or a Failure to retry."""
        try:
            upstream = await self.upstream.request(worker.url, request.method, url_path, headers, body)
        except UpstreamError as exc:
            self.metrics.error("transport")
            if exc.connect_failed and self.sync is not None:
                # Nothing answers there: stop routing to it now rather than at the next health round.
                await self.sync.verdict(worker, False, str(exc))
            else:
                worker.last_error = str(exc)
            return Failure(worker, str(exc))
        done = False
        try:
            status = upstream.status
            response_headers = [(k, v) for k, v in upstream.headers if k.lower() not in _RESPONSE_DROP]
            response_headers.append((WORKER_HEADER, worker.id))
            try:
                if retryable_status(status) or upstream.content_length is not None:
                    data = await upstream.read()
                else:
                    # Wait for the first chunk before answering: until then a failure can still be retried.
                    data = await upstream.read_chunk()
            except UpstreamError as exc:
                self.metrics.error("transport")
                worker.last_error = f"reading the answer: {exc}"
                return Failure(worker, worker.last_error)
            if retryable_status(status):
                self.metrics.error("upstream_status")
                worker.last_error = f"answered {status}"
                done = True
                return Failure(worker, f"answered {status}", status, response_headers, data)
            if upstream.content_length is not None:
                done = True
                return web.Response(status=status, body=data, headers=response_headers)  # type: ignore[arg-type]
            # Streaming from here on: bytes reach the client, so nothing below is retried (nor abandoned: a
            # worker that dies mid-stream ends it with a transport error).
            current = asyncio.current_task()
            if current is not None:
                worker.attempts.discard(current)
            response = web.StreamResponse(status=status, headers=response_headers)  # type: ignore[arg-type]
            await response.prepare(request)
            chunk = data
            while chunk:
                await response.write(chunk)
                try:
                    chunk = await upstream.read_chunk()
                except UpstreamError as exc:
                    self.metrics.error("stream_broken")
                    worker.last_error = f"failed mid-stream: {exc}"
                    log.warning("worker %s at %s %s; cutting the client connection", worker.id, worker.url, exc)
                    # A cut connection shows the client an error; a clean end would pass for a short answer.
                    if request.transport is not None:
                        request.transport.close()
                    return response
            await response.write_eof()
            done = True
            return response
        finally:
            if done:
                upstream.release()
            else:
                upstream.close()  # drops the connection, which is what tells the worker to abort
