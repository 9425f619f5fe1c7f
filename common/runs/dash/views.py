"""HTML of the dashboard's pages and of the fragments the run page swaps in when it polls. Pure:
records in, escaped HTML out."""

from __future__ import annotations

import json
from html import escape

from common.runs.dash.panels import Panel
from common.runs.dash.sources import LiveState, Run, age


def page(title: str, body: str, script: bool = False) -> str:
    js = '<script src="/static/dash.js" defer></script>' if script else ""
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        f"<title>{escape(title)}</title>"
        '<link rel="icon" href="data:,"><link rel="stylesheet" href="/static/dash.css">'
        f'{js}</head><body><header><a href="/">slipstream dash</a> <span>{escape(title)}</span></header>'
        f"<main>{body}</main></body></html>"
    )


def _duration(r: Run) -> str:
    if r.started_at is None or r.ended_at is None:
        return "-"
    s = int(r.ended_at - r.started_at)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s"


def runs_page(runs: list[Run], source: str) -> str:
    rows = "".join(
        f'<tr data-run-id="{escape(r.id)}"><td><a href="/run/{escape(r.id)}">{escape(r.id)}</a></td>'
        f'<td>{escape(r.name)}</td><td class="status-{escape(r.status.split()[0])}">{escape(r.status)}</td>'
        f"<td>{age(r.started_at)}</td><td>{age(r.ended_at)}</td><td>{_duration(r)}</td>"
        f'<td><code title="{escape(r.git_sha)}">{escape(r.git_sha[:10])}</code>'
        f"{' (dirty)' if r.git_dirty else ''}</td></tr>"
        for r in runs
    )

    def options(selected: int) -> str:
        return "".join(
            f'<option value="{escape(r.id)}"{" selected" if i == selected else ""}>{escape(r.id)}</option>'
            for i, r in enumerate(runs)
        )

    diff_form = (
        '<form action="/diff" method="get" class="diff-form">Config diff: '
        f'<select name="a">{options(0)}</select> against <select name="b">{options(1)}</select> '
        '<button type="submit">compare</button></form>'
        if len(runs) > 1
        else ""
    )
    table = (
        '<table class="runs"><tr><th>run</th><th>name</th><th>status</th><th>started (UTC)</th><th>ended (UTC)</th>'
        f"<th>took</th><th>git sha</th></tr>{rows}</table>"
        if runs
        else f"<p>No runs in {escape(source)} yet: start one with <code>slipstream launch configs/demo.toml</code>.</p>"
    )
    return page(f"runs in {source}", diff_form + table)


def diff_page(a: Run, b: Run, rows: list[tuple[str, object, object]]) -> str:
    body = "".join(
        f"<tr><td><code>{escape(path)}</code></td><td>{escape(repr(va))}</td><td>{escape(repr(vb))}</td></tr>"
        for path, va, vb in rows
    )
    head = f"<tr><th>key</th><th>{escape(a.id)}</th><th>{escape(b.id)}</th></tr>"
    table = f'<table class="diff">{head}{body}</table>' if rows else "<p>The two configs are identical.</p>"
    return page(f"config of {a.id} against {b.id}", f"<p>{len(rows)} differing keys.</p>{table}")


def panel_html(p: Panel) -> str:
    return (
        f'<section class="panel" id="panel-{escape(p.id)}" data-counts="{escape(json.dumps(p.counts))}">'
        f'<h2>{escape(p.title)}</h2><div class="chart-box">{p.svg}</div></section>'
    )


def live_html(live: LiveState) -> str:
    if not live.running:
        return f'<p class="not-running">not running: {escape(live.reason)}</p>'
    workers = "".join(
        f'<tr class="{"alive" if w["alive"] else "dead"}"><td>{escape(str(w["id"]))}</td><td>{escape(str(w["pool"]))}</td>'
        f"<td>{escape(str(w['url']))}</td><td>{escape(str(w['version']))}</td>"
        f"<td>{'alive' if w['alive'] else 'no heartbeat'}</td><td>{w['ttl_s'] if w['ttl_s'] is not None else '-'}</td></tr>"
        for w in live.workers
    )
    events = "".join(
        f"<li>{escape(ts)} <b>{escape(role)}</b> {escape(event)} <code>{escape(detail)}</code></li>"
        for ts, role, event, detail in live.events
    )
    events = f'<ul class="events">{events}</ul>' if events else ""
    roles = ", ".join(f"{escape(str(r['role']))}/{escape(str(r['instance']))}" for r in live.roles) or "none"
    return (
        f'<p class="running">running: served weight version '
        f"{'- (none acknowledged yet)' if live.weights_current is None else live.weights_current}; "
        f"roles with a heartbeat: {roles}</p>"
        '<table class="workers"><tr><th>worker</th><th>pool</th><th>url</th><th>weight version</th><th>liveness</th>'
        f"<th>ttl (s)</th></tr>{workers}</table>" + events
    )


def counters_html(counters: dict[str, float], undrawn: list[str]) -> str:
    out = ""
    if counters:
        pairs = [f"<td>{escape(k)}</td><td>{v:g}</td>" for k, v in counters.items()]
        cells = "".join(f"<tr>{''.join(pairs[i : i + 4])}</tr>" for i in range(0, len(pairs), 4))
        out += f'<h2>Flow counters (flow/*, end of run)</h2><table class="counters">{cells}</table>'
    if undrawn:
        out += (
            '<p class="undrawn">Also written, not charted: '
            + ", ".join(f"<code>{escape(t)}</code>" for t in undrawn)
            + "</p>"
        )
    return out


def run_page(run: Run, panels: list[Panel], signature: str, live: LiveState, extras: str) -> str:
    head = (
        f'<div class="run-head" data-run="{escape(run.id)}" data-signature="{escape(signature)}">'
        f"<b>{escape(run.id)}</b> status <b>{escape(run.status)}</b>, started {age(run.started_at)}, "
        f"ended {age(run.ended_at)}, git <code>{escape(run.git_sha[:10])}</code> · "
        f'<span id="updated">rendered</span></div>'
    )
    body = (
        head
        + '<h2>Workers</h2><div id="live">'
        + live_html(live)
        + '</div><div class="panels">'
        + "".join(panel_html(p) for p in panels)
        + f'</div><div id="extras">{extras}</div>'
    )
    return page(f"run {run.id}", body, script=True)
