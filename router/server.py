"""The router's HTTP layer and lifecycle. `make_app` builds the aiohttp application (the proxied
OpenAI and vLLM routes, /health, /workers, /metrics, bearer-token auth, the body-size limit, and
OpenAI-style JSON errors for unknown paths and wrong methods) over a WorkerPool; `Router` runs it: one
ClientSession, the pool kept in step with Redis, the listening socket, and the router's URL published
under `Keys.router(name)` with a heartbeat. The name is
claimed with SET NX, so a second router of the same name refuses to start, naming the running one.
`main` is the `ROLE=router slipstream run CFG` entry point.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import os
import urllib.parse
from collections.abc import Awaitable, Callable

import aiohttp
import redis.asyncio
from aiohttp import web
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from common.config import RouterConfig
from common.heartbeat import Heartbeat
from common.keys import Keys
from common.metric_sinks import open_metrics
from common.net import AddressError, advertised, bearer, is_loopback, refuses, url_host
from common.redis_client import text
from common.roles import RunContext
from common.run_secrets import read_secrets
from router.metrics import Metrics
from router.pool import PoolSync, WorkerPool
from router.proxy import Proxy, json_error
from router.telemetry import Telemetry, Writer, telemetry_origin
from router.upstream import UpstreamPool

log = logging.getLogger(__name__)

# Routes forwarded to the workers: the OpenAI API subset vLLM serves, and vLLM's token-in route.
PROXIED_ROUTES = (
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("POST", "/inference/v1/generate"),
)
# Bounds only the TCP connect to a worker (a dead host can swallow SYNs for minutes); generation
# itself gets no router timeout.
CONNECT_TIMEOUT_S = 5.0
# Below the 5 s keep-alive of vLLM's uvicorn server, so the router never reuses a connection the
# worker is about to close.
UPSTREAM_KEEPALIVE_S = 4.0
# In-flight requests get this long to finish when the router stops. aiohttp waits up to this long for a
# handler, cancels it and waits up to this long again, so a request no worker answers holds the stop for
# twice this: it must fit in the launcher's SIGTERM grace (launch.stop_timeout_s / 2, 5 s by default).
SHUTDOWN_GRACE_S = 2.0

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class RouterError(RuntimeError):
    """The router cannot start: its name is taken, or its address needs a token; the message says which."""


_DELETE_IF_EQUAL = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


async def _dead(url: str) -> bool:
    """True when nothing listens at the URL's address any more (connection refused)."""
    parsed = urllib.parse.urlsplit(url)
    if parsed.hostname is None or parsed.port is None:
        return False
    return await asyncio.to_thread(refuses, parsed.hostname, parsed.port, CONNECT_TIMEOUT_S)


@web.middleware
async def json_routing_errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """An unknown path (404) or a wrong method (405) answered as an OpenAI-style JSON error, like every
    other error of the router, so OpenAI clients show the message instead of failing to parse text."""
    try:
        return await handler(request)
    except web.HTTPMethodNotAllowed as exc:
        allowed = ", ".join(sorted(exc.allowed_methods))
        return json_error(
            405,
            f"{request.method} {request.path} is not allowed; use {allowed}",
            "method_not_allowed",
            headers={"Allow": allowed},
        )
    except web.HTTPNotFound:
        served = sorted(
            {
                f"{r.method} {r.resource.canonical}"
                for r in request.app.router.routes()
                if r.method != "HEAD" and r.resource is not None
            }
        )
        return json_error(
            404, f"no route {request.method} {request.path}; the router serves {', '.join(served)}", "not_found"
        )


