"""Where the dashboard reads a run from: the registry (SQLite), the metrics (segment files, through
common/metrics.py's SeriesCache, incrementally: a page load reads only what was stored since the last), the run dir's flow_summary.json, and
the experiment's live Redis (through the meet dir's redis.json). Blocking reads; the server runs them
in threads. A Redis that is gone or slow is "not running", never an error or a wait."""

from __future__ import annotations

import contextlib
import json
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import redis

from common.config import ConfigError, diff, from_dict
from common.keys import Keys
from common.metrics import SeriesCache
from common.redis_client import RedisInfo
from common.roles import RUN_FILE
from common.runs.registry import Registry, RunRecord
from common.weights.fleet import WorkerRecord

# Steps kept per tag for the charts (a tag of more keeps every k-th: common/metrics.py's SeriesCache).
DASH_MAX_POINTS = 2000
DASH_DEFER_ROWS = 200_000
# redis.json: the name the rendezvous writes.
REDIS_FILE = "redis.json"
# The newest lifecycle events shown on a live run's page.
EVENTS_SHOWN = 8
# A page asks Redis every poll: a server that does not answer within this is reported as not running.
REDIS_TIMEOUT_S = 0.5


class DashError(ValueError):
    """The dashboard cannot serve what was asked; the message names the input and the fix."""


@dataclass(frozen=True)
class Run:
    """A run as the dashboard lists it: its registry row (or run.json alone) and where its files are."""

    id: str
    name: str
    status: str
    git_sha: str
    git_dirty: bool | None
    started_at: float | None
    ended_at: float | None
    config_toml: str
    run_dir: Path
    meet_dir: Path


@dataclass
class LiveState:
    """What Redis says about a running experiment; `running` False with the reason when it cannot."""

    running: bool
    reason: str = ""
    weights_current: int | None = None
    workers: list[dict[str, object]] = field(default_factory=list)
    roles: list[dict[str, object]] = field(default_factory=list)
    # newest first: (time, role, event, detail JSON) of the experiment's events stream
    events: list[tuple[str, str, str, str]] = field(default_factory=list)


def _paths_from_config(config_toml: str, root: Path, run_id: str) -> tuple[Path, Path]:
    """(run dir, meet dir) named by a run's resolved config (the launcher writes both), with the
    defaults of common/roles.py where empty."""
    data = tomllib.loads(config_toml) if config_toml else {}
    run_dir = Path(data.get("run", {}).get("dir") or root / run_id)
    meet = data.get("rendezvous", {}).get("meet_dir") or run_dir / "meet"
    return run_dir, Path(meet)


