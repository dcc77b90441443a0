// pagedserve engine dashboard: reads /dashboard/api/stream (server-sent events over fetch, so the
// API key can travel as a header) and draws the step timeline, the KV block map and request lanes.
"use strict";

const SVGNS = "http://www.w3.org/2000/svg";
const MAX_STEPS = 160;      // bars in the timeline
const MAX_LANES = 24;       // requests in the lanes view
const STATE_COLORS = { free: "#e5e7eb", shared: "#7c3aed", cached: "#86efac" };

const state = {
  steps: [],                // the last MAX_STEPS step records
  requests: new Map(),      // request id -> lane data, insertion = first-seen order
  stepsSeen: 0, blockMapsSeen: 0, lastUsedBlocks: 0, lastBlocks: null, lastStats: null,
  rate: [],                 // [time, steps, tokens] of recent steps for the per-second tiles
};
window.__dashboard = state;  // read by the browser test

function $(id) { return document.getElementById(id); }
function el(tag, attrs, parent) {
  const e = document.createElementNS(SVGNS, tag);
  for (const k in attrs) e.setAttribute(k, attrs[k]);
  if (parent) parent.appendChild(e);
  return e;
}
function hue(i) { return `hsl(${(i * 47) % 360}, 65%, 52%)`; }
function pct(x) { return (100 * x).toFixed(1) + " %"; }

// ---- data -------------------------------------------------------------------------------------
function addStep(rec) {
  state.steps.push(rec);
  if (state.steps.length > MAX_STEPS) state.steps.shift();
  state.stepsSeen += 1;
  state.rate.push([rec.time + rec.duration_ms / 1000, rec.num_scheduled_tokens]);
  while (state.rate.length > 1 && state.rate[state.rate.length - 1][0] - state.rate[0][0] > 5) state.rate.shift();
  const end = rec.time + rec.duration_ms / 1000;
  for (const s of rec.scheduled) {
    let r = state.requests.get(s.request_id);
    if (!r) {
      r = { id: s.request_id, start: rec.time, queued_s: s.queued_s || 0, chunks: [], decodes: [], first: null,
            finish: null, finishT: null, prefixHit: s.prefix_hit_tokens || 0, prompt: s.num_prompt_tokens };
      state.requests.set(s.request_id, r);
      if (state.requests.size > 4 * MAX_LANES) state.requests.delete(state.requests.keys().next().value);
    }
    if (s.phase === "prefill") {
      r.chunks.push([rec.time, end, s.num_tokens]);
      if (r.first === null && s.num_computed_tokens + s.num_tokens >= s.num_prompt_tokens) r.first = end;
    } else {
      r.decodes.push([rec.time, end]);
      if (r.first === null) r.first = end;
    }
    r.last = end;
  }
  for (const f of rec.finished) {
    const r = state.requests.get(f.request_id);
    if (r) { r.finish = f.finish_reason; r.finishT = end; }
  }
  for (const id of rec.preempted) {
    const r = state.requests.get(id);
    if (r) r.preempted = (r.preempted || 0) + 1;
  }
}

// ---- views ------------------------------------------------------------------------------------
function drawTiles(stats) {
  $("model").textContent = stats.model || "";
  $("budget").textContent = `(${stats.token_budget} tokens)`;
  $("t-running").textContent = stats.num_running;
  $("t-waiting").textContent = stats.num_waiting;
  $("t-kv").textContent = pct(stats.kv_cache_usage);
  $("t-hit").textContent = stats.prefix_cache_queries ? pct(stats.prefix_cache_hits / stats.prefix_cache_queries) : "-";
  $("t-preempt").textContent = stats.num_preemptions;
  $("t-drafts").textContent = stats.spec_decode_num_draft_tokens
    ? pct(stats.spec_decode_num_accepted_tokens / stats.spec_decode_num_draft_tokens) : "-";
  const r = state.rate;
  if (r.length > 1) {
    const dt = r[r.length - 1][0] - r[0][0];
    const toks = r.slice(1).reduce((a, x) => a + x[1], 0);
    $("t-steps").textContent = dt > 0 ? ((r.length - 1) / dt).toFixed(1) : "-";
    $("t-tps").textContent = dt > 0 ? Math.round(toks / dt) : "-";
  }
}

