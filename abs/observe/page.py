"""The dashboard's one HTML page: static markup and a small script that fetches
``/api/job`` every second and redraws the job graph, the checkpoint history (a row opens
its per-task figures), failed checkpoints and restarts. No library, nothing from the network;
every value goes into the page as text, never as markup."""
from __future__ import annotations

import json

__all__ = ["render_page", "REFRESH_MS", "HISTORY"]

REFRESH_MS = 1000
HISTORY = 50
"""Completed checkpoints the page lists (the newest; its counts cover all)."""

_PAGE = r"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>abs job</title>
<link rel="icon" href="data:,">
<style>
body{font:14px/1.4 system-ui,-apple-system,"Segoe UI",sans-serif;margin:0;color:#1d232a;background:#f5f6f8}
header{background:#1f3a5f;color:#fff;padding:10px 18px;display:flex;gap:24px;align-items:baseline;flex-wrap:wrap}
header h1{font-size:18px;margin:0}
.pill{padding:2px 8px;border-radius:10px;background:#6c7a89;font-weight:600;font-size:12px}
.pill.RUNNING{background:#2e8b57}.pill.FAILED{background:#c0392b}.pill.FINISHED{background:#2c6fbb}.pill.CANCELED{background:#7f8c8d}
main{padding:12px 18px;display:grid;gap:14px}
section{background:#fff;border:1px solid #dde1e6;border-radius:6px;padding:10px 14px}
h2{font-size:15px;margin:0 0 8px}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{text-align:right;padding:3px 8px;border-bottom:1px solid #eef0f2;white-space:nowrap}
th:first-child,td:first-child,td.text,th.text{text-align:left}
tr.cp{cursor:pointer}tr.cp:hover{background:#f0f5fb}
tr.detail td{background:#fafbfc;padding:6px 14px}
.muted{color:#6c7a89}.err{color:#c0392b}.ok{color:#2e8b57}
button{font:inherit;padding:5px 12px;border-radius:4px;border:1px solid #1f3a5f;background:#1f3a5f;color:#fff;cursor:pointer}
button:disabled{opacity:.5;cursor:wait}
#actions{display:flex;gap:10px;align-items:center;flex-wrap:wrap}
.kpis{display:flex;gap:28px;flex-wrap:wrap}.kpi b{display:block;font-size:20px}
</style></head>
<body>
<header><h1 id="job">…</h1><span id="status" class="pill">…</span>
<span id="summary" class="muted"></span><span id="updated" class="muted"></span></header>
<main>
<section><div id="actions">
<button id="trigger-checkpoint" type="button">Trigger checkpoint</button>
<button id="trigger-savepoint" type="button">Take savepoint</button>
<span id="action-result" class="muted"></span></div></section>
<section><h2>Overview</h2><div class="kpis" id="kpis"></div></section>
<section><h2>Job graph</h2><svg id="graph" width="100%" height="140" role="img" aria-label="job graph"></svg>
<p class="muted" id="graph-note">Boxes are tasks (chained operators) with their parallelism and records per second;
edges show how records are partitioned; under each, per subtask (#0/#1/...), the share of the last half second it was
busy, and blocked on full output channels (backpressured); from 5 subtasks on, their mean and the highest.</p></section>
<section><h2>Checkpoints <span class="muted" id="cp-counts"></span></h2>
<table id="checkpoints"><thead><tr><th>id</th><th class="text">status</th><th>triggered at</th><th>duration</th>
<th>alignment</th><th>sync</th><th>async</th><th>written</th><th>full size</th><th>files</th><th>tasks</th></tr></thead>
<tbody></tbody></table><p class="muted">Click a row for each task's part (alignment, sync, async, bytes, delta vs full).</p></section>
<section><h2>Failed checkpoints</h2><table id="failed"><thead><tr><th>id</th><th class="text">reason</th></tr></thead><tbody></tbody></table></section>
<section><h2>Reconfigurations <span class="muted" id="assignment"></span></h2><table id="reconfigurations"><thead><tr><th>id</th><th class="text">what</th><th class="text">status</th><th>steps</th><th>key groups</th><th>duration</th><th>moved</th><th class="text">after</th></tr></thead><tbody></tbody></table></section>
<section><h2>Autoscaling <span class="muted" id="autoscale-config"></span></h2><table id="autoscale"><thead><tr><th>at</th><th class="text">decision</th><th>workers</th><th class="text">outcome</th><th class="text">reason</th></tr></thead><tbody></tbody></table></section>
<section><h2>Restarts</h2><table id="restarts"><thead><tr><th>attempt</th><th>at</th><th class="text">cause</th><th>restored from</th></tr></thead><tbody></tbody></table></section>
</main>
<script>
"use strict";
const TOKEN = __TOKEN__, REFRESH = __REFRESH__, HISTORY = __HISTORY__;
const q = p => p + (p.includes("?") ? "&" : "?") + "token=" + encodeURIComponent(TOKEN);
const open = new Set();
function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  for (const k of kids) e.append(k instanceof Node ? k : document.createTextNode(String(k)));
  return e;
}
function svg(tag, attrs, text) {
  const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
  if (text !== undefined) e.textContent = text;
  return e;
}
function bytes(n) {
  if (n == null) return "-";
  const u = ["B", "KiB", "MiB", "GiB", "TiB"]; let i = 0;
  while (Math.abs(n) >= 1024 && i < u.length - 1) { n /= 1024; i++; }
  return i ? n.toFixed(1) + " " + u[i] : n + " B";
}
function secs(s) {
  if (s == null) return "-";
  const ms = s * 1000;
  return ms < 1 ? ms.toFixed(2) + " ms" : ms < 1000 ? ms.toFixed(ms < 100 ? 1 : 0) + " ms" : s.toFixed(2) + " s";
}
function rate(r) { return r == null ? "-" : r >= 1000 ? (r / 1000).toFixed(1) + "k/s" : r.toFixed(0) + "/s"; }
function fill(tbody, rows) {
  const cols = tbody.parentElement.querySelectorAll("thead th").length;
  tbody.replaceChildren(...(rows.length ? rows : [el("tr", {class: "none"}, el("td", {colspan: cols, class: "text muted"}, "none"))]));
}
function drawGraph(job) {
  const g = document.getElementById("graph"), tasks = job.graph.tasks, edges = job.graph.edges;
  const depth = {}; tasks.forEach(t => depth[t.task] = 0);
  for (let pass = 0; pass < tasks.length; pass++)
    edges.forEach(e => { depth[e.to] = Math.max(depth[e.to], depth[e.from] + 1); });
  const cols = {}; tasks.forEach(t => (cols[depth[t.task]] = cols[depth[t.task]] || []).push(t));
  const W = 230, H = 94, GX = 60, GY = 16, pos = {};
  let maxRows = 1;
  Object.entries(cols).forEach(([d, ts]) => { maxRows = Math.max(maxRows, ts.length);
    ts.forEach((t, i) => pos[t.task] = {x: 10 + d * (W + GX), y: 10 + i * (H + GY)}); });
  const kids = [svg("defs", {}), ];
  const marker = svg("marker", {id: "arrow", viewBox: "0 0 10 10", refX: 10, refY: 5, markerWidth: 7, markerHeight: 7, orient: "auto"});
  marker.append(svg("path", {d: "M0,0 L10,5 L0,10 z", fill: "#6c7a89"})); kids[0].append(marker);
  edges.forEach(e => { const a = pos[e.from], b = pos[e.to];
    kids.push(svg("line", {x1: a.x + W, y1: a.y + H / 2, x2: b.x, y2: b.y + H / 2, stroke: "#6c7a89", "marker-end": "url(#arrow)"}));
    kids.push(svg("text", {x: (a.x + W + b.x) / 2, y: (a.y + b.y + H) / 2 - 4, "text-anchor": "middle", "font-size": 11, fill: "#6c7a89"}, e.partition)); });
  tasks.forEach(t => { const p = pos[t.task], grp = svg("g", {class: "task", "data-task": t.task});
    const ops = t.operators.map(o => o.uid).join(" → ");
    const head = t.operators[0].uid, r = (job.throughput || {})[head], n = (job.records_in || {})[head];
    grp.append(svg("rect", {x: p.x, y: p.y, width: W, height: H, rx: 6, fill: "#eaf1fa", stroke: "#1f3a5f"}),
      svg("text", {x: p.x + 8, y: p.y + 18, "font-weight": 600, "font-size": 12}, ops.length > 30 ? ops.slice(0, 29) + "…" : ops),
      svg("text", {x: p.x + 8, y: p.y + 36, "font-size": 11}, t.task + "  ×" + t.parallelism + " subtasks"),
      svg("text", {x: p.x + 8, y: p.y + 52, "font-size": 11, fill: "#2e5d8f"}, (n == null ? "-" : n.toLocaleString()) + " in · " + rate(r)),
      ...loadLines(job.load || {}, t).map((line, k) =>
        svg("text", {x: p.x + 8, y: p.y + 68 + 16 * k, "font-size": 11, class: k ? "load backpressure" : "load"}, line)));
    kids.push(grp); });
  g.replaceChildren(...kids);
  g.setAttribute("height", 20 + maxRows * (H + GY));
}
function loadLines(load, t) {
  // two lines that fit the box: each subtask's share up to 4 subtasks, else the mean and the
  // highest (with its subtask)
  const subs = [...Array(t.parallelism).keys()].map(i => load[t.task + "#" + i]);
  if (subs.every(s => !s)) return ["load: -"];
  const pct = x => Math.round(100 * x) + "%";
  const line = (label, k) => {
    if (subs.length <= 4) return label + " " + subs.map(s => s ? pct(s[k]) : "-").join("/");
    const known = subs.map((s, i) => [s ? s[k] : null, i]).filter(([v]) => v != null);
    const [top, at] = known.reduce((a, b) => b[0] > a[0] ? b : a);
    return label + " mean " + pct(known.reduce((sum, [v]) => sum + v, 0) / known.length) + ", max " + pct(top) + " (#" + at + ")";
  };
  return [line("busy", "busy"), line("backpressured", "backpressured")];
}
function taskTable(cp) {
  const rows = Object.entries(cp.tasks || {}).sort().map(([task, f]) => el("tr", {},
    el("td", {}, task), el("td", {}, secs(f.alignment_s)), el("td", {}, secs(f.sync_s)), el("td", {}, secs(f.async_s)),
    el("td", {}, bytes(f.bytes_written)), el("td", {}, bytes(f.base_bytes_written)), el("td", {}, bytes(f.delta_bytes_written)),
    el("td", {}, bytes(f.state_bytes)), el("td", {}, f.files_written)));
  if (!rows.length) return el("span", {class: "muted"}, "no per-task figures kept for this checkpoint");
  return el("table", {class: "tasks"}, el("thead", {}, el("tr", {}, ...["task", "alignment", "sync", "async", "written",
    "full (base) written", "delta written", "state referenced", "files"].map(h => el("th", {}, h)))), el("tbody", {}, ...rows));
}
function draw(job) {
  document.title = "abs · " + job.job;
  document.getElementById("job").textContent = job.job;
  const st = document.getElementById("status"); st.textContent = job.status; st.className = "pill " + job.status;
  document.getElementById("summary").textContent = "parallelism " + job.parallelism + " · max parallelism " +
    job.max_parallelism + " · up " + secs(job.uptime_s) + (job.restored_from ? " · restored from " + job.restored_from : "");
  document.getElementById("updated").textContent = "updated " + new Date(job.time * 1000).toLocaleTimeString();
  const cps = job.checkpoints, last = cps.completed[cps.completed.length - 1];
  const total = Object.values(job.throughput || {}).length ? job.graph.tasks.filter(t => t.operators[0].kind === "source")
    .reduce((s, t) => s + ((job.throughput || {})[t.operators[0].uid] || 0), 0) : null;
  document.getElementById("kpis").replaceChildren(...[
    ["completed checkpoints", cps.counts.completed], ["failed checkpoints", cps.counts.failed],
    ["in progress", cps.in_progress.length ? cps.in_progress.join(", ") : "none"],
    ["last duration", last ? secs(last.duration) : "-"], ["last full size", last ? bytes(last.full_size) : "-"],
    ["source records/s", rate(total)], ["restarts", job.restarts.length]].map(([k, v]) => el("div", {class: "kpi"}, el("b", {}, v), k)));
  drawGraph(job);
  document.getElementById("cp-counts").textContent = "(" + cps.counts.completed + " completed, " + cps.counts.failed + " failed)";
  const rows = [];
  cps.in_progress.slice().reverse().forEach(id => rows.push(el("tr", {"data-id": id, "data-status": "IN_PROGRESS"},
    el("td", {}, id), el("td", {class: "text"}, "in progress"), ...Array(9).fill(0).map(() => el("td", {}, "")))));
  cps.completed.slice().reverse().forEach(cp => {
    const tr = el("tr", {class: "cp", "data-id": cp.checkpoint_id, "data-status": cp.status},
      el("td", {}, cp.checkpoint_id), el("td", {class: "text ok"}, "completed"), el("td", {}, secs(cp.trigger_time)),
      el("td", {}, secs(cp.duration)), el("td", {}, secs(cp.alignment_time)), el("td", {}, secs(cp.sync_time)),
      el("td", {}, secs(cp.async_time)), el("td", {}, bytes(cp.bytes_written)), el("td", {}, bytes(cp.full_size)),
      el("td", {}, cp.files_written), el("td", {}, Object.keys(cp.tasks || {}).length));
    tr.addEventListener("click", () => { open.has(cp.checkpoint_id) ? open.delete(cp.checkpoint_id) : open.add(cp.checkpoint_id); draw(job); });
    rows.push(tr);
    if (open.has(cp.checkpoint_id)) rows.push(el("tr", {class: "detail"}, el("td", {colspan: 11}, taskTable(cp))));
  });
  fill(document.querySelector("#checkpoints tbody"), rows);
  fill(document.querySelector("#failed tbody"), cps.failed.slice().reverse().map(f =>
    el("tr", {}, el("td", {}, f.checkpoint_id), el("td", {class: "text err"}, f.reason))));
  fill(document.querySelector("#restarts tbody"), job.restarts.map(r => el("tr", {}, el("td", {}, r.attempt),
    el("td", {}, secs(r.at)), el("td", {class: "text err"}, r.error), el("td", {}, r.restored_from == null ? "-" : r.restored_from))));
  document.getElementById("assignment").textContent = job.assignment ? "in force: " + job.assignment : "";
  fill(document.querySelector("#reconfigurations tbody"), (job.reconfigurations || []).slice().reverse().map(r =>
    el("tr", {}, el("td", {}, r.id), el("td", {class: "text"}, r.kind + ", " + r.strategy),
      el("td", {class: "text" + (r.status === "FAILED" ? " err" : "")}, r.status + (r.error ? ": " + r.error : "")),
      el("td", {}, r.steps.length), el("td", {}, r.key_groups), el("td", {}, r.duration == null ? "-" : secs(r.duration)),
      el("td", {}, bytes(r.bytes_moved)), el("td", {class: "text"}, r.after))));
  const auto = job.autoscale || {decisions: [], config: null};
  document.getElementById("autoscale-config").textContent = auto.config ?
    "on: " + auto.config.min_workers + ".." + auto.config.max_workers + " workers, cool-down " + auto.config.cooldown + " s" : "off";
  fill(document.querySelector("#autoscale tbody"), auto.decisions.slice().reverse().map(d =>
    el("tr", {}, el("td", {}, secs(d.time)), el("td", {class: "text"}, d.kind.replace("_", " ")), el("td", {}, d.workers),
      el("td", {class: "text" + (d.outcome.startsWith("FAILED") ? " err" : "")}, d.outcome),
      el("td", {class: "text"}, d.reason))));
  for (const [name, id] of [["checkpoint", "trigger-checkpoint"], ["savepoint", "trigger-savepoint"]]) {
    const b = document.getElementById(id); b.hidden = !(job.actions || []).includes(name);
    if (!b.dataset.busy) b.disabled = job.status !== "RUNNING";
  }
}
const ENDED = ["FINISHED", "FAILED", "CANCELED"];
async function refresh() {
  let ended = false;
  try {
    const r = await fetch(q("api/job?limit=" + HISTORY), {cache: "no-store"});
    if (!r.ok) throw new Error(r.status + " " + (await r.text()));
    const job = await r.json();
    draw(job);
    if (ENDED.includes(job.status)) {  // its figures are final, and the dashboard stops with the job
      ended = true;
      document.getElementById("updated").textContent = "the job ended (" + job.status + "), its dashboard stopped: " +
        "final figures as of " + new Date(job.time * 1000).toLocaleTimeString();
    }
  } catch (e) {
    document.getElementById("updated").textContent = "no answer from the job (" + e.message + "); " +
      "its dashboard stops when the job ends";
  } finally { if (!ended) setTimeout(refresh, REFRESH); }
}
async function act(name, button) {
  const out = document.getElementById("action-result");
  button.disabled = true; button.dataset.busy = "1";
  out.className = "muted"; out.textContent = name + " requested…";
  try {
    const r = await fetch(q("api/" + name), {method: "POST"}), body = await r.json();
    if (!r.ok) throw new Error(body.error || r.status);
    out.className = "ok";
    out.textContent = name === "checkpoint" ? "checkpoint " + body.checkpoint_id + " completed" : "savepoint written to " + body.location;
  } catch (e) { out.className = "err"; out.textContent = name + " failed: " + e.message; }
  finally { delete button.dataset.busy; button.disabled = false; }
}
document.getElementById("trigger-checkpoint").addEventListener("click", e => act("checkpoint", e.currentTarget));
document.getElementById("trigger-savepoint").addEventListener("click", e => act("savepoint", e.currentTarget));
refresh();
</script></body></html>
"""


def render_page(token: str, refresh_ms: int = REFRESH_MS, history: int = HISTORY) -> str:
    """The page, with the token it sends back on each request."""
    return (_PAGE.replace("__TOKEN__", json.dumps(token)).replace("__REFRESH__", str(int(refresh_ms)))
            .replace("__HISTORY__", str(int(history))))
