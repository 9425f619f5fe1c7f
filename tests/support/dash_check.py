"""Checks of the run dashboard in a real browser (Debian's chromium, driven by selenium through the
system chromedriver; nothing is downloaded). `check_run_page(run_dir, out_dir)` is the whole check of
one run page, for any finished run: tests/unit/test_dash.py uses it on a run written by the real writers,
and an end-to-end test can call it on a real demo run.

Expected counts come from the DuckDB files themselves (read-only, one SQL query per file, not through
the dashboard's readers): a chart series must draw one point per distinct step of its tag."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import duckdb
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.chrome.webdriver import WebDriver

from common.runs.dash import DashServer

# Each chart series' drawn elements: the polyline's vertices for lines, the rects otherwise.
_DRAWN_JS = """
const out = [];
for (const panel of document.querySelectorAll('section.panel')) {
  for (const g of panel.querySelectorAll('g.series')) {
    const kind = g.closest('svg').dataset.kind;
    const line = g.querySelector('polyline');
    const drawn = line ? line.points.numberOfItems : g.querySelectorAll('rect').length;
    out.push({panel: panel.id, kind: kind, tag: g.dataset.tag, points: Number(g.dataset.points), drawn: drawn});
  }
}
return out;
"""


def chromium_paths() -> tuple[str, str] | None:
    """(browser, driver) of the system chromium, or None when it is not installed."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


@contextmanager
def chromium(width: int = 1240, height: int = 2300) -> Iterator[WebDriver]:
    """A headless chromium with its console log readable through driver.get_log('browser')."""
    paths = chromium_paths()
    if paths is None:
        raise RuntimeError("chromium or chromedriver not found: apt-get install -y chromium chromium-driver")
    options = webdriver.ChromeOptions()
    options.binary_location = paths[0]
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        f"--window-size={width},{height}",
        "--hide-scrollbars",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # An explicit driver path: selenium-manager is not asked to find (or download) one.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=paths[1]))
    driver.set_page_load_timeout(15)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: WebDriver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


def duckdb_step_counts(run_dir: Path) -> dict[str, int]:
    """tag -> distinct steps over every metrics segment of the run, straight from DuckDB."""
    steps: dict[str, set[int]] = {}
    with duckdb.connect() as con:
        query = "SELECT DISTINCT tag, step FROM read_parquet($files)"
        for tag, step in con.execute(query, {"files": str(run_dir / "metrics" / "*" / "*.parquet")}).fetchall():
            steps.setdefault(tag, set()).add(step)
    return {tag: len(s) for tag, s in steps.items()}


def drawn_series(driver: WebDriver) -> list[dict]:
    return driver.execute_script(_DRAWN_JS)


def expected_count(run_dir: Path, counts: dict[str, int], tag: str) -> int:
    if tag == "flow_summary/staleness":  # the histogram's bins come from the trainer's flow_summary.json
        return len(json.loads((run_dir / "flow_summary.json").read_text())["counters"]["staleness"])
    return counts[tag]


def save_page(driver: WebDriver, path: Path) -> None:
    """A screenshot of the whole page (the window resized to the page's height)."""
    width = driver.get_window_size()["width"]
    driver.set_window_size(width, 400)  # shrink first: scrollHeight is never below the window's height
    height = driver.execute_script(
        "return document.documentElement.scrollHeight + window.outerHeight - window.innerHeight"
    )
    driver.set_window_size(width, height)
    driver.save_screenshot(str(path))


def wait_until(predicate, timeout_s: float, what: str, period_s: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period_s)
    raise AssertionError(f"{what}: not within {timeout_s}s")


def check_run_page(run_dir: Path, out_dir: Path) -> dict[str, int]:
    """Serve the dashboard of `run_dir`, open its run page and the runs list in chromium, assert no
    console errors, every chart series drawing exactly DuckDB's point count, and every written tag
    either drawn, listed as not charted, or a flow counter; save a screenshot per page under out_dir.
    Returns tag -> points drawn."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    exp = json.loads((run_dir / "run.json").read_text())["exp"]
    counts = duckdb_step_counts(run_dir)
    with DashServer(run_dir) as server, chromium() as driver:
        driver.get(server.url("/"))
        assert exp in driver.find_element("css selector", "table.runs").text
        driver.save_screenshot(str(out_dir / "dash-runs.png"))
        driver.get(server.url(f"/run/{exp}"))
        drawn = drawn_series(driver)
        listed = {e.text for e in driver.find_elements("css selector", ".undrawn code")}
        save_page(driver, out_dir / "dash-run.png")
        errors = console_errors(driver)
    assert not errors, f"browser console errors on the run page of {run_dir}: {errors}"
    assert drawn, f"the run page of {run_dir} drew no chart series"
    shown = {s["tag"] for s in drawn} | listed
    hidden = sorted(t for t in counts if t not in shown and not t.startswith("flow/"))
    assert not hidden, f"tags of {run_dir} neither charted nor listed on its page: {hidden}"
    result: dict[str, int] = {}
    for s in drawn:
        want = expected_count(run_dir, counts, s["tag"])
        assert s["points"] == s["drawn"] == want, f"{s['panel']} {s['tag']}: drew {s}, DuckDB has {want}"
        result[s["tag"]] = s["drawn"]
    return result