function drawTimeline() {
  const svg = $("timeline");
  const W = svg.clientWidth || 1000, H = 200, pad = 28, top = 10;
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  const steps = state.steps;
  let ymax = 8, qmax = 4;
  for (const s of steps) {
    ymax = Math.max(ymax, s.num_scheduled_tokens);
    qmax = Math.max(qmax, s.num_running, s.num_waiting);
  }
  const budget = steps.length ? steps[steps.length - 1].token_budget : 0;
  if (budget && budget <= ymax * 1.25) ymax = Math.max(ymax, budget);
  const bw = (W - pad) / MAX_STEPS, y = v => H - pad + top - (v / ymax) * (H - pad), yq = v => H - pad + top - (v / qmax) * (H - pad);
  el("line", { x1: pad, x2: W, y1: y(0), y2: y(0), stroke: "#9ca3af" }, svg);
  el("text", { x: 2, y: y(ymax) + 8 }, svg).textContent = ymax;
  el("text", { x: 2, y: y(0) }, svg).textContent = "0";
  if (budget && budget <= ymax) {
    el("line", { x1: pad, x2: W, y1: y(budget), y2: y(budget), stroke: "#ef4444", "stroke-dasharray": "4 3" }, svg);
    el("text", { x: W - 90, y: y(budget) - 3 }, svg).textContent = `budget ${budget}`;
  }
  const run = [], wait = [];
  let bars = 0;
  steps.forEach((s, i) => {
    let pre = 0, dec = 0;
    for (const e of s.scheduled) { if (e.phase === "prefill") pre += e.num_tokens; else dec += e.num_tokens; }
    const x = pad + i * bw;
    const g = el("g", {}, svg);
    el("title", {}, g).textContent = `step ${s.step}: ${pre} prefill + ${dec} decode tokens, ${s.scheduled.length} requests, ${s.duration_ms.toFixed(1)} ms` +
      (s.preempted.length ? `, preempted ${s.preempted.join(" ")}` : "");
    if (dec) el("rect", { x, width: Math.max(1, bw - 1), y: y(dec), height: y(0) - y(dec), fill: "var(--decode)", class: "bar" }, g);
    if (pre) el("rect", { x, width: Math.max(1, bw - 1), y: y(dec + pre), height: y(dec) - y(dec + pre), fill: "var(--prefill)", class: "bar" }, g);
    if (s.preempted.length) el("text", { x, y: top + 8, fill: "#dc2626" }, g).textContent = "P";
    bars += (pre || dec) ? 1 : 0;
    run.push(`${x + bw / 2},${yq(s.num_running)}`);
    wait.push(`${x + bw / 2},${yq(s.num_waiting)}`);
  });
  if (run.length) {
    el("polyline", { points: run.join(" "), fill: "none", stroke: "var(--running)", "stroke-width": 1.5 }, svg);
    el("polyline", { points: wait.join(" "), fill: "none", stroke: "var(--waiting)", "stroke-width": 1.5 }, svg);
  }
  svg.dataset.bars = bars;
  $("steps-seen").textContent = `${state.stepsSeen} steps seen` + (steps.length ? `, last step ${steps[steps.length - 1].step}` : "");
}

function drawBlockMap(map) {
  const canvas = $("blockmap");
  const W = canvas.clientWidth || 1000, cell = map.num_blocks > 4000 ? 5 : map.num_blocks > 1500 ? 7 : 10;
  const cols = Math.max(1, Math.floor(W / cell)), rows = Math.ceil(map.num_blocks / cols);
  const dpr = window.devicePixelRatio || 1;
  canvas.style.height = rows * cell + "px";
  canvas.width = cols * cell * dpr; canvas.height = rows * cell * dpr;
  const ctx = canvas.getContext("2d");
  ctx.scale(dpr, dpr);
  const counts = [0, 0, 0, 0];
  for (let b = 0; b < map.num_blocks; b++) {
    const st = map.state[b], name = map.state_names[st];
    counts[st] += 1;
    ctx.fillStyle = name === "used" ? hue(map.owner[b]) : STATE_COLORS[name];
    ctx.fillRect((b % cols) * cell, Math.floor(b / cols) * cell, cell - 1, cell - 1);
  }
  state.lastBlocks = { map, cols, cell };
  state.lastUsedBlocks = counts[1] + counts[2];
  state.blockMapsSeen += 1;
  canvas.dataset.used = state.lastUsedBlocks;
  $("pool-info").textContent = `${map.num_blocks} blocks x ${map.block_size} tokens`;
  $("block-counts").textContent = map.state_names.map((n, i) => `${n} ${counts[i]}`).join(", ") + `, ${map.request_ids.length} requests hold blocks`;
}

function blockTip(ev) {
  const lb = state.lastBlocks;
  if (!lb) return;
  const r = ev.target.getBoundingClientRect();
  const b = Math.floor((ev.clientY - r.top) / lb.cell) * lb.cols + Math.floor((ev.clientX - r.left) / lb.cell);
  if (b < 0 || b >= lb.map.num_blocks) return;
  const o = lb.map.owner[b];
  $("block-tip").textContent = `block ${b}: ${lb.map.state_names[lb.map.state[b]]}, ref_cnt ${lb.map.ref_cnt[b]}` +
    (o >= 0 ? `, held by ${lb.map.request_ids[o]}` : "");
}

