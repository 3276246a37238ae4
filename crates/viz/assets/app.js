// The Tether dashboard: polls /api/state (served by `tether dashboard`) and
// renders it. No dependency but the vendored uPlot.
"use strict";

const POLL_MS = 1000;
const charts = new Map();

function esc(v) {
  return String(v ?? "").replace(/[&<>"']/g, c => ({"&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;"}[c]));
}
const pct = v => v == null ? "-" : (v * 100).toFixed(1) + "%";
const ms = v => v == null ? "-" : v.toFixed(1) + "ms";
const num = v => v == null ? "-" : v.toFixed(1);

function table(id, head, rows) {
  const el = document.getElementById(id);
  el.innerHTML = "<tr>" + head.map(h => `<th>${esc(h)}</th>`).join("") + "</tr>" +
    rows.map(r => "<tr>" + r.map(c => `<td${c && c.cls ? ` class="${c.cls}"` : ""}>${esc(c && c.v !== undefined ? c.v : c)}</td>`).join("") + "</tr>").join("");
}

function topology(s) {
  const svg = document.getElementById("topology");
  const sources = [...new Set(s.edges.map(e => e.from))].sort();
  const services = [...new Set(s.services.map(x => x.name).concat(s.edges.map(e => e.to)))].sort();
  const rowH = 44, w = Math.max(svg.clientWidth || 900, 700), boxW = 260;
  const h = Math.max(sources.length, services.length, 1) * rowH + 20;
  svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
  svg.style.height = h + "px";
  const y = (list, name) => 20 + list.indexOf(name) * rowH + (h - 20 - list.length * rowH) / 2;
  const rightX = w - boxW - 10;
  let out = '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" markerHeight="7" orient="auto"><path d="M0,0L10,5L0,10z" fill="#8792a8"/></marker></defs>';
  for (const e of s.edges) {
    const y1 = y(sources, e.from) + 14, y2 = y(services, e.to) + 14;
    const label = `${num(e.rps)} rps · ${pct(e.success)} · p99 ${ms(e.p99_ms)}`;
    out += `<g class="edge" data-from="${esc(e.from)}" data-to="${esc(e.to)}" data-rps="${e.rps}">` +
      `<line x1="${10 + boxW}" y1="${y1}" x2="${rightX}" y2="${y2}"/>` +
      `<text class="edge-label" x="${(10 + boxW + rightX) / 2}" y="${(y1 + y2) / 2 - 4}" text-anchor="middle">${esc(label)}</text></g>`;
  }
  const node = (cls, x, yy, name) =>
    `<g class="node ${cls}" data-name="${esc(name)}"><rect x="${x}" y="${yy}" width="${boxW}" height="28"/>` +
    `<text x="${x + 8}" y="${yy + 18}">${esc(name)}</text></g>`;
  sources.forEach(n => out += node("workload", 10, y(sources, n), n));
  services.forEach(n => out += node("service", rightX, y(services, n), n));
  svg.innerHTML = out;
}

function chartsFor(s) {
  const box = document.getElementById("charts");
  for (const [name, points] of Object.entries(s.series)) {
    const data = [points.map(p => p.t), points.map(p => p.rps), points.map(p => p.success == null ? null : p.success * 100), points.map(p => p.p99_ms)];
    let c = charts.get(name);
    if (!c) {
      const div = document.createElement("div");
      div.className = "chart";
      div.dataset.service = name;
      div.innerHTML = `<h3>${esc(name)}</h3>`;
      box.appendChild(div);
      const opts = {
        width: 420, height: 160,
        scales: {x: {time: true}, rps: {}, pct: {range: [0, 100]}, ms: {}},
        series: [{}, {label: "RPS", scale: "rps", stroke: "#4a6cd4"}, {label: "success %", scale: "pct", stroke: "#2e8b57"}, {label: "p99 ms", scale: "ms", stroke: "#c62828"}],
        axes: [{}, {scale: "rps"}, {scale: "ms", side: 1}],
      };
      c = new uPlot(opts, data, div);
      charts.set(name, c);
    } else {
      c.setData(data);
    }
  }
}

function render(s) {
  const status = document.getElementById("status");
  if (s.error) {
    status.textContent = s.error;
    status.className = "status bad";
    return;
  }
  const up = s.proxies.filter(p => p.up).length;
  status.textContent = `${up}/${s.proxies.length} proxies answering · sample ${s.samples} · every ${s.interval_s.toFixed(1)}s`;
  status.className = "status";
  topology(s);
  table("services", ["service", "RPS", "success", "p50", "p99", "mTLS"], s.services.map(x =>
    [x.name, num(x.rps), {v: pct(x.success), cls: x.success == null ? "" : x.success >= 0.99 ? "ok" : "bad"}, ms(x.p50_ms), ms(x.p99_ms), pct(x.mtls)]));
  chartsFor(s);
  table("endpoints", ["cluster", "service", "endpoint", "address", "ready", "zone", "identity", "fail-fast"], s.endpoints.map(e =>
    [e.cluster || "-", e.service, e.name || "-", e.address, {v: e.ready ? "ready" : "not ready", cls: e.ready ? "ok" : "bad"}, e.zone || "-", e.identity || "-", {v: e.failfast ? "FAIL-FAST" : "no", cls: e.failfast ? "bad" : ""}]));
  const globals = [];
  for (const g of s.global) for (const c of g.clusters)
    globals.push([g.global_id, c.cluster, c.services.join(", "), Object.entries(c.tiers).map(([k, v]) => `${k}:${v}`).join(" "), {v: c.serving ? "serving" : "idle", cls: c.serving ? "ok" : ""}, num(c.rps_served)]);
  table("global", ["global id", "cluster", "services", "tier (from cluster)", "now", "req/interval"], globals);
  table("events", ["time", "global id", "from", "to"], s.events.slice().reverse().map(e =>
    [new Date(e.time * 1000).toLocaleTimeString(), e.global_id, (e.from || []).join(", ") || "none", (e.to || []).join(", ") || "none"]));
  table("control", ["cluster", "admin", "ready", "replicas agree", "subscribers", "registry endpoints", "divergent", "audits", "repairs", "update p99"], s.control.map(c =>
    [c.cluster || "-", c.admin, {v: c.up ? (c.ready ? "ready" : "not ready") : "down", cls: c.up && c.ready ? "ok" : "bad"}, {v: c.replicas_agree ? "yes" : "NO", cls: c.replicas_agree ? "ok" : "bad"}, c.subscribers ?? "-", c.registry_endpoints ?? "-", {v: c.divergent ?? "-", cls: c.divergent > 0 ? "bad" : ""}, c.audits ?? "-", c.repairs ?? "-", ms(c.update_p99_ms)]));
  document.body.dataset.updates = String(Number(document.body.dataset.updates) + 1);
  document.body.dataset.samples = String(s.samples);
}

async function poll() {
  try {
    const rsp = await fetch("/api/state", {cache: "no-store"});
    render(await rsp.json());
  } catch (e) {
    const status = document.getElementById("status");
    status.textContent = "dashboard unreachable: " + e;
    status.className = "status bad";
  }
  setTimeout(poll, POLL_MS);
}
poll();
