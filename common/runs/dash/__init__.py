"""The run dashboard (`slipstream dash`): the runs of a run root, and one page per run with its
metrics drawn as server-side SVG, updated live while the run goes on.

sources.py reads (registry, DuckDB metrics, flow summary, live Redis); panels.py decides which tags
each chart draws; charts.py draws SVG; views.py writes the HTML; server.py is the aiohttp layer and
`start_in_thread` / `dash_url` for in-process use."""

from common.runs.dash.server import DashServer, dash_url, start_in_thread

__all__ = ["DashServer", "dash_url", "start_in_thread"]