function drawLanes() {
  const svg = $("lanes");
  const lanes = [...state.requests.values()].slice(-MAX_LANES);
  const H = 14 * lanes.length + 24, W = svg.clientWidth || 1000, left = 150;
  svg.setAttribute("height", H);
  svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
  svg.replaceChildren();
  if (!lanes.length) return;
  const t0 = Math.min(...lanes.map(r => r.start - r.queued_s));
  const t1 = Math.max(...lanes.map(r => r.finishT || r.last || r.start)) + 1e-3;
  const x = t => left + (t - t0) / (t1 - t0) * (W - left - 70);
  el("text", { x: left, y: H - 4 }, svg).textContent = "0 s";
  el("text", { x: W - 110, y: H - 4 }, svg).textContent = `${(t1 - t0).toFixed(2)} s`;
  lanes.forEach((r, i) => {
    const yy = 4 + i * 14, g = el("g", { class: "lane" }, svg);
    el("title", {}, g).textContent = `${r.id}: ${r.prompt} prompt tokens (${r.prefixHit} from the prefix cache), ` +
      `${r.chunks.length} prefill chunk(s), ${r.decodes.length} decode steps` + (r.preempted ? `, preempted ${r.preempted}x` : "") +
      (r.finish ? `, finished: ${r.finish}` : "");
    el("text", { x: 2, y: yy + 9 }, g).textContent = r.id.length > 24 ? r.id.slice(0, 11) + "..." + r.id.slice(-10) : r.id;
    if (r.queued_s > 0) el("rect", { x: x(r.start - r.queued_s), y: yy + 3, width: Math.max(1, x(r.start) - x(r.start - r.queued_s)), height: 4, fill: "var(--queue)" }, g);
    for (const [a, b] of r.decodes) el("rect", { x: x(a), y: yy + 1, width: Math.max(1, x(b) - x(a)), height: 8, fill: "var(--decode)" }, g);
    for (const [a, b] of r.chunks) el("rect", { x: x(a), y: yy, width: Math.max(1.5, x(b) - x(a)), height: 10, fill: "var(--prefill)" }, g);
    if (r.first !== null) el("circle", { cx: x(r.first), cy: yy + 5, r: 3, fill: "#111827" }, g);
    if (r.finish) el("text", { x: x(r.finishT) + 4, y: yy + 9 }, g).textContent = r.finish;
  });
}

// ---- the stream -------------------------------------------------------------------------------
function setStatus(text, cls) { const s = $("status"); s.textContent = text; s.className = "status " + (cls || ""); }

function handle(event) {
  if (event.error) { state.engineError = event.error.message || String(event.error); setStatus("engine: " + state.engineError, "error"); return; }
  for (const rec of event.steps) addStep(rec);
  state.lastStats = event.stats;
  drawTiles(event.stats);
  if (event.steps.length || !state.stepsSeen) { drawTimeline(); drawLanes(); }
  if (event.blocks) drawBlockMap(event.blocks);
}

async function needsKey() {
  try { return (await (await fetch("/dashboard/api/auth")).json()).api_key_required; } catch (e) { return false; }
}

async function start() {
  if (!sessionStorage.getItem("pagedserve-key") && await needsKey()) {
    setStatus("API key needed", "error");
    $("keyform").hidden = false;
    return;
  }
  connect();
}

async function connect() {
  const key = sessionStorage.getItem("pagedserve-key");
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let resp;
  try {
    resp = await fetch("/dashboard/api/stream", { headers });
  } catch (e) {
    setStatus("disconnected, retrying", "error");
    setTimeout(connect, 2000);
    return;
  }
  if (resp.status === 401) {
    setStatus(key ? "wrong API key" : "API key needed", "error");
    $("keyform").hidden = false;
    return;
  }
  if (!resp.ok) {
    let why = `HTTP ${resp.status}`;
    try { why += ": " + (await resp.json()).error.message; } catch (e) { /* not a JSON body */ }
    setStatus(why + " (retrying)", "error");
    setTimeout(connect, 2000);
    return;
  }
  $("keyform").hidden = true;
  setStatus("live", "live");
  const reader = resp.body.getReader(), dec = new TextDecoder();
  let buf = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const chunk = buf.slice(0, i); buf = buf.slice(i + 2);
        for (const line of chunk.split("\n")) if (line.startsWith("data: ")) handle(JSON.parse(line.slice(6)));
      }
    }
  } catch (e) { /* the server went away: reconnect below */ }
  setStatus(state.engineError ? `engine: ${state.engineError} (retrying)` : "disconnected, retrying", "error");
  setTimeout(connect, 2000);
}

$("keyform").addEventListener("submit", ev => {
  ev.preventDefault();
  sessionStorage.setItem("pagedserve-key", $("key").value);
  connect();
});
$("blockmap").addEventListener("mousemove", blockTip);
start();
