"""The live dashboard: ``GET /dashboard`` (one self-contained page) and the per-block
JSON it draws, ``GET /v1/cache/blocks``.

The page has no external script, style or font and no build step; it polls
``/v1/cache`` and ``/v1/cache/blocks`` once a second. The page itself is public; the
JSON follows ``--api-key``: open ``/dashboard#key=KEY`` and the page sends
``Authorization: Bearer KEY`` (a URL fragment never reaches the server or its logs).
``#key=KEY&request=ID`` also outlines request ``ID``'s blocks on the map (so does
clicking its row).

The block report is built by the engine core between two steps (the call
``GetBlocksReport``, ``engine/reports.py``), so block states, ref counts and block
tables are one consistent snapshot.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from starlette.responses import HTMLResponse, JSONResponse, Response

DASHBOARD_PATH = "/dashboard"
BLOCKS_PATH = "/v1/cache/blocks"

# The page runs only its own inline code and talks only to this server.
_CSP = (
    "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
    "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)


def add_dashboard_routes(app: FastAPI, ctx: Any) -> None:
    """Mount ``GET /dashboard`` and ``GET /v1/cache/blocks`` on ``app``."""

    @app.get(DASHBOARD_PATH, include_in_schema=False)
    async def dashboard() -> Response:
        headers = {"Content-Security-Policy": _CSP, "Cache-Control": "no-cache"}
        return HTMLResponse(DASHBOARD_HTML, headers=headers)

    @app.get(BLOCKS_PATH)
    async def cache_blocks() -> Response:
        report = await ctx.engine.blocks_report()
        return JSONResponse(report, headers={"Cache-Control": "no-store"})


DASHBOARD_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="referrer" content="no-referrer">
<title>pagedllm dashboard</title>
<style>
:root {
  --bg: #f6f7f9; --card: #fff; --ink: #1f2430; --muted: #6b7280; --line: #e3e6eb;
  --free: #e8ebf0; --retired: #b9bec7; --cached: #8ec5e8; --u1: #fdc38a; --u2: #f78c3b; --u3: #d1541a; --u4: #8a2c0c;
  --host: #b9a4e0; --host2: #6a45b0; --bad: #c62828; --ok: #2e7d32;
}
* { box-sizing: border-box; }
body { margin: 0; font: 13px/1.4 system-ui, -apple-system, "Segoe UI", Roboto, sans-serif;
       background: var(--bg); color: var(--ink); }
header { display: flex; align-items: baseline; gap: 16px; padding: 10px 18px;
         background: #1f2430; color: #fff; }
header h1 { font-size: 16px; margin: 0; font-weight: 600; }
header .sub { color: #aab1bf; }
header .status { margin-left: auto; }
.dot { display: inline-block; width: 8px; height: 8px; border-radius: 50%;
       background: #888; margin-right: 6px; }
.dot.ok { background: #4caf50; } .dot.bad { background: #ef5350; }
main { padding: 14px 18px; display: grid; grid-template-columns: minmax(0, 1fr); gap: 12px; }
.cards { display: grid; grid-template-columns: repeat(auto-fit, minmax(200px, 1fr)); gap: 12px; }
.card { background: var(--card); border: 1px solid var(--line); border-radius: 8px;
        padding: 10px 12px; min-width: 0; }
.mapwrap { width: 100%; }
.tablewrap { overflow-x: auto; }
.card h2 { font-size: 11px; letter-spacing: .06em; text-transform: uppercase;
           color: var(--muted); margin: 0 0 6px; font-weight: 600; }
.big { font-size: 22px; font-weight: 600; font-variant-numeric: tabular-nums; }
.kv { display: grid; grid-template-columns: 1fr auto; gap: 1px 10px;
      font-variant-numeric: tabular-nums; }
.kv span:nth-child(odd) { color: var(--muted); }
.bar { height: 8px; background: var(--free); border-radius: 4px; overflow: hidden;
       display: flex; margin: 6px 0; }
.bar i { display: block; height: 100%; }
.legend { display: flex; flex-wrap: wrap; gap: 12px; color: var(--muted); margin: 4px 0 8px; }
.sw { display: inline-block; width: 10px; height: 10px; border-radius: 2px;
      margin-right: 4px; vertical-align: -1px; border: 1px solid rgba(0,0,0,.08); }
.maphead { display: flex; align-items: baseline; gap: 12px; }
.maphead h2 { margin: 0; }
.maphead .note { color: var(--muted); }
canvas { display: block; width: 100%; image-rendering: pixelated; cursor: crosshair; }
#tip { position: fixed; pointer-events: none; background: #1f2430; color: #fff;
       padding: 6px 8px; border-radius: 5px; font-size: 12px; max-width: 360px;
       display: none; z-index: 10; white-space: pre-line; }
table { width: 100%; border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { text-align: right; padding: 3px 8px; border-bottom: 1px solid var(--line);
         white-space: nowrap; }
th { color: var(--muted); font-weight: 600; font-size: 11px; text-transform: uppercase; }
th:first-child, td:first-child, th:nth-child(2), td:nth-child(2) { text-align: left; }
td:first-child { font-family: ui-monospace, SFMono-Regular, Menlo, monospace;
                 max-width: 320px; overflow: hidden; text-overflow: ellipsis; }
tbody tr { cursor: pointer; }
tbody tr:hover, tbody tr.sel { background: #fff4e5; }
.st { padding: 1px 6px; border-radius: 8px; font-size: 11px; }
.st.running { background: #e3f2e5; color: var(--ok); }
.st.waiting { background: #eef0f3; color: var(--muted); }
.st.swapped { background: #ede5fa; color: #5b3a9c; }
#auth { display: none; background: #fff3f3; border: 1px solid #f3c0c0; color: var(--bad);
        padding: 10px 12px; border-radius: 8px; }
#auth code { background: #fff; padding: 1px 4px; border-radius: 3px; }
.muted { color: var(--muted); }
</style>
</head>
<body>
<header>
  <h1>pagedllm</h1><span class="sub" id="model">KV cache dashboard</span>
  <span class="status"><span class="dot" id="dot"></span><span id="updated">connecting…</span></span>
</header>
<main>
  <div id="auth">This server needs an API key. Open
    <code>/dashboard#key=YOUR_KEY</code> (the key stays in your browser; it is sent as
    <code>Authorization: Bearer</code>).</div>
  <div class="cards">
    <div class="card"><h2>KV blocks</h2>
      <div class="big" id="usage">–</div>
      <div class="bar" id="usebar"></div>
      <div class="kv">
        <span>used</span><span id="b-used">–</span>
        <span>cached-free</span><span id="b-cached">–</span>
        <span>free</span><span id="b-free">–</span>
        <span>total</span><span id="b-total">–</span>
        <span>block size</span><span id="b-size">–</span>
      </div></div>
    <div class="card"><h2>Waste</h2>
      <div class="kv">
        <span>internal</span><span id="w-internal">–</span>
        <span>external</span><span id="w-external">–</span>
        <span>duplication</span><span id="w-duplication">–</span>
        <span>headroom</span><span id="w-headroom">–</span>
      </div>
      <div class="muted" style="margin-top:6px">tokens (% of allocated slots);
        headroom: free slots</div></div>
    <div class="card"><h2>Prefix cache</h2>
      <div class="big" id="hitrate">–</div>
      <div class="kv">
        <span>queried tokens</span><span id="p-q">–</span>
        <span>hit tokens</span><span id="p-h">–</span>
        <span>shared in flight</span><span id="p-f">–</span>
      </div></div>
    <div class="card"><h2>Speculative decoding</h2>
      <div class="big" id="s-len">off</div>
      <div class="kv">
        <span>method</span><span id="s-method">–</span>
        <span>draft tokens</span><span id="s-drafts">–</span>
        <span>accepted</span><span id="s-accepted">–</span>
      </div>
      <div class="muted" style="margin-top:6px">tokens per verification</div></div>
    <div class="card"><h2>Requests</h2>
      <div class="kv">
        <span>running</span><span id="r-running">–</span>
        <span>waiting</span><span id="r-waiting">–</span>
        <span>swapped</span><span id="r-swapped">–</span>
        <span>in flight (server)</span><span id="r-flight">–</span>
        <span>queued (server)</span><span id="r-queued">–</span>
      </div></div>
    <div class="card"><h2>Preemptions</h2>
      <div class="kv">
        <span>recompute</span><span id="pr-recompute">–</span>
        <span>swap</span><span id="pr-swap">–</span>
      </div>
      <h2 style="margin-top:10px">Host (swap) tier</h2>
      <div class="kv">
        <span>blocks used</span><span id="h-used">–</span>
        <span>blocks total</span><span id="h-total">–</span>
      </div>
      <h2 style="margin-top:10px">Disk tier</h2>
      <div class="kv">
        <span>blocks on disk</span><span id="d-blocks">–</span>
        <span>bytes on disk</span><span id="d-bytes">–</span>
        <span>hit tokens RAM / disk</span><span id="d-hits">–</span>
        <span>read / written</span><span id="d-io">–</span>
        <span>mean load</span><span id="d-load">–</span>
      </div>
      <h2 style="margin-top:10px">Elastic pool</h2>
      <div class="kv">
        <span>size</span><span id="e-size">–</span>
        <span>automatic range</span><span id="e-range">–</span>
        <span>grows / shrinks</span><span id="e-count">–</span>
        <span>last resize</span><span id="e-last">–</span>
        <span>events</span><span id="e-events">–</span>
      </div></div>
  </div>
  <div class="card">
    <div class="maphead"><h2>Block pool</h2>
      <span class="note" id="mapnote"></span></div>
    <div class="legend">
      <span><i class="sw" style="background:var(--free)"></i>free</span>
      <span><i class="sw" style="background:var(--cached)"></i>cached-free (prefix index)</span>
      <span><i class="sw" style="background:var(--retired)"></i>retired (a shrink under way)</span>
      <span><i class="sw" style="background:var(--u1)"></i>used by 1 request</span>
      <span><i class="sw" style="background:var(--u2)"></i>shared by 2</span>
      <span><i class="sw" style="background:var(--u3)"></i>3</span>
      <span><i class="sw" style="background:var(--u4)"></i>4+</span>
      <span class="muted">hover a block for its holders; click a request row to outline its blocks</span>
    </div>
    <div class="mapwrap"><canvas id="map" height="40"></canvas></div>
    <div id="hostwrap" style="display:none">
      <div class="maphead" style="margin-top:10px"><h2>Host tier</h2>
        <span class="note" id="hostnote"></span></div>
      <div class="mapwrap"><canvas id="hostmap" height="20" style="margin-top:6px"></canvas></div>
    </div>
  </div>
  <div class="card"><h2>Live requests</h2>
    <div class="tablewrap"><table><thead><tr>
      <th>request id</th><th>state</th><th>tokens</th><th>prompt</th><th>computed</th>
      <th>cached</th><th>blocks</th><th>host blocks</th><th>preemptions</th>
    </tr></thead><tbody id="rows"></tbody></table></div>
    <div class="muted" id="rowsnote" style="margin-top:6px"></div>
  </div>
</main>
<div id="tip"></div>
<script>
"use strict";
(function () {
  const MAX_ROWS = 300;
  const $ = (id) => document.getElementById(id);
  const css = getComputedStyle(document.documentElement);
  const color = (name) => css.getPropertyValue(name).trim();
  const COLORS = {
    free: color("--free"), retired: color("--retired"), cached: color("--cached"), host: [color("--host"), color("--host2")],
    used: [color("--u1"), color("--u2"), color("--u3"), color("--u4")],
  };
  let key = "";
  let blocks = null;       // last /v1/cache/blocks
  let holders = null;      // block id -> [request ids] (device), host likewise
  let hostHolders = null;
  let selected = null;     // request id outlined on the map
  const maps = { map: null, hostmap: null };  // layout of each canvas

  function readKey() {
    const params = new URLSearchParams(location.hash.replace(/^#/, ""));
    key = params.get("key") || "";
    if (params.get("request")) selected = params.get("request");  // outline it on the map
  }
  window.addEventListener("hashchange", () => { readKey(); poll(); });

  async function getJSON(path) {
    const headers = key ? { Authorization: "Bearer " + key } : {};
    const res = await fetch(path, { headers, cache: "no-store" });
    if (res.status === 401) { const e = new Error("unauthorized"); e.auth = true; throw e; }
    if (!res.ok) throw new Error(path + ": HTTP " + res.status);
    return res.json();
  }

  const fmt = (n) => (n === null || n === undefined) ? "n/a" : Number(n).toLocaleString("en-US");
  const pct = (f) => (f === null || f === undefined) ? "n/a" : (100 * f).toFixed(1) + "%";
  const set = (id, text) => { $(id).textContent = text; };

  function showReport(r) {
    set("usage", pct(r.usage) + " used");
    set("b-used", fmt(r.blocks_used));
    set("b-cached", fmt(r.blocks_cached_free));
    set("b-free", fmt(r.blocks_free));
    set("b-total", fmt(r.blocks_total));
    set("b-size", fmt(r.block_size) + " tokens");
    const bar = $("usebar");
    bar.replaceChildren();
    const total = r.blocks_total || 1;
    for (const [n, c] of [[r.blocks_used, COLORS.used[1]], [r.blocks_cached_free, COLORS.cached]]) {
      const i = document.createElement("i");
      i.style.width = (100 * n / total) + "%";
      i.style.background = c;
      bar.appendChild(i);
    }
    for (const kind of ["internal", "external", "duplication"]) {
      const w = r.waste[kind];
      set("w-" + kind, w.tokens === null ? "n/a" : fmt(w.tokens) + " (" + pct(w.fraction) + ")");
    }
    set("w-headroom", r.headroom_tokens === null ? "n/a" : fmt(r.headroom_tokens));
    set("hitrate", pct(r.prefix_cache.hit_rate) + " hit");
    set("p-q", fmt(r.prefix_cache.queries_tokens));
    set("p-h", fmt(r.prefix_cache.hits_tokens));
    set("p-f", fmt(r.prefix_cache.inflight_shared_tokens));
    const s = r.speculative;
    set("s-len", s ? s.mean_acceptance_length.toFixed(2) : "off");
    set("s-method", s ? s.method + (s.automatic ? " (automatic)" : "") : "–");
    set("s-drafts", s ? fmt(s.draft_tokens) : "–");
    set("s-accepted", s ? fmt(s.accepted_tokens) + " (" + pct(s.acceptance_rate) + ")" : "–");
    set("r-running", fmt(r.running));
    set("r-waiting", fmt(r.waiting));
    set("r-swapped", fmt(r.swapped));
    set("r-flight", r.server ? fmt(r.server.in_flight) : "n/a");
    set("r-queued", r.server ? fmt(r.server.queued) : "n/a");
    set("pr-recompute", fmt(r.preemptions.recompute));
    set("pr-swap", fmt(r.preemptions.swap));
    set("h-used", fmt(r.host_blocks_used));
    set("h-total", fmt(r.host_blocks_total));
    const d = r.disk;
    set("d-blocks", d ? fmt(d.blocks_used) + " of " + fmt(d.blocks_total) : "off");
    set("d-bytes", d ? mib(d.bytes_used) : "off");
    set("d-hits", d ? fmt(d.hits_tokens_ram) + " / " + fmt(d.hits_tokens_disk) : "off");
    set("d-io", d ? mib(d.bytes_read) + " / " + mib(d.bytes_written) : "off");
    set("d-load", d && d.loads ? (1000 * d.load_seconds / d.loads).toFixed(1) + " ms" : "–");
    const e = r.elastic;
    set("e-size", e ? mib(e.bytes_total) + (e.resizing ? " (shrinking)" : "") : "fixed");
    set("e-range", e && e.automatic
      ? mib(e.min_blocks * e.bytes_per_block) + " – " + mib(e.max_blocks * e.bytes_per_block)
      : "manual");
    set("e-count", e ? fmt(e.grows) + " / " + fmt(e.shrinks) : "–");
    const last = e && e.last_resize;
    set("e-last", last ? fmt(last.blocks_before) + " → " + fmt(last.blocks_after) + " blocks, " +
      fmt(last.blocks_moved) + " moved, " + last.duration_ms.toFixed(0) + " ms" : "–");
    set("e-events", e && e.events.length ? e.events.slice(-3).map(
      (v) => v.kind + " " + fmt(v.blocks_before) + "→" + fmt(v.blocks_after) + " (" + v.reason + ")"
    ).join("; ") : "–");
  }

  function mib(bytes) {
    return (bytes / 1048576).toFixed(1) + " MiB";
  }

  function invert(rows, field, n) {
    const out = new Array(n);
    for (const row of rows) {
      for (const b of (row[field] || [])) {
        if (b >= 0 && b < n) (out[b] || (out[b] = [])).push(row.request_id);
      }
    }
    return out;
  }

  function cellColor(state, ref, host) {
    if (state === 2) {
      if (host) return COLORS.host[ref > 1 ? 1 : 0];
      return COLORS.used[Math.min(ref, 4) - 1] || COLORS.used[0];
    }
    if (state === 1) return COLORS.cached;
    if (state === 3) return COLORS.retired;
    return COLORS.free;
  }

  // Lay the cells out to fill the card width; small pools get big cells, 10k+ get 2-4 px.
  function layout(canvas, n, maxCell) {
    const width = Math.max(200, canvas.parentElement.clientWidth);
    let cell = maxCell;
    const maxHeight = Math.max(120, window.innerHeight * 0.45);
    while (cell > 1) {
      const cols = Math.floor(width / cell);
      if (Math.ceil(n / cols) * cell <= maxHeight) break;
      cell -= 1;
    }
    const cols = Math.max(1, Math.floor(width / cell));
    const rows = Math.max(1, Math.ceil(n / cols));
    const gap = cell >= 4 ? 1 : 0;
    return { width, cell, cols, rows, gap, n };
  }

  function draw(canvasId, states, refs, host) {
    const canvas = $(canvasId);
    const n = states.length;
    const L = layout(canvas, n, host ? 12 : 16);
    maps[canvasId] = L;
    const dpr = window.devicePixelRatio || 1;
    const h = L.rows * L.cell;
    canvas.style.height = h + "px";
    canvas.width = Math.round(L.width * dpr);
    canvas.height = Math.round(h * dpr);
    canvas.style.width = L.width + "px";
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, L.width, h);
    const size = L.cell - L.gap;
    let last = null;
    for (let i = 0; i < n; i++) {
      const c = cellColor(states[i], refs[i], host);
      if (c !== last) { ctx.fillStyle = c; last = c; }
      ctx.fillRect((i % L.cols) * L.cell, Math.floor(i / L.cols) * L.cell, size, size);
    }
    if (size >= 13) {  // big cells: write the ref count of shared blocks in them
      ctx.font = "600 " + Math.floor(size * 0.62) + "px system-ui, sans-serif";
      ctx.textAlign = "center";
      ctx.textBaseline = "middle";
      ctx.fillStyle = "#fff";
      for (let i = 0; i < n; i++) {
        if (refs[i] < 2) continue;
        ctx.fillText(refs[i] > 99 ? "99+" : String(refs[i]),
                     (i % L.cols) * L.cell + size / 2, Math.floor(i / L.cols) * L.cell + size / 2 + 0.5);
      }
    }
    if (selected && blocks) {
      const row = blocks.requests.find((r) => r.request_id === selected);
      const table = row ? (host ? row.host_block_table : row.block_table) : [];
      ctx.strokeStyle = "#1f2430";
      ctx.lineWidth = Math.max(1, Math.min(2, size / 4));
      for (const b of table || []) {
        ctx.strokeRect((b % L.cols) * L.cell + 0.5, Math.floor(b / L.cols) * L.cell + 0.5,
                       Math.max(1, size - 1), Math.max(1, size - 1));
      }
    }
  }

  function drawAll() {
    if (!blocks) return;
    draw("map", blocks.state, blocks.ref_count, false);
    const hasHost = blocks.host_blocks_total > 0;
    $("hostwrap").style.display = hasHost ? "" : "none";
    if (hasHost) draw("hostmap", blocks.host_state, blocks.host_ref_count, true);
    const L = maps.map;
    set("mapnote", fmt(blocks.blocks_total) + " blocks × " + fmt(blocks.block_size) +
        " tokens, one cell per block, " + L.cols + " per row (ids left to right, top to bottom)");
    if (hasHost) set("hostnote", fmt(blocks.host_blocks_total) +
        " host blocks holding swapped requests (dark: one copy shared by several)");
  }

  function showRows(rows) {
    const body = $("rows");
    body.replaceChildren();
    for (const r of rows.slice(0, MAX_ROWS)) {
      const tr = document.createElement("tr");
      if (r.request_id === selected) tr.className = "sel";
      const cells = [r.request_id, null, r.num_tokens, r.num_prompt_tokens,
                     r.num_computed_tokens, r.num_cached_tokens, (r.block_table || []).length,
                     (r.host_block_table || []).length, r.num_preemptions];
      cells.forEach((v, i) => {
        const td = document.createElement("td");
        if (i === 1) {
          const s = document.createElement("span");
          s.className = "st " + r.status;
          s.textContent = r.status;
          td.appendChild(s);
        } else {
          td.textContent = (v === undefined) ? "–" : (i === 0 ? v : fmt(v));
        }
        if (i === 0) td.title = r.request_id;
        tr.appendChild(td);
      });
      tr.addEventListener("click", () => {
        selected = (selected === r.request_id) ? null : r.request_id;
        showRows(blocks.requests);
        drawAll();
      });
      body.appendChild(tr);
    }
    set("rowsnote", rows.length === 0 ? "no live requests" :
        rows.length > MAX_ROWS ? "showing " + MAX_ROWS + " of " + fmt(rows.length) : "");
  }

  const tip = $("tip");
  function hover(canvasId, ev) {
    const L = maps[canvasId];
    if (!blocks || !L) return;
    const rect = $(canvasId).getBoundingClientRect();
    const col = Math.floor((ev.clientX - rect.left) / L.cell);
    const row = Math.floor((ev.clientY - rect.top) / L.cell);
    const b = row * L.cols + col;
    if (col < 0 || col >= L.cols || b < 0 || b >= L.n) { tip.style.display = "none"; return; }
    const host = canvasId === "hostmap";
    const state = (host ? blocks.host_state : blocks.state)[b];
    const ref = (host ? blocks.host_ref_count : blocks.ref_count)[b];
    const who = ((host ? hostHolders : holders)[b]) || [];
    const shown = who.slice(0, 8).map((w) => "· " + w).join("\n");
    tip.textContent = (host ? "host block " : "block ") + b + " · " +
      blocks.state_names[state].replace("_", "-") + " · ref count " + ref +
      (who.length ? "\nheld by:\n" + shown + (who.length > 8 ? "\n… " + (who.length - 8) + " more" : "") : "");
    tip.style.display = "block";
    tip.style.left = Math.min(ev.clientX + 14, window.innerWidth - 370) + "px";
    tip.style.top = (ev.clientY + 14) + "px";
  }
  for (const id of ["map", "hostmap"]) {
    $(id).addEventListener("mousemove", (ev) => hover(id, ev));
    $(id).addEventListener("mouseleave", () => { tip.style.display = "none"; });
  }
  window.addEventListener("resize", drawAll);

  function status(ok, text) {
    $("dot").className = "dot " + (ok ? "ok" : "bad");
    set("updated", text);
  }

  let timer = null;
  async function poll() {
    clearTimeout(timer);
    try {
      const [report, b] = await Promise.all([getJSON("/v1/cache"), getJSON("/v1/cache/blocks")]);
      $("auth").style.display = "none";
      blocks = b;
      holders = invert(b.requests, "block_table", b.blocks_total);
      hostHolders = invert(b.requests, "host_block_table", b.host_blocks_total);
      if (selected && !b.requests.some((r) => r.request_id === selected)) selected = null;
      showReport(report);
      drawAll();
      showRows(b.requests);
      status(true, "live · " + new Date().toLocaleTimeString());
    } catch (e) {
      if (e.auth) $("auth").style.display = "block";
      status(false, e.auth ? "API key needed" : "disconnected (" + e.message + ")");
    }
    timer = setTimeout(poll, 1000);
  }

  async function loadModel() {
    try {
      const m = await getJSON("/v1/models");
      if (m.data && m.data.length) set("model", m.data[0].id + " · KV cache dashboard");
    } catch (e) { /* shown by poll() */ }
  }

  readKey();
  loadModel();
  poll();
})();
</script>
</body>
</html>
"""
