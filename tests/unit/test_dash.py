"""The run dashboard (`slipstream dash`): runs written through the real writers (MetricsWriter,
Registry, a Redis elected by the rendezvous) with the tags the roles write, served by the real server,
read over HTTP and in chromium (tests/support/dash_check.py)."""

from __future__ import annotations

import dataclasses
import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import duckdb
import pytest
from selenium.webdriver.support.ui import Select

from common.config import RendezvousConfig, load_config, to_toml
from common.keys import Keys
from common.metrics import MetricsWriter
from common.rendezvous import Rendezvous
from common.roles import RUN_FILE
from common.runs.cli import main as cli_main
from common.runs.dash import DashServer
from common.runs.dash.charts import Series, line_chart, nice_ticks
from common.runs.dash.sources import DashError, RunSource
from common.runs.registry import Registry
from rollout.flow.events import FlowCounters
from tests.support import prom
from tests.support.dash_check import (
    check_run_page,
    chromium,
    chromium_paths,
    console_errors,
    drawn_series,
    save_page,
    wait_until,
)

ROOT = Path(__file__).resolve().parents[2]
STEPS = 24
LAYERS = (1, 2, 3)
needs_chromium = pytest.mark.skipif(
    chromium_paths() is None,
    reason="chromium and chromedriver are not installed: apt-get install -y chromium chromium-driver (make setup does)",
)


def start_run(root: Path, exp: str, overrides: tuple[str, ...] = ()) -> Path:
    """Register a run as the launcher does (resolved config, registry row, run.json); its run dir."""
    run_dir = root / exp
    cfg = load_config(
        ROOT / "configs" / "demo.toml",
        [f"run.root={root}", f"run.dir={run_dir}", f"rendezvous.meet_dir={run_dir / 'meet'}", *overrides],
    )
    run_dir.mkdir(parents=True)
    Registry.for_root(root).start(exp, cfg.run.name, to_toml(cfg))
    (run_dir / RUN_FILE).write_text(json.dumps({"exp": exp, "name": cfg.run.name}) + "\n")
    return run_dir


def trainer_step(w: MetricsWriter, step: int, ts_ms: int) -> None:
    """The figures trainer/rl/driver.py logs for one RL step (its tags; values shaped like a run's), and the
    per-layer router figures trainer/pretrain.py logs."""
    reward = 0.4 + 0.3 * step / STEPS
    figures = {
        "rl/reward_mean": reward,
        "rl/accuracy": reward - 0.05,
        "rl/groups_used": 60,
        "rl/dynamic_dropped_groups": 1,
        "rl/completion_tokens_mean": 3.5,
        "rl/staleness_mean": (step % 3) * 0.5,
        "rl/staleness_max": step % 3,
        "perf/step_s": 1.5 + 0.1 * (step % 4),
        "perf/samples_per_s": 300 + 5 * step,
        "loss/loss": 0.1 - 0.001 * step,
        "loss/fresh_logprob_mismatch": 0.01 + 0.001 * (step % 5),
        "loss/behaviour_proximal_abs_logp_diff": 0.02,
        "loss/behaviour_proximal_abs_logp_diff_max": 0.3 + 0.01 * step,
        "loss/behaviour_proximal_k3": 0.001,
        "loss/behaviour_proximal_abs_logp_diff_p99": 0.12,
    }
    for tag, value in figures.items():
        w.log(tag, step, value, ts_ms)
    for layer in LAYERS:
        w.log(f"router/layer{layer}/load_cv", step, 0.2 * layer + 0.5 / (1 + step), ts_ms)


def publish(w: MetricsWriter, version: int, ts_ms: int) -> None:
    times = {
        "weights/publish_s": 0.6,
        "weights/max_pause_s": 0.2 + 0.01 * version,
        "weights/write_s": 0.3,
        "weights/max_load_s": 0.25,
    }
    for tag, value in times.items():
        w.log(tag, version, value, ts_ms)


