"""The gateway's cluster status page: what ``baton status`` prints, as a small HTML page
that refreshes itself, with TTFT and TPOT sparklines of the latest requests.

``GET /status`` serves the page (no external assets); it polls ``GET /status.json``,
whose instance rows come from :mod:`shared.cluster.status` (the same rows the CLI
prints) and whose latency series come from :class:`RecentLatencies`.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from shared.cluster.keys import Keys
from shared.cluster.status import COLUMNS, cluster_members, row

RECENT_REQUESTS = 120  # points per sparkline


@dataclass(frozen=True)
class Latency:
    finished_at: float  # wall clock
    ttft_s: float
    tpot_s: float | None  # None: a single output token


class RecentLatencies:
    """TTFT and TPOT of the last :data:`RECENT_REQUESTS` requests that finished well.
    Owned by the gateway's metrics; appended to on the event loop only."""

    def __init__(self, size: int = RECENT_REQUESTS):
        self._items: deque[Latency] = deque(maxlen=size)

    def record(self, ttft_s: float, tpot_s: float | None) -> None:
        self._items.append(Latency(time.time(), ttft_s, tpot_s))

    def series(self) -> dict[str, list[float | None]]:
        items = list(self._items)
        return {
            "ttft_ms": [round(i.ttft_s * 1e3, 2) for i in items],
            "tpot_ms": [None if i.tpot_s is None else round(i.tpot_s * 1e3, 2) for i in items],
        }


async def snapshot(
    redis: aioredis.Redis, keys: Keys, recent: RecentLatencies, model: str
) -> dict[str, Any]:
    """The page's data: every live instance as ``baton status`` shows it, and the
    latency series. Raises redis errors (the route answers 503)."""
    now = time.time()
    members = await cluster_members(redis, keys)
    return {
        "model": model,
        "updated": now,
        "columns": list(COLUMNS),
        "instances": [dict(zip(COLUMNS, row(m, now), strict=True)) for m in members],
        **recent.series(),
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<title>Baton cluster status</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body { font: 14px system-ui, sans-serif; margin: 24px; color: #1d2330; background: #f7f8fa; }
h1 { font-size: 20px; margin: 0 0 4px; }
#meta { color: #667; margin-bottom: 16px; }
.cards { display: flex; gap: 16px; margin-bottom: 16px; flex-wrap: wrap; }
.card { background: #fff; border: 1px solid #dde1e8; border-radius: 6px; padding: 12px 16px; }
.card h2 { font-size: 13px; font-weight: 600; margin: 0 0 6px; color: #445; }
.card .value { font-size: 18px; font-variant-numeric: tabular-nums; }
svg { display: block; margin-top: 6px; }
table { border-collapse: collapse; background: #fff; border: 1px solid #dde1e8; width: 100%; }
th, td { text-align: left; padding: 6px 10px; border-bottom: 1px solid #eceef2; }
th { background: #eef1f5; font-weight: 600; }
td { font-variant-numeric: tabular-nums; }
.error { color: #b3261e; }
</style></head>
<body>
<h1>Baton cluster</h1>
<div id="meta">loading…</div>
<div class="cards">
  <div class="card"><h2>TTFT (ms), last requests</h2><div class="value" id="ttft-now">-</div>
    <svg id="ttft" width="320" height="60" aria-label="TTFT sparkline"></svg></div>
  <div class="card"><h2>TPOT (ms), last requests</h2><div class="value" id="tpot-now">-</div>
    <svg id="tpot" width="320" height="60" aria-label="TPOT sparkline"></svg></div>
  <div class="card"><h2>SLO attainment, last minute</h2><div class="value" id="slo">-</div></div>
</div>
<table><thead><tr id="head"></tr></thead><tbody id="rows"></tbody></table>
<script>
const REFRESH_MS = 2000;
function spark(id, values, color) {
  const svg = document.getElementById(id);
  const pts = values.filter(v => v !== null);
  const now = document.getElementById(id + "-now");
  now.textContent = pts.length ? pts[pts.length - 1].toFixed(1) + " ms (max " +
    Math.max(...pts).toFixed(1) + ")" : "no requests yet";
  if (pts.length < 2) { svg.innerHTML = ""; return; }
  const w = +svg.getAttribute("width"), h = +svg.getAttribute("height");
  const lo = Math.min(...pts), hi = Math.max(...pts), span = hi - lo || 1;
  const xy = pts.map((v, i) => [i * (w - 4) / (pts.length - 1) + 2,
                                h - 2 - (v - lo) * (h - 4) / span]);
  const d = xy.map((p, i) => (i ? "L" : "M") + p[0].toFixed(1) + "," + p[1].toFixed(1)).join("");
  svg.innerHTML = '<path class="line" d="' + d + '" fill="none" stroke="' + color +
    '" stroke-width="1.5"/>';
}
function pct(x) { return x === null ? "-" : Math.round(x * 100) + "%"; }
function sloText(a) {
  if (!a || (a.ttft_s === null && a.tpot_s === null)) return "no targets set";
  const t = [];
  if (a.ttft_s !== null) t.push("TTFT \u2264 " + a.ttft_s + " s");
  if (a.tpot_s !== null) t.push("TPOT \u2264 " + a.tpot_s + " s");
  if (!a.requests) return t.join(", ") + ": no requests";
  return pct(a.both_met) + " of " + a.requests + " met " + t.join(", ") +
    " (TTFT " + pct(a.ttft_met) + ", TPOT " + pct(a.tpot_met) + ")";
}
function add(parent, tag, text) {
  const el = document.createElement(tag);
  el.textContent = text;
  parent.appendChild(el);
}
async function refresh() {
  const meta = document.getElementById("meta");
  try {
    const r = await fetch("status.json", {cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const s = await r.json();
    const head = document.getElementById("head");
    head.innerHTML = "";
    for (const c of s.columns) add(head, "th", c);
    const body = document.getElementById("rows");
    body.innerHTML = "";
    for (const inst of s.instances) {
      const tr = document.createElement("tr");
      tr.dataset.instance = inst.instance;
      for (const c of s.columns) add(tr, "td", inst[c]);
      body.appendChild(tr);
    }
    spark("ttft", s.ttft_ms, "#2f6fdf");
    spark("tpot", s.tpot_ms, "#1b9e5a");
    document.getElementById("slo").textContent = sloText(s.slo);
    meta.className = "";
    meta.textContent = s.model + " · " + s.instances.length + " instances · updated " +
      new Date(s.updated * 1000).toLocaleTimeString();
  } catch (e) {
    meta.className = "error";
    meta.textContent = "status unavailable: " + e.message;
  }
}
refresh();
setInterval(refresh, REFRESH_MS);
</script>
</body></html>
"""
