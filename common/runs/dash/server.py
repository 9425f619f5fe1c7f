"""The dashboard's HTTP layer: a thin aiohttp app over common/runs/dash/sources.py (reads) and panels.py
(drawing). Loopback by default; any other bind needs a token, accepted once as `Authorization: Bearer`
or `?token=` and then from a cookie. Blocking reads (SQLite, DuckDB, Redis) run in threads, and the
panels of a run are cached until one of its metrics files changes, so a page polling every 2 s costs a
stat() per file while nothing is written.

`start_in_thread` runs the server beside other work (the launcher, a test); `serve` is the CLI's."""

from __future__ import annotations

import asyncio
import hmac
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from common.net import is_loopback
from common.runs.dash import views
from common.runs.dash.panels import Panel, build_panels, drawn_tags, flow_counters
from common.runs.dash.sources import (
    DashError,
    LiveState,
    Run,
    RunSource,
    config_diff,
    flow_summary_signature,
    read_flow_summary,
    read_live,
    series_cache,
)

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
COOKIE = "slipstream_dash"
# Redis answers within sources.REDIS_TIMEOUT_S or is reported gone; this bounds the whole read.
LIVE_TIMEOUT_S = 2.0


def check_bind(host: str, token: str | None) -> None:
    """A dashboard reachable from other machines shows configs and worker URLs: it needs a token."""
    if not is_loopback(host) and not token:
        raise DashError(
            f"binding the dashboard to {host!r} (beyond loopback) needs a token: pass --token T (then open the URL "
            "with ?token=T once), or bind --host 127.0.0.1 and use an SSH tunnel"
        )


def dash_url(host: str, port: int, token: str | None = None, path: str = "/") -> str:
    """The URL to open; it carries the token, which the browser then keeps as a cookie."""
    shown = "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}{path}" + (f"?token={quote(token)}" if token else "")


class _Series:
    """One run's SeriesCache and the lock that serialises its page loads (they run in threads)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir, self.cache, self.lock = run_dir, series_cache(run_dir), threading.Lock()
        self.generation = 0  # updates that read new points


@dataclass
class _Cached:
    signature: str  # of the points read and flow_summary.json
    panels: list[Panel]
    extras: str
    series: dict[str, list[list[float]]]


def _auth_middleware(token: str) -> Callable:
    @web.middleware
    async def auth(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        header = request.headers.get("Authorization", "")
        offered = [
            header.removeprefix("Bearer ") if header.startswith("Bearer ") else None,
            request.query.get("token"),
            request.cookies.get(COOKIE),
        ]
        if not any(o is not None and hmac.compare_digest(o.encode(), token.encode()) for o in offered):
            raise web.HTTPUnauthorized(
                text="401: this dashboard needs its token: open the URL with ?token=T once, or send "
                "'Authorization: Bearer T'",
                headers={"WWW-Authenticate": "Bearer"},
            )
        response = await handler(request)
        if request.cookies.get(COOKIE) != token:
            response.set_cookie(COOKIE, token, httponly=True, samesite="Strict")
        return response

    return auth


class Dashboard:
    """Handlers over one RunSource."""

    def __init__(self, source: RunSource) -> None:
        self.source = source
        self._cache: dict[str, _Cached] = {}
        self._series: dict[str, _Series] = {}
        self._started = time.time_ns()

    async def _run(self, run_id: str) -> Run:
        try:
            return await asyncio.to_thread(self.source.run, run_id)
        except KeyError as exc:
            raise web.HTTPNotFound(text=f"404: {exc.args[0]}; the runs are listed at /") from None

    def _panels(self, run: Run) -> _Cached:
        source = self._series.get(run.id)
        if source is None or source.run_dir != run.run_dir:
            source = self._series[run.id] = _Series(run.run_dir)
        with source.lock:  # page loads of one run share its cache: one reads and draws, the others wait for it
            if source.cache.update():  # with a backlog pending, the page's next poll reads it
                source.generation += 1
            # What the page polls with: new points, a new flow summary or a restarted dashboard change it.
            signature = f"{self._started}.{source.generation}.{flow_summary_signature(run.run_dir)}"
            cached = self._cache.get(run.id)
            if cached is not None and cached.signature == signature:
                return cached
            series = source.cache.series()
            try:
                summary, problem = read_flow_summary(run.run_dir), ""
            except DashError as exc:  # caught mid-write (the trainer writes it in place): the next change redraws it
                summary, problem = None, str(exc)
            panels = build_panels(series, summary, problem)
            undrawn = sorted(t for t in series if t not in drawn_tags(panels) and not t.startswith("flow/"))
            extras = views.counters_html(flow_counters(series), undrawn)
            raw = {tag: [[step, p.value] for step, p in points.items()] for tag, points in series.items()}
            cached = self._cache[run.id] = _Cached(signature, panels, extras, raw)
            return cached

    async def _live(self, run: Run) -> LiveState:
        try:
            return await asyncio.wait_for(asyncio.to_thread(read_live, run.id, run.meet_dir), LIVE_TIMEOUT_S)
        except TimeoutError:
            return LiveState(False, f"Redis did not answer within {LIVE_TIMEOUT_S}s")

    async def runs_page(self, request: web.Request) -> web.Response:
        runs = await asyncio.to_thread(self.source.runs)
        return web.Response(text=views.runs_page(runs, str(self.source.path)), content_type="text/html")

    async def runs_json(self, request: web.Request) -> web.Response:
        runs = await asyncio.to_thread(self.source.runs)
        return web.json_response(
            [{k: str(v) if isinstance(v, Path) else v for k, v in asdict(r).items()} for r in runs]
        )

    async def diff(self, request: web.Request) -> web.Response:
        missing = [k for k in ("a", "b") if k not in request.query]
        if missing:
            raise web.HTTPBadRequest(text=f"400: name both runs: /diff?a=RUN&b=OTHER (missing {', '.join(missing)})")
        a, b = await self._run(request.query["a"]), await self._run(request.query["b"])
        try:
            rows = await asyncio.to_thread(config_diff, a, b)
        except DashError as exc:
            raise web.HTTPUnprocessableEntity(text=f"422: {exc}") from None
        if request.path.startswith("/api/"):
            return web.json_response([[p, repr(va), repr(vb)] for p, va, vb in rows])
        return web.Response(text=views.diff_page(a, b, rows), content_type="text/html")

    async def run_page(self, request: web.Request) -> web.Response:
        run = await self._run(request.match_info["run"])
        cached, live = await asyncio.gather(asyncio.to_thread(self._panels, run), self._live(run))
        html = views.run_page(run, cached.panels, cached.signature, live, cached.extras)
        return web.Response(text=html, content_type="text/html")

    async def series(self, request: web.Request) -> web.Response:
        """Every tag's points as drawn: [[step, value], ...] (a step's newest point)."""
        run = await self._run(request.match_info["run"])
        return web.json_response((await asyncio.to_thread(self._panels, run)).series)

    async def panels(self, request: web.Request) -> web.Response:
        """What the run page polls: its panels unless `seen` is their current signature, and the live state."""
        run = await self._run(request.match_info["run"])
        cached, live = await asyncio.gather(asyncio.to_thread(self._panels, run), self._live(run))
        body: dict[str, object] = {
            "signature": cached.signature,
            "live": views.live_html(live),
            "running": live.running,
        }
        if request.query.get("seen") != cached.signature:
            body["panels"] = [{"id": p.id, "html": views.panel_html(p)} for p in cached.panels]
            body["extras"] = cached.extras
        return web.json_response(body)


def _prometheus(registry: CollectorRegistry) -> tuple[Callable, Callable[[web.Request], Awaitable[web.Response]]]:
    """A middleware that counts every request (by route pattern and status) and times it, and the /metrics
    handler that exposes them (Prometheus text 0.0.4, prometheus_client, this app's own registry)."""
    requests = Counter(
        "slipstream_dash_requests", "Dashboard requests by route and status.", ["route", "code"], registry=registry
    )
    seconds = Histogram("slipstream_dash_request_seconds", "Dashboard request time.", ["route"], registry=registry)

    @web.middleware
    async def count(
        request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        resource = request.match_info.route.resource
        route = resource.canonical if resource is not None else "unmatched"
        start = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            requests.labels(route, str(status)).inc()
            seconds.labels(route).observe(time.perf_counter() - start)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_PLAIN_0_0_4})

    return count, metrics