def evaluation(w: MetricsWriter, version: int, ts_ms: int) -> None:
    """What evaluator/watch_loop.py logs for one version of the arithmetic benchmark (summarize's metrics)."""
    acc = 0.5 + version / 100
    result = {"accuracy/mean": acc, "accuracy/std": 0.5, "accuracy/pass@1": acc, "cases": 200.0, "samples": 200.0}
    for k, value in result.items():
        w.log(f"eval/arithmetic/{k}", version, value, ts_ms)


def write_run(root: Path, exp: str, overrides: tuple[str, ...] = (), finish: bool = True) -> Path:
    """A run of STEPS steps (a publish after every other step, an evaluation every fourth version); when
    `finish`, the flow counters and flow_summary.json of its end and a succeeded registry row."""
    run_dir = start_run(root, exp, overrides)
    t0 = int(time.time() * 1000) - STEPS * 3000
    with (
        MetricsWriter(run_dir, exp, "trainer", flush_interval_s=60) as trainer,
        MetricsWriter(run_dir, exp, "evaluator", flush_interval_s=60) as evaluator,
    ):
        for step in range(STEPS):
            end = t0 + step * 3000 + 1800
            trainer_step(trainer, step, end)
            if step % 2 == 0:
                publish(trainer, step + 1, end + 700)
            if step % 4 == 0:
                evaluation(evaluator, step + 1, end + 2500)
        if finish:
            counters = FlowCounters(
                dispatched_samples=24 * 1024,
                completed_samples=24 * 1024,
                trained_prompts=1536,
                trained_samples=24 * 1024,
                dropped_groups=12,
                staleness={0: 9000, 1: 11000, 2: 4576},
            )
            trainer.log_many(STEPS, {f"flow/{k}": float(v) for k, v in vars(counters).items() if isinstance(v, int)})
            summary = {"finish_reason": "max_steps", "counters": dataclasses.asdict(counters)}
            (run_dir / "flow_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    if finish:
        Registry.for_root(root).finish(exp, "succeeded")
    return run_dir


def get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str, dict[str, str]]:
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read().decode(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(), dict(exc.headers)


def duckdb_points(run_dir: Path) -> dict[str, list[list[float]]]:
    points: dict[str, list[list[float]]] = {}
    segments = str(run_dir / "metrics" / "*" / "*.parquet")  # read here by DuckDB alone, not by our readers
    with duckdb.connect() as con:
        query = "SELECT tag, step, value FROM read_parquet($files) ORDER BY tag, step"
        for tag, step, value in con.execute(query, {"files": segments}).fetchall():
            points.setdefault(tag, []).append([step, value])
    return points


# -- over HTTP -------------------------------------------------------------------------------------


def test_the_series_api_returns_exactly_the_points_in_duckdb(tmp_path):
    run_dir = write_run(tmp_path / "runs", "dash-a")
    with DashServer(tmp_path / "runs") as server:
        status, body, _ = get(server.url("/api/run/dash-a/series"))
    assert status == 200
    stored = duckdb_points(run_dir)
    assert len(stored["rl/reward_mean"]) == STEPS and len(stored["eval/arithmetic/accuracy/mean"]) == STEPS // 4
    assert json.loads(body) == stored


def test_a_step_written_twice_is_served_once_with_its_newest_value(tmp_path):
    run_dir = start_run(tmp_path / "runs", "dash-twice")
    with MetricsWriter(run_dir, "dash-twice", "trainer") as w:
        w.log("rl/reward_mean", 0, 0.25, ts_ms=1000)
        w.log("rl/reward_mean", 1, 0.5, ts_ms=2000)
        w.log("rl/reward_mean", 1, 0.75, ts_ms=3000)  # step 1 trained again after a resume
    with DashServer(run_dir) as server:
        assert json.loads(get(server.url("/api/run/dash-twice/series"))[1]) == {
            "rl/reward_mean": [[0, 0.25], [1, 0.75]]
        }
        page = get(server.url("/run/dash-twice"))[1]
    assert 'data-tag="rl/reward_mean" data-points="2"' in page


def test_binding_beyond_loopback_without_a_token_is_refused_naming_the_flag(tmp_path, capsys):
    write_run(tmp_path / "runs", "dash-b")
    with pytest.raises(DashError, match="--token"):
        DashServer(tmp_path / "runs", host="0.0.0.0")
    assert cli_main(["dash", str(tmp_path / "runs"), "--host", "0.0.0.0"]) == 2
    assert "needs a token: pass --token" in capsys.readouterr().err


def test_the_dashboard_serves_prometheus_metrics_of_its_requests(tmp_path):
    """/metrics is Prometheus text that prometheus_client's own parser reads: every request counted by route
    pattern and status, and timed."""
    write_run(tmp_path / "runs", "dash-m")
    with DashServer(tmp_path / "runs") as server:
        for path in ("/api/run/dash-m/series", "/api/run/dash-m/series", "/api/run/no-such-run/series"):
            get(server.url(path))
        status, text, headers = get(server.url("/metrics"))
    assert status == 200 and headers["Content-Type"].startswith("text/plain; version=0.0.4")
    route = "/api/run/{run}/series"
    assert prom.value(text, "slipstream_dash_requests_total", route=route, code="200") == 2
    assert prom.value(text, "slipstream_dash_requests_total", route=route, code="404") == 1
    assert prom.value(text, "slipstream_dash_request_seconds_count", route=route) == 3


def test_a_request_without_the_token_is_refused_when_a_token_is_set(tmp_path):
    write_run(tmp_path / "runs", "dash-c")
    with DashServer(tmp_path / "runs", host="0.0.0.0", token="s3cret") as server:
        base = f"http://127.0.0.1:{server.port}"
        for path in ("/", "/run/dash-c", "/api/run/dash-c/series", "/static/dash.js", "/metrics"):
            status, body, _ = get(base + path)
            assert status == 401 and "token" in body, path
        assert get(base + "/", {"Authorization": "Bearer wrong"})[0] == 401
        assert get(base + "/?token=wrong")[0] == 401
        assert get(base + "/api/run/dash-c/series", {"Authorization": "Bearer s3cret"})[0] == 200
        status, _, headers = get(server.url("/run/dash-c"))  # ?token= once ...
        assert status == 200 and server.url().endswith("?token=s3cret")
        cookie = headers["Set-Cookie"].split(";")[0]
        assert get(base + "/api/run/dash-c/series", {"Cookie": cookie})[0] == 200  # ... then the cookie


def test_the_runs_list_shows_status_times_and_git_sha_and_diffs_two_configs(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "dash-old")
    start_run(root, "dash-new", ("flow.max_staleness=4",))
    records = {r.id: r for r in Registry.for_root(root).list()}
    with DashServer(root) as server:
        status, page, _ = get(server.url("/"))
        assert status == 200
        for run_id, state in (("dash-old", "succeeded"), ("dash-new", "running")):
            row = page.split(f'<tr data-run-id="{run_id}">')[1].split("</tr>")[0]
            assert state in row and records[run_id].git_sha[:10] in row
        assert page.index("dash-new") < page.index("dash-old")  # newest first
        rows = json.loads(get(server.url("/api/diff?a=dash-old&b=dash-new"))[1])
        assert ["flow.max_staleness", "2", "4"] in rows
        assert {r[0] for r in rows} == {"flow.max_staleness", "run.dir", "rendezvous.meet_dir"}
        html = get(server.url("/diff?a=dash-old&b=dash-new"))[1]
        assert "flow.max_staleness" in html and "3 differing keys" in html
        status, body, _ = get(server.url("/run/nope"))
        assert status == 404 and "'nope'" in body
        assert get(server.url("/diff?a=dash-old"))[0] == 400


def test_a_path_that_is_no_run_root_nor_run_dir_is_an_error_naming_it(tmp_path):
    with pytest.raises(DashError, match="neither a run root"):
        RunSource(tmp_path)
    with pytest.raises(DashError, match="no such directory"):
        RunSource(tmp_path / "missing")


def test_workers_come_from_the_live_redis_and_a_stopped_redis_reads_not_running(tmp_path):
    run_dir = write_run(tmp_path / "runs", "dash-live", finish=False)
    rz = Rendezvous(run_dir / "meet", RendezvousConfig(leader_linger_s=1))
    client = rz.connect(timeout_s=10)
    keys = Keys("dash-live")
    client.hset(
        keys.workers,
        "w-a",
        json.dumps({"url": "http://127.0.0.1:9001", "model": "m", "weight_version": 7, "started_at": 1.0}),
    )
    client.hset(
        keys.workers,
        "w-b",
        json.dumps({"url": "http://127.0.0.1:9002", "model": "m", "weight_version": 5, "started_at": 1.0}),
    )
    client.set(keys.worker_alive("w-a"), "1", px=30_000)  # w-b's heartbeat has stopped
    client.set(keys.role_alive("trainer", "t0"), "1", px=30_000)
    client.set(keys.weights_current, 7)
    client.xadd(keys.events, {"role": "trainer", "event": "published", "detail": '{"version": 7}', "ts": "1.5"})
    with DashServer(tmp_path / "runs") as server:
        live = json.loads(get(server.url("/api/run/dash-live/panels"))[1])
        assert live["running"] is True
        row_a = live["live"].split("<td>w-a</td>")[1].split("</tr>")[0]
        row_b = live["live"].split("<td>w-b</td>")[1].split("</tr>")[0]
        assert "<td>7</td>" in row_a and "alive" in row_a
        assert "<td>5</td>" in row_b and "no heartbeat" in row_b
        assert "trainer/t0" in live["live"] and "served weight version 7" in live["live"]
        assert "<b>trainer</b> published <code>{&quot;version&quot;: 7}</code>" in live["live"]
        client.close()
        rz.close()
        start = time.monotonic()
        gone = json.loads(get(server.url("/api/run/dash-live/panels"))[1])
        assert time.monotonic() - start < 3.0
    assert gone["running"] is False and "not running" in gone["live"]


# -- in chromium -----------------------------------------------------------------------------------


@needs_chromium
def test_the_run_page_draws_every_duckdb_point_without_console_errors(tmp_path):
    run_dir = write_run(tmp_path / "runs", "dash-page")
    start = time.monotonic()
    drawn = check_run_page(run_dir, run_dir / "screenshots")
    took = time.monotonic() - start
    assert drawn["rl/reward_mean"] == drawn["rl/accuracy"] == STEPS
    assert drawn["eval/arithmetic/accuracy/mean"] == STEPS // 4
    assert drawn["weights/max_pause_s"] == STEPS // 2
    assert all(drawn[f"router/layer{i}/load_cv"] == STEPS for i in LAYERS)
    assert drawn["flow_summary/staleness"] == 3
    assert (run_dir / "screenshots" / "dash-run.png").stat().st_size > 20_000
    assert took < 20, f"check_run_page took {took:.1f}s"


@needs_chromium
def test_a_metric_written_while_the_page_is_open_appears_within_5_s(tmp_path):
    root = tmp_path / "runs"
    run_dir = write_run(root, "dash-open", finish=False)
    rz = Rendezvous(run_dir / "meet", RendezvousConfig(leader_linger_s=1))
    client = rz.connect(timeout_s=10)
    keys = Keys("dash-open")
    client.hset(
        keys.workers,
        "w-a",
        json.dumps({"url": "http://127.0.0.1:9001", "model": "m", "weight_version": 23, "started_at": 1.0}),
    )
    client.set(keys.worker_alive("w-a"), "1", px=60_000)
    try:
        with DashServer(root) as server, chromium() as driver:
            driver.get(server.url("/run/dash-open"))
            assert "w-a" in driver.find_element("css selector", "#live").text

            def reward_points() -> int:
                return next(s["drawn"] for s in drawn_series(driver) if s["tag"] == "rl/reward_mean")

            assert reward_points() == STEPS
            with MetricsWriter(run_dir, "dash-open", "trainer", flush_interval_s=60) as w:
                trainer_step(w, STEPS, int(time.time() * 1000))
            written = time.monotonic()
            wait_until(lambda: reward_points() == STEPS + 1, 5.0, "step written while the page is open")
            seen_after = time.monotonic() - written
            # a tag new to the page (a second benchmark) gets its own chart
            with MetricsWriter(run_dir, "dash-open", "evaluator", flush_interval_s=60) as w:
                w.log("eval/gsm8k/accuracy/mean", 25, 0.125)
            wait_until(lambda: driver.find_elements("css selector", "#panel-heldout-gsm8k g.series"), 5.0, "new chart")
            save_page(driver, run_dir / "dash-run-live.png")
            assert not console_errors(driver)
    finally:
        client.close()
        rz.close()
    assert seen_after < 5.0
    print(f"a step written while the page was open was drawn {seen_after:.2f}s after its flush")


# -- the drawing, pure ---------------------------------------------------------------------------


def test_axis_ticks_are_round_and_cover_the_range():
    assert nice_ticks(0.31, 0.69) == [0.3, 0.4, 0.5, 0.6, 0.7]
    assert nice_ticks(0, 23, 6) == [0, 5, 10, 15, 20, 25]
    assert nice_ticks(0.125, 0.125) == [0.05, 0.1, 0.15, 0.2]  # one value: an axis around it
    assert nice_ticks(0.0, 0.0)[0] == 0.0  # ... that does not go below zero for a value that does not
    with pytest.raises(ValueError, match="not finite"):
        nice_ticks(0, float("nan"))


def test_a_line_chart_has_a_vertex_per_point_and_a_legend_entry_per_series():
    svg = line_chart(
        [Series("a", "alpha", [(0, 1.0), (1, 2.0), (2, 1.5)]), Series("b", "beta", [(1, 0.5)])],
        "step",
        "value",
        "nothing",
    )
    assert 'data-points="4"' in svg and 'data-tag="a" data-points="3"' in svg
    assert svg.count("<circle") == 4 and ">alpha</text>" in svg and ">beta</text>" in svg
    assert ">step</text>" in svg and ">value</text>" in svg
    assert 'data-kind="empty"' in line_chart([Series("a", "alpha", [])], "step", "value", "waiting for a")


@needs_chromium
def test_the_runs_page_diffs_two_chosen_runs_in_the_browser(tmp_path):
    root = tmp_path / "runs"
    write_run(root, "dash-one")
    write_run(root, "dash-two", ("flow.max_staleness=4", "trainer.steps=80"))
    with DashServer(root) as server, chromium() as driver:
        driver.get(server.url("/"))
        save_page(driver, root / "dash-runs.png")
        Select(driver.find_element("name", "a")).select_by_value("dash-one")
        Select(driver.find_element("name", "b")).select_by_value("dash-two")
        driver.find_element("css selector", ".diff-form button").click()
        wait_until(lambda: driver.find_elements("css selector", "table.diff"), 5.0, "the diff page")
        rows = [r.text for r in driver.find_elements("css selector", "table.diff tr")]
        save_page(driver, root / "dash-diff.png")
        assert not console_errors(driver)
    assert "flow.max_staleness 2 4" in rows and "trainer.steps 50 80" in rows


def test_a_flow_summary_caught_mid_write_is_named_on_its_chart_not_a_server_error(tmp_path):
    run_dir = write_run(tmp_path / "runs", "dash-half")
    (run_dir / "flow_summary.json").write_text('{"finish_reason": "max_st')
    with DashServer(run_dir) as server:
        status, page, _ = get(server.url("/run/dash-half"))
    assert status == 200 and "flow_summary.json is not valid JSON" in page
