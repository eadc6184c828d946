// The live dashboard: polls /dashboard/data once a second for the points after the last one
// it has (the server samples its Prometheus counters; see serve/dashboard.py) and draws the
// last minutes as small line charts.
"use strict";

const pct = (v) => (v == null ? "–" : v === 0 ? "0%" : 100 * v < 1 ? (100 * v).toPrecision(2) + "%" : (100 * v).toFixed(1) + "%");
const num = (v) => (v == null ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1));
const secs = (v) => (v == null ? "–" : v < 1 ? (1000 * v).toFixed(0) + " ms" : v.toFixed(2) + " s");
const count = (v) => (v == null ? "–" : String(Math.round(v)));

// title, series [key, label, format], when shown
const PANELS = [
  ["Requests", [["running", "running", count], ["waiting", "waiting", count]]],
  ["KV cache", [["kv_usage", "used", pct], ["kv_waste", "wasted", pct]]],
  ["Prefix cache hit rate", [["prefix_hit_rate", "hits", pct]]],
  ["Tokens per second", [["generation_tps", "out", num], ["prompt_tps", "in", num]]],
  ["Time to first token (30 s)", [["ttft_p50", "p50", secs], ["ttft_p99", "p99", secs]]],
  ["Inter-token latency (30 s)", [["itl_p50", "p50", secs], ["itl_p99", "p99", secs]]],
  ["Preemptions per minute", [["preemptions_per_min", "preempted", num]]],
  ["Requests failed by a step", [["failed_requests", "total", count]]],
  ["Speculative acceptance", [["spec_acceptance", "accepted", pct]], (info) => info.speculative],
  ["LoRA adapters running", [["lora_total", "requests", count]], (info) => info.max_lora],
];
const COLORS = ["#2f5fb3", "#d9822b", "#3c9a5f", "#b3261e"];

const points = [];
let info = {};
let last = null;
let span = 600;
const panels = [];

function build() {
  for (const [title, series, when] of PANELS) addPanel(title, series, when);
}

// with data-parallel replicas: each replica's requests and KV cache beside the totals above
let replicaPanels = false;
function buildReplicaPanels(replicas) {
  replicaPanels = true;
  const name = (r) => `${r.replica}${r.role === "both" ? "" : " " + r.role}`;
  const shown = replicas.slice(0, COLORS.length);
  addPanel("Running per replica", shown.map((r) => [`replica${r.replica}_running`, name(r), count]));
  addPanel("KV cache per replica", shown.map((r) => [`replica${r.replica}_kv`, name(r), pct]));
  addPanel("Replicas up", [["replicas_up", "up", count]]);
}

function addPanel(title, series, when) {
  const main = document.getElementById("panels");
  const panel = document.createElement("section");
  panel.className = "panel";
  const h = document.createElement("h2");
  h.textContent = title;
  const now = document.createElement("div");
  now.className = "now";
  const values = series.map(([key, label], i) => {
    const tag = document.createElement("span");
    tag.textContent = label;
    tag.style.color = COLORS[i];
    const v = document.createElement("b");
    v.dataset.key = key;
    v.textContent = "–";
    now.append(tag, v, " ");
    return v;
  });
  const canvas = document.createElement("canvas");
  panel.append(h, now, canvas);
  main.append(panel);
  panels.push({ panel, series, when, values, canvas });
}

function draw({ canvas, series }) {
  const dpr = window.devicePixelRatio || 1;
  const w = canvas.clientWidth, h = canvas.clientHeight;
  const cw = Math.round(w * dpr), ch = Math.round(h * dpr);
  if (canvas.width !== cw || canvas.height !== ch) { canvas.width = cw; canvas.height = ch; }
  const g = canvas.getContext("2d");
  g.setTransform(dpr, 0, 0, dpr, 0, 0);
  g.clearRect(0, 0, w, h);
  if (!points.length) return;
  // the last ten minutes, or since the first point (at least a minute) while younger
  const t1 = points[points.length - 1].t;
  const t0 = Math.max(t1 - span, Math.min(points[0].t, t1 - 60));
  let top = 0;
  for (const [key] of series) for (const p of points) if (p[key] != null) top = Math.max(top, p[key]);
  top = top > 0 ? top * 1.1 : 1;
  g.strokeStyle = getComputedStyle(document.body).getPropertyValue("--line");
  g.beginPath(); g.moveTo(0, h - 0.5); g.lineTo(w, h - 0.5); g.stroke();
  series.forEach(([key], i) => {
    g.strokeStyle = COLORS[i];
    g.lineWidth = 1.5;
    g.beginPath();
    let on = false;
    for (const p of points) {
      const v = p[key];
      if (v == null) { on = false; continue; }
      const x = ((p.t - t0) / (t1 - t0)) * w, y = h - 2 - (v / top) * (h - 6);
      if (on) g.lineTo(x, y); else g.moveTo(x, y);
      on = true;
    }
    g.stroke();
  });
}

function render() {
  const p = points[points.length - 1];
  for (const panel of panels) {
    panel.panel.hidden = Boolean(panel.when && !panel.when(info));
    if (panel.panel.hidden) continue;
    panel.series.forEach(([key, , format], i) => { panel.values[i].textContent = p ? format(p[key]) : "–"; });
    draw(panel);
  }
}

async function poll() {
  try {
    const resp = await fetch("/dashboard/data" + (last == null ? "" : "?since=" + last), { cache: "no-store" });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    const data = await resp.json();
    info = data.info;
    if (info.replicas && !replicaPanels) buildReplicaPanels(info.replicas);
    span = data.window_seconds || span;
    for (const p of data.points) {
      if (p.lora_running) p.lora_total = Object.values(p.lora_running).reduce((a, b) => a + b, 0);
      const up = Object.keys(p).filter((k) => /^replica\d+_up$/.test(k));
      if (up.length) p.replicas_up = up.reduce((a, k) => a + p[k], 0);
      points.push(p);
    }
    if (points.length) last = points[points.length - 1].t;
    while (points.length && points[0].t < last - span) points.shift();
    document.getElementById("model").textContent = info.model + (info.adapters.length ? ` + ${info.adapters.length} adapter${info.adapters.length > 1 ? "s" : ""}` : "");
    const status = document.getElementById("status");
    status.textContent = info.ready ? `live · ${new Date().toLocaleTimeString()}` : "loading the model…";
    status.dataset.updated = String(last);
    render();
  } catch (e) {
    document.getElementById("status").textContent = "no answer from the server (" + e.message + ")";
  }
  setTimeout(poll, 1000);  // one request a second, whatever happens
}

document.addEventListener("DOMContentLoaded", () => {
  build();
  window.addEventListener("resize", render);
  poll();
});