def make_app(source: RunSource, token: str | None = None) -> web.Application:
    count, metrics = _prometheus(CollectorRegistry())
    app = web.Application(middlewares=[count, *([_auth_middleware(token)] if token else [])])
    d = Dashboard(source)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/", d.runs_page)
    app.router.add_get("/api/runs", d.runs_json)
    app.router.add_get("/diff", d.diff)
    app.router.add_get("/api/diff", d.diff)
    app.router.add_get("/run/{run}", d.run_page)
    app.router.add_get("/api/run/{run}/series", d.series)
    app.router.add_get("/api/run/{run}/panels", d.panels)
    app.router.add_static("/static", STATIC)
    return app


async def _start(source: RunSource, host: str, port: int, token: str | None) -> tuple[web.AppRunner, int]:
    check_bind(host, token)
    runner = web.AppRunner(make_app(source, token), access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner, int(runner.addresses[0][1])


class DashServer:
    """The dashboard on its own event loop in a daemon thread: `url`, then `stop()`."""

    def __init__(self, path: str | Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> None:
        check_bind(host, token)
        self.source = RunSource(path)
        self.host, self.token = host, token
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slipstream-dash", daemon=True)
        self._thread.start()
        self._runner, self.port = asyncio.run_coroutine_threadsafe(
            _start(self.source, host, port, token), self._loop
        ).result(timeout=30)

    def url(self, path: str = "/") -> str:
        return dash_url(self.host, self.port, self.token, path)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def __enter__(self) -> DashServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_in_thread(path: str | Path, host: str = "127.0.0.1", port: int = 0, token: str | None = None) -> DashServer:
    """Serve the dashboard of a run root (or run dir) from a background thread of this process."""
    return DashServer(path, host, port, token)


async def serve(path: str | Path, host: str, port: int, token: str | None) -> None:
    """Serve until cancelled (Ctrl-C), printing the URL to open."""
    source = RunSource(path)
    runner, bound = await _start(source, host, port, token)
    print(f"slipstream dash: serving {source.path} at {dash_url(host, bound, token)}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()