def make_app(
    cfg: RouterConfig,
    pool: WorkerPool,
    upstream: UpstreamPool,
    metrics: Metrics | None = None,
    sync: PoolSync | None = None,
    worker_api_key: str = "",
) -> web.Application:
    """The router's aiohttp application over `pool`, forwarding through `upstream` (with
    `worker_api_key` as the workers' bearer token when set)."""
    if not is_loopback(cfg.bind_host) and not cfg.auth_token:
        raise RouterError(
            f"router.bind_host = {cfg.bind_host!r} is not loopback: set router.auth_token (or bind 127.0.0.1)"
        )
    metrics = metrics or Metrics()
    proxy = Proxy(cfg, pool, upstream, metrics, sync, worker_api_key)
    expected = f"Bearer {cfg.auth_token}".encode()

    def guarded(handler: Handler) -> Handler:
        if not cfg.auth_token:
            return handler

        async def check(request: web.Request) -> web.StreamResponse:
            given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(given, expected):
                metrics.error("unauthorized")
                return json_error(
                    401,
                    "missing or wrong bearer token: send 'Authorization: Bearer <router.auth_token>'",
                    "unauthorized",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return await handler(request)

        return check

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "workers": len(pool.workers), "healthy": len(pool.healthy)})

    async def workers(request: web.Request) -> web.Response:
        listed = [w.as_json() for _, w in sorted(pool.workers.items())]
        return web.json_response({"router": cfg.name, "policy": cfg.policy, "workers": listed})

    async def prometheus(request: web.Request) -> web.Response:
        page = metrics.render(pool.workers.values()).encode()
        return web.Response(body=page, headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    app = web.Application(client_max_size=cfg.max_body_bytes, middlewares=[json_routing_errors])
    for method, path in PROXIED_ROUTES:
        app.router.add_route(method, path, guarded(proxy.handle))
    app.router.add_get("/health", health)  # open, for liveness probes; it reveals only counts
    app.router.add_get("/workers", guarded(workers))
    app.router.add_get("/metrics", guarded(prometheus))
    return app


class Router:
    """A running router: serve, keep the pool in step, hold the name in Redis. Use as `async with`."""

    def __init__(
        self,
        cfg: RouterConfig,
        client: redis.asyncio.Redis,
        keys: Keys,
        heartbeat_period_s: float = 2.0,
        heartbeat_ttl_s: float = 10.0,
        redis_host: str = "127.0.0.1",
        worker_api_key: str = "",
        telemetry_writer: Writer | None = None,
        telemetry_origin: float | None = None,
    ) -> None:
        """`telemetry_writer`: where the per-period telemetry goes (router/telemetry.py), from `telemetry_origin`
        (its step 0, wall-clock); None = not stored."""
        self.cfg, self.client, self.keys = cfg, client, keys
        self.telemetry_writer, self.telemetry_origin = telemetry_writer, telemetry_origin
        self._telemetry: Telemetry | None = None
        self.redis_host, self.worker_api_key = redis_host, worker_api_key
        self.heartbeat_period_s, self.heartbeat_ttl_s = heartbeat_period_s, heartbeat_ttl_s
        self.pool = WorkerPool()
        self.metrics = Metrics()
        self.url = ""
        self._session: aiohttp.ClientSession | None = None  # health checks only; requests go through _upstream
        self._upstream: UpstreamPool | None = None
        self._sync: PoolSync | None = None
        self._runner: web.AppRunner | None = None
        self._heartbeat: Heartbeat | None = None

    async def start(self) -> str:
        """Bind, load the pool, claim the name in Redis and return the published URL."""
        cfg = self.cfg
        try:
            # Health checks and the telemetry's /metrics scrapes: idle connections dropped before vLLM drops them.
            self._session = aiohttp.ClientSession(
                cookie_jar=aiohttp.DummyCookieJar(),
                headers=bearer(self.worker_api_key),
                connector=aiohttp.TCPConnector(keepalive_timeout=UPSTREAM_KEEPALIVE_S),
            )
            self._upstream = UpstreamPool(CONNECT_TIMEOUT_S, UPSTREAM_KEEPALIVE_S)
            self._sync = PoolSync(
                self.pool, self.client, self.keys, self._session, cfg.health_interval_s, cfg.health_timeout_s
            )
            app = make_app(cfg, self.pool, self._upstream, self.metrics, self._sync, self.worker_api_key)
            # handler_cancellation: a client that disconnects cancels its handler, and so the upstream request.
            self._runner = web.AppRunner(
                app, access_log=None, handler_cancellation=True, shutdown_timeout=SHUTDOWN_GRACE_S
            )
            await self._runner.setup()
            site = web.TCPSite(self._runner, cfg.bind_host, cfg.port, backlog=1024)
            await site.start()
            try:
                host = advertised(cfg.bind_host, cfg.advertise_host, self.redis_host, "router.advertise_host")
            except AddressError as exc:
                raise RouterError(str(exc)) from None
            self.url = f"http://{url_host(host)}:{self._runner.addresses[0][1]}"
            await self._sync.start()
            if self.telemetry_writer is not None and cfg.telemetry_period_s > 0:
                self._telemetry = Telemetry(
                    self.metrics,
                    self.pool,
                    self._session,
                    self.telemetry_writer,
                    cfg.telemetry_period_s,
                    cfg.health_timeout_s,
                    self.telemetry_origin,
                )
                await self._telemetry.start()
            await self._claim_name()
        except BaseException:
            await self.stop()
            raise
        log.info(
            "router %r serving at %s (policy %s, %d of %d workers routable)",
            cfg.name,
            self.url,
            cfg.policy,
            len(self.pool.healthy),
            len(self.pool.workers),
        )
        return self.url

    async def _claim_name(self) -> None:
        """Claim the router's name (its URL under Keys.router(name)). A holder whose address refuses
        connections is provably dead (a router killed moments ago and restarted, whose key has not
        expired yet): its claim is taken over at once. A live holder makes this router refuse to start."""
        key = self.keys.router(self.cfg.name)
        ttl_ms = int(self.heartbeat_ttl_s * 1000)
        for _ in range(3):  # the holder's key may expire or be replaced between our SET NX and our GET
            if await self.client.set(key, self.url, nx=True, px=ttl_ms):
                self._heartbeat = Heartbeat(self.client, key, self.url, self.heartbeat_period_s, self.heartbeat_ttl_s)
                await self._heartbeat.start()
                return
            holder = text(raw) if (raw := await self.client.get(key)) is not None else None
            if holder is not None and holder != self.url and await _dead(holder):
                # Compare-and-delete: a router that claimed the name meanwhile keeps it.
                if await self.client.eval(_DELETE_IF_EQUAL, 1, key, holder):
                    log.warning(
                        "router %r: the previous holder at %s refuses connections (dead); taking over its name",
                        self.cfg.name,
                        holder,
                    )
                continue
            if holder is not None:
                raise RouterError(
                    f"router {self.cfg.name!r} of experiment {self.keys.exp} is already running at {holder} "
                    f"(Redis key {key}); stop it, or give this router another router.name"
                )
        raise RouterError(f"could not claim Redis key {key} for router {self.cfg.name!r}; try again")

    async def stop(self) -> None:
        """Withdraw the URL, stop serving (in-flight requests get a short grace), release everything."""
        heartbeat, self._heartbeat = self._heartbeat, None
        telemetry, self._telemetry = self._telemetry, None
        runner, self._runner = self._runner, None
        sync, self._sync = self._sync, None
        session, self._session = self._session, None
        upstream, self._upstream = self._upstream, None
        try:
            if telemetry is not None:
                await telemetry.stop()
            if heartbeat is not None:
                await heartbeat.stop()
            if runner is not None:
                await runner.cleanup()
        finally:
            if sync is not None:
                await sync.stop()
            if session is not None:
                await session.close()
            if upstream is not None:
                upstream.close()

    async def __aenter__(self) -> Router:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


async def main(ctx: RunContext) -> int:
    """`ROLE=router slipstream run CFG`: serve until SIGTERM/SIGINT cancels this task."""
    rz = ctx.cfg.rendezvous
    client = ctx.async_redis()
    assert ctx.rendezvous.info is not None
    replica = int(os.environ.get("SLIPSTREAM_REPLICA", "0") or 0)
    stored = ctx.cfg.router.telemetry_period_s > 0
    metrics = open_metrics(ctx.cfg, ctx.run_dir, ctx.exp, "router", replica) if stored else None
    router = Router(
        ctx.cfg.router,
        client,
        ctx.keys,
        rz.heartbeat_period_s,
        rz.heartbeat_ttl_s,
        ctx.rendezvous.info.host,
        ctx.cfg.rollout.api_key,
        metrics,
        telemetry_origin(ctx.run_dir, replica) if stored else None,
    )
    try:
        try:
            await router.start()
        except RouterError as exc:
            log.error("%s", exc)
            return 2
        generated = read_secrets(ctx.meet_dir)
        log.info(
            "clients send 'Authorization: Bearer <token>' on every route but /health; %s",
            f"`slipstream token {ctx.meet_dir}` prints it"
            if generated is not None and ctx.cfg.router.auth_token == generated.router
            else "the token is router.auth_token",
        )
        try:
            await asyncio.get_running_loop().create_future()  # serve until cancelled
        finally:
            await router.stop()
    finally:
        await client.aclose()
        if metrics is not None:
            metrics.close()
    return 0