class RunSource:
    """The runs under one run root (its registry), or the single run of one run dir."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).resolve()
        if (self.path / "registry.sqlite").is_file():
            self.root, self.single = self.path, None
        elif (self.path / RUN_FILE).is_file():
            self.root, self.single = self.path.parent, self.path
        elif not self.path.is_dir():
            raise DashError(f"{path}: no such directory; pass a run root (e.g. runs/) or one run dir (runs/<exp>)")
        else:
            raise DashError(
                f"{path} is neither a run root (no registry.sqlite) nor a run dir (no {RUN_FILE}); pass the "
                "run.root of your config (default runs/) or one of its run dirs"
            )

    def _registry(self) -> Registry | None:
        path = self.root / "registry.sqlite"
        return Registry(path) if path.is_file() else None

    def _from_record(self, r: RunRecord) -> Run:
        run_dir, meet = _paths_from_config(r.config, self.root, r.id)
        return Run(r.id, r.name, r.status, r.git_sha, r.git_dirty, r.started_at, r.ended_at, r.config, run_dir, meet)

    def runs(self) -> list[Run]:
        """Newest first."""
        registry = self._registry()
        records = registry.list() if registry is not None else []
        if self.single is None:
            return [self._from_record(r) for r in reversed(records)]
        exp = json.loads((self.single / RUN_FILE).read_text())["exp"]
        for r in records:
            if r.id == exp:
                return [self._from_record(r)]
        # A run dir whose registry is elsewhere (or gone): what its own files say.
        config_file = self.single / "config.toml"
        config = config_file.read_text() if config_file.is_file() else ""
        _, meet = _paths_from_config(config, self.root, exp)
        return [Run(exp, exp, "unknown (not in a registry)", "unknown", None, None, None, config, self.single, meet)]

    def run(self, run_id: str) -> Run:
        for r in self.runs():
            if r.id == run_id:
                return r
        raise KeyError(f"run {run_id!r} is not in {self.path}")


def config_diff(a: Run, b: Run) -> list[tuple[str, object, object]]:
    """common/config.py's diff of two runs' resolved configs."""
    configs = []
    for r in (a, b):
        try:
            configs.append(from_dict(tomllib.loads(r.config_toml)))
        except (ConfigError, tomllib.TOMLDecodeError) as exc:
            raise DashError(f"run {r.id}: its recorded config does not load here ({exc}); compare it by hand") from None
    return diff(configs[0], configs[1])


def series_cache(run_dir: Path) -> SeriesCache:
    """A run's series as the page draws them (every role and rank, at most about 2 x DASH_MAX_POINTS steps
    a tag): the dashboard keeps one per run and each page load reads only the points stored since. A first
    read leaves the tags of more than DASH_DEFER_ROWS rows (per-sample gen/*, which no panel draws) to the
    next one, so the page of a long run opens within a second."""
    return SeriesCache(run_dir, max_points=DASH_MAX_POINTS, defer_rows=DASH_DEFER_ROWS)


def flow_summary_signature(run_dir: Path) -> str:
    """Changes when flow_summary.json appears or is rewritten."""
    with contextlib.suppress(FileNotFoundError):
        st = (run_dir / "flow_summary.json").stat()
        return f"{st.st_mtime_ns}:{st.st_size}"
    return ""


def read_flow_summary(run_dir: Path) -> dict | None:
    """The trainer's flow_summary.json (written once at the end of the run), or None before it exists."""
    path = run_dir / "flow_summary.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise DashError(f"{path} is not valid JSON ({exc}); the trainer writes it at the end of a run") from None


def read_live(exp: str, meet_dir: Path) -> LiveState:
    """Workers (both pools) with their versions and liveness, role heartbeats, the served version and the
    newest lifecycle events of experiment `exp`, whose Redis the meet dir names."""
    try:
        data = json.loads((meet_dir / REDIS_FILE).read_text())
    except FileNotFoundError:
        return LiveState(False, f"no {REDIS_FILE} in {meet_dir}")
    except (OSError, json.JSONDecodeError) as exc:
        return LiveState(False, f"{meet_dir / REDIS_FILE}: {exc}")
    info = RedisInfo(**data)
    if info.stopped:
        return LiveState(False, "its Redis was stopped at the end of the run")
    keys = Keys(exp)
    client = info.client(timeout_s=REDIS_TIMEOUT_S, retry=False)
    try:
        state = LiveState(True)
        current = client.get(keys.weights_current)
        state.weights_current = None if current is None else int(current)
        for pool, hash_key in (("train", keys.workers), ("eval", keys.eval_workers)):
            entries = {str(k): str(v) for k, v in client.hgetall(hash_key).items()}
            ids = sorted(entries)
            ttls = [client.pttl(keys.worker_alive(i)) for i in ids]
            for worker_id, ttl in zip(ids, ttls, strict=True):
                try:
                    record = WorkerRecord.from_json(worker_id, entries[worker_id])
                    url, version = record.url, record.weight_version
                except ValueError:  # no worker to common/weights/fleet.py's readers; the page still shows what is there
                    url, version = f"unreadable record {entries[worker_id][:80]!r}", None
                state.workers.append(
                    {
                        "id": worker_id,
                        "pool": pool,
                        "url": url,
                        "version": version,
                        "alive": ttl > 0,
                        "ttl_s": round(ttl / 1000, 1) if ttl > 0 else None,
                    }
                )
        for key in sorted(client.scan_iter(match=keys.role_pattern("*"), count=500)):
            _, role, instance = key[len(keys.prefix) : -len(":alive")].split(":", 2)
            ttl = client.pttl(key)
            state.roles.append({"role": role, "instance": instance, "ttl_s": round(ttl / 1000, 1) if ttl > 0 else None})
        for _, raw in client.xrevrange(keys.events, count=EVENTS_SHOWN) or []:
            fields = {str(k): str(v) for k, v in (raw or {}).items()}
            ts = float(fields.get("ts", 0))
            state.events.append((age(ts), fields.get("role", "?"), fields.get("event", "?"), fields.get("detail", "")))
        return state
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        return LiveState(False, f"Redis at {info.host}:{info.port} does not answer ({exc})")
    except redis.AuthenticationError as exc:
        return LiveState(False, f"Redis at {info.host}:{info.port} rejects the password of {REDIS_FILE} ({exc})")
    finally:
        client.close()


def age(ts: float | None) -> str:
    """A registry time as UTC text."""
    return "-" if ts is None else time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(ts))
