// servescope dashboard: reads /v1/internals/stream (server-sent events over fetch, so that the API key
// can go in a header) and draws each panel on a canvas. Every string from the server is set with
// textContent or drawn on a canvas, never parsed as HTML.
"use strict";

const MAX_STEPS = 600;      // steps kept for the timeline, roofline and usage charts
const MAX_POINTS = 300;     // throughput samples kept (one per frame)
const COLORS = { prefill: "#e8833a", decode: "#3a7de8", mixed: "#9b59b6", free: "#e6e8eb", evictable: "#f1df8c" };

const state = {
  info: null, steps: [], lastStep: 0, frame: null, rates: [], prev: null, dropped: 0,
  sawSpec: false, sawComm: false, sawMoe: false,
};

function $(id) { return document.getElementById(id); }

// ---------------------------------------------------------------- the stream
function apiKey() {
  const m = /(?:^|[#&])key=([^&]*)/.exec(location.hash);
  if (m) { sessionStorage.setItem("servescope-key", decodeURIComponent(m[1])); }
  return sessionStorage.getItem("servescope-key");
}

function setConn(on, text) {
  $("conn").className = "dot " + (on ? "on" : "off");
  $("conn-text").textContent = text;
}

async function connect() {
  const key = apiKey();
  const headers = key ? { Authorization: "Bearer " + key } : {};
  let resp;
  try {
    // one write a second (the frames in between come together): the page draws about that often
    resp = await fetch("/v1/internals/stream?interval=" + MIN_DRAW_MS / 1000, { headers, cache: "no-store" });
  } catch (e) {
    setConn(false, "server unreachable, retrying…");
    return retry();
  }
  if (resp.status === 401) {
    setConn(false, key ? "wrong API key" : "API key needed");
    $("keyform").classList.remove("hidden");
    return;
  }
  if (!resp.ok) {
    setConn(false, "server answered " + resp.status + ", retrying…");
    return retry();
  }
  $("keyform").classList.add("hidden");
  setConn(true, "live");
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    let chunk;
    try { chunk = await reader.read(); } catch (e) { break; }
    if (chunk.done) break;
    buf += decoder.decode(chunk.value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const block = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      onBlock(block);
    }
  }
  if (!state.closed) { setConn(false, "disconnected, retrying…"); retry(); }
}

function retry() { setTimeout(connect, 2000); }

function onBlock(block) {
  let event = "message", data = "";
  for (const line of block.split("\n")) {
    if (line.startsWith("event: ")) event = line.slice(7);
    else if (line.startsWith("data: ")) data += line.slice(6);
  }
  if (!data) return;  // a keep-alive comment
  const msg = JSON.parse(data);
  if (event === "hello") { state.info = msg; showInfo(msg); onFrame(msg.frame); }
  else if (event === "frame") onFrame(msg);
  else if (event === "dropped") state.dropped = msg.frames;
  else if (event === "closed") { state.closed = true; setConn(false, "engine stopped: " + msg.reason); }
}

function showInfo(info) {
  const hw = info.hardware ? " · roofline of " + info.hardware.name : "";
  const what = info.source === "replay" ? "replay of " + info.trace + " (" + info.speed + "× speed)" : "live engine";
  $("what").textContent = what + " · " + info.model + hw;
}

function onFrame(f) {
  for (const s of f.steps) {
    if (s.step <= state.lastStep) continue;  // the hello's history and the first frame overlap
    state.steps.push(s);
    state.lastStep = s.step;
    if (s.spec_proposed !== undefined) state.sawSpec = true;
    if (s.comm_seconds !== undefined) state.sawComm = true;
    if (s.moe_tokens !== undefined) state.sawMoe = true;
  }
  if (state.steps.length > MAX_STEPS) state.steps.splice(0, state.steps.length - MAX_STEPS);
  if (state.prev && f.time > state.prev.time) {
    const dt = f.time - state.prev.time;
    state.rates.push({
      t: f.time,
      decode: (f.totals.decode_tokens - state.prev.totals.decode_tokens) / dt,
      prefill: (f.totals.prefill_tokens - state.prev.totals.prefill_tokens) / dt,
      steps: (f.last_step - state.prev.last_step) / dt,
    });
    if (state.rates.length > MAX_POINTS) state.rates.shift();
  }
  state.prev = f;
  state.frame = f;
  schedule();
}

// Drawing costs CPU, and on a small server the browser shares its cores with the engine. So the page
// keeps its own drawing under about 1/DRAW_BUDGET of one core: after a draw that took d ms it waits at
// least DRAW_BUDGET * d ms (between MIN_DRAW_MS and MAX_DRAW_MS) before the next, and always draws the
// newest frame once it arrives (the wait delays it, never drops it).
const DRAW_BUDGET = 40, MIN_DRAW_MS = 1000, MAX_DRAW_MS = 3000;
let pending = false, lastDraw = -Infinity, drawGap = MIN_DRAW_MS;
function schedule() {
  if (pending) return;
  pending = true;
  const wait = Math.max(0, lastDraw + drawGap - performance.now());
  setTimeout(() => requestAnimationFrame(() => {
    pending = false;
    const t0 = performance.now();
    draw();
    lastDraw = performance.now();
    drawGap = Math.min(MAX_DRAW_MS, Math.max(MIN_DRAW_MS, DRAW_BUDGET * (lastDraw - t0)));
  }), wait);
}

// ---------------------------------------------------------------- drawing helpers
function canvas(id) {
  const c = $(id), dpr = window.devicePixelRatio || 1;
  if (!c._h) { c._h = c.height; c.style.height = c._h + "px"; }  // the height attribute is the CSS height
  const w = c.clientWidth;
  if (c._w !== w || c._dpr !== dpr) {
    c._w = w; c._dpr = dpr;
    c.width = Math.max(1, Math.round(w * dpr)); c.height = Math.round(c._h * dpr);
  }
  const ctx = c.getContext("2d");
  ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
  ctx.clearRect(0, 0, w, c._h);
  ctx.font = "11px system-ui, sans-serif";
  return { ctx, w, h: c._h };
}

function fmt(x, unit) {
  if (x === null || x === undefined || !isFinite(x)) return "–";
  const a = Math.abs(x);
  const [d, s] = a >= 1e12 ? [1e12, "T"] : a >= 1e9 ? [1e9, "G"] : a >= 1e6 ? [1e6, "M"] : a >= 1e3 ? [1e3, "k"] : [1, ""];
  const v = x / d;
  return (Math.abs(v) >= 100 ? v.toFixed(0) : Math.abs(v) >= 10 ? v.toFixed(1) : v.toFixed(2)) + s + (unit || "");
}

function fmtMs(ms) {
  if (ms === null || ms === undefined || !isFinite(ms)) return "–";
  return ms >= 1000 ? (ms / 1000).toFixed(ms >= 10000 ? 0 : 1) + " s" : ms >= 10 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms";
}

function hue(id) {  // one stable colour per request id, the same in the block map and the queues
  let h = 2166136261;  // FNV-1a, then the golden angle: ids that differ in one digit look different
  for (let i = 0; i < id.length; i++) h = Math.imul(h ^ id.charCodeAt(i), 16777619) >>> 0;
  // hues 40..80 (yellows) are left to the evictable blocks
  return "hsl(" + (80 + Math.round((h % 1000) * 137.508) % 320) % 360 + ", 60%, " + (42 + (h >> 10) % 15) + "%)";
}

function axes(ctx, x0, y0, x1, y1, xlabel, ylabel) {
  ctx.strokeStyle = "#9aa1ad"; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(x0, y0); ctx.lineTo(x0, y1); ctx.lineTo(x1, y1); ctx.stroke();
  ctx.fillStyle = "#5b6475";
  if (xlabel) { ctx.textAlign = "right"; ctx.fillText(xlabel, x1, y1 + 26); }
  if (ylabel) { ctx.save(); ctx.translate(10, y0); ctx.rotate(-Math.PI / 2); ctx.textAlign = "right";
                ctx.fillText(ylabel, 0, 0); ctx.restore(); }
}

function empty(ctx, w, h, text) {
  ctx.fillStyle = "#9aa1ad"; ctx.textAlign = "center"; ctx.fillText(text, w / 2, h / 2);
}

function lineChart(id, series, opts) {
  const { ctx, w, h } = canvas(id);
  const L = 70, R = 8, T = 8, B = 18;
  const n = Math.max(...series.map(s => s.values.length), 0);
  if (n < 2) return empty(ctx, w, h, opts.empty || "waiting for data…");
  const ymax = opts.ymax || Math.max(1e-9, ...series.flatMap(s => s.values.filter(isFinite))) * 1.1;
  axes(ctx, L, T, w - R, h - B, "", "");
  ctx.fillStyle = "#5b6475"; ctx.textAlign = "right";
  ctx.fillText(opts.fmt(ymax), L - 4, T + 8); ctx.fillText(opts.fmt(0), L - 4, h - B);
  if (opts.xlabel) ctx.fillText(opts.xlabel, w - R, h - 4);
  for (const s of series) {
    ctx.strokeStyle = s.color; ctx.lineWidth = 1.6; ctx.beginPath();
    s.values.forEach((v, i) => {
      const x = L + (w - L - R) * i / (n - 1), y = h - B - (h - B - T) * Math.min(1, (v || 0) / ymax);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
  }
}

// ---------------------------------------------------------------- panels
function drawTimeline() {
  const { ctx, w, h } = canvas("c-timeline");
  const L = 66, R = 8, T = 10, B = 30;
  const n = Math.min(state.steps.length, Math.max(20, Math.floor((w - L - R) / 4)));
  const steps = state.steps.slice(-n);
  if (!steps.length) return empty(ctx, w, h, "no steps yet: send the server a request");
  const vals = steps.map(s => Math.max(s.ms, s.pred_ms || 0)).sort((a, b) => a - b);
  const ymax = Math.max(1e-3, vals[Math.floor(0.98 * (vals.length - 1))] * 1.15);
  const bw = (w - L - R) / n, y = v => h - B - (h - B - T) * Math.min(1, v / ymax);
  axes(ctx, L, T, w - R, h - B, "step " + steps[0].step + " … " + steps[steps.length - 1].step, "ms per step");
  ctx.fillStyle = "#5b6475"; ctx.textAlign = "right";
  ctx.fillText(fmtMs(ymax), L - 4, T + 8); ctx.fillText("0", L - 4, h - B);
  steps.forEach((s, i) => {
    const x = L + i * bw;
    ctx.fillStyle = COLORS[s.phase] || "#888";
    ctx.fillRect(x + 0.5, y(s.ms), Math.max(1, bw - 1), h - B - y(s.ms));
    if (s.pred_ms !== null && s.pred_ms !== undefined) {
      ctx.fillStyle = "#111"; ctx.fillRect(x, y(s.pred_ms) - 1, Math.max(2, bw), 2);
    }
  });
}

function drawRoofline() {
  const { ctx, w, h } = canvas("c-roofline");
  const hw = state.info && state.info.hardware;
  const pts = state.steps.filter(s => s.flops > 0 && s.bytes > 0 && s.ms > 0).slice(-300)
    .map(s => ({ ai: s.flops / s.bytes, fps: s.flops / (s.ms / 1e3), phase: s.phase }));
  if (!pts.length) return empty(ctx, w, h, "no steps with a cost-model annotation yet");
  const L = 66, R = 10, T = 10, B = 34;
  let xs = pts.map(p => p.ai), ys = pts.map(p => p.fps);
  if (hw) { xs.push(hw.ridge); ys.push(hw.peak_flops); }
  const lx0 = Math.floor(Math.log10(Math.min(...xs)) - 0.3), lx1 = Math.ceil(Math.log10(Math.max(...xs)) + 0.3);
  const ly0 = Math.floor(Math.log10(Math.min(...ys)) - 0.3), ly1 = Math.ceil(Math.log10(Math.max(...ys)) + 0.2);
  const X = v => L + (w - L - R) * (Math.log10(v) - lx0) / (lx1 - lx0);
  const Y = v => h - B - (h - B - T) * (Math.log10(v) - ly0) / (ly1 - ly0);
  axes(ctx, L, T, w - R, h - B, "arithmetic intensity (FLOP per byte), log", "achieved FLOP/s, log");
  ctx.fillStyle = "#5b6475"; ctx.textAlign = "center";
  for (let e = lx0; e <= lx1; e++) ctx.fillText(fmt(10 ** e), X(10 ** e), h - B + 12);
  ctx.textAlign = "right";
  for (let e = ly0; e <= ly1; e++) ctx.fillText(fmt(10 ** e), L - 4, Y(10 ** e) + 4);
  if (hw) {
    ctx.save(); ctx.beginPath(); ctx.rect(L, T, w - L - R, h - B - T); ctx.clip();
    ctx.strokeStyle = "#1d2330"; ctx.lineWidth = 2; ctx.beginPath();
    ctx.moveTo(X(10 ** lx0), Y(10 ** lx0 * hw.bandwidth)); ctx.lineTo(X(hw.ridge), Y(hw.peak_flops));
    ctx.lineTo(X(10 ** lx1), Y(hw.peak_flops)); ctx.stroke();
    ctx.setLineDash([4, 4]); ctx.strokeStyle = "#d9534f"; ctx.beginPath();
    ctx.moveTo(X(hw.ridge), T); ctx.lineTo(X(hw.ridge), h - B); ctx.stroke(); ctx.restore();
    ctx.fillStyle = "#d9534f"; ctx.textAlign = "left";
    ctx.fillText("ridge point " + fmt(hw.ridge) + " FLOP/B", X(hw.ridge) + 4, T + 10);
    ctx.fillStyle = "#5b6475";
    ctx.fillText("← memory-bound", L + 4, T + 24);
    ctx.textAlign = "right"; ctx.fillText("compute-bound →", w - R - 4, T + 24);
    ctx.fillText("peak " + fmt(hw.peak_flops, "FLOP/s") + ", " + fmt(hw.bandwidth, "B/s"), w - R - 4, Y(hw.peak_flops) + 14);
  }
  pts.forEach((p, i) => {
    ctx.globalAlpha = 0.25 + 0.75 * (i + 1) / pts.length;
    ctx.fillStyle = COLORS[p.phase] || "#888";
    ctx.beginPath(); ctx.arc(X(p.ai), Y(p.fps), 3.2, 0, 2 * Math.PI); ctx.fill();
  });
  ctx.globalAlpha = 1;
}

function drawBlocks(kv) {
  const { ctx, w, h } = canvas("c-blocks");
  $("kv-bs").textContent = kv.block_size === null ? "?" : kv.block_size;
  $("kv-note").textContent = kv.synthetic ? "A recorded trace keeps only the counts: blocks are drawn in order, not where they were."
    : kv.groups ? "A table per group of layers, one after the other: " + kv.groups.map(
      (g) => (g.window ? "window " + g.window : "full") + " " + g.blocks).join(", ") : "";
  const c = kv.counts;
  $("kv-free").textContent = c.free; $("kv-used").textContent = c.used + c.cached;
  $("kv-cached").textContent = c.cached; $("kv-evictable").textContent = c.evictable;
  $("kv-total").textContent = kv.num_blocks;
  const n = kv.num_blocks;
  let size = Math.max(1, Math.floor(Math.sqrt((w * h) / n)));
  while (size > 1 && Math.floor(w / size) * Math.floor(h / size) < n) size--;
  const cols = Math.max(1, Math.floor(w / size)), gap = size >= 5 ? 1 : 0;
  const owner = new Int32Array(n).fill(-1);
  let b = 0;
  for (const [o, run] of kv.owners) { owner.fill(o, b, b + run); b += run; }
  const colors = kv.requests.map(hue);
  for (let i = 0; i < n; i++) {
    const st = kv.states.charCodeAt(i) - 48, x = (i % cols) * size, y = Math.floor(i / cols) * size;
    if (y >= h) break;
    ctx.fillStyle = st === 0 ? COLORS.free : st === 3 ? COLORS.evictable : (colors[owner[i]] || "#5aa469");
    ctx.fillRect(x, y, size - gap, size - gap);
    if (st === 2 && size >= 5) {
      ctx.fillStyle = "#1d2330";
      ctx.beginPath(); ctx.arc(x + (size - gap) / 2, y + (size - gap) / 2, Math.max(1, size / 6), 0, 2 * Math.PI); ctx.fill();
    }
  }
}

function fillQueue(name, q) {
  $("q-" + name + "-n").textContent = q.count;
  const ol = $("q-" + name), items = [];
  for (const e of q.entries) {
    const li = document.createElement("li");
    li.style.borderLeftColor = hue(e.id);
    const rid = document.createElement("span"); rid.className = "rid"; rid.textContent = e.id;
    const tok = document.createElement("span"); tok.className = "tok";
    tok.textContent = e.prompt_tokens + " prompt · " + e.output_tokens + " out";
    const prompt = e.prompt == null ? "(prompt hidden: the server shows previews only behind its API key)" : e.prompt;
    const pr = document.createElement("div"); pr.className = "prompt"; pr.textContent = prompt;
    li.title = e.id + ": " + prompt;
    li.append(rid, tok, pr);
    items.push(li);
  }
  if (q.count > q.entries.length) {
    const li = document.createElement("li"); li.textContent = "… and " + (q.count - q.entries.length) + " more";
    items.push(li);
  }
  ol.replaceChildren(...items);
}

function median(counts, edges) {
  const total = counts.reduce((a, b) => a + b, 0);
  if (!total) return null;
  let acc = 0;
  for (let i = 0; i < counts.length; i++) {
    acc += counts[i];
    if (acc >= total / 2) return i === 0 ? edges[0] : i >= edges.length ? edges[edges.length - 1]
      : Math.sqrt(edges[i - 1] * edges[i]);
  }
  return null;
}

function drawHist(id, counts, edges, label) {
  const { ctx, w, h } = canvas("c-" + id);
  const med = median(counts, edges);
  $("m-" + id).textContent = med === null ? "" : "median ≈ " + fmtMs(med);
  let lo = counts.findIndex(c => c > 0), hi = counts.length - 1 - [...counts].reverse().findIndex(c => c > 0);
  if (lo < 0) return empty(ctx, w, h, "no finished requests yet");
  lo = Math.max(0, lo - 1); hi = Math.min(counts.length - 1, hi + 1);
  const L = 8, R = 8, T = 6, B = 26, n = hi - lo + 1, bw = (w - L - R) / n;
  const cmax = Math.max(...counts.slice(lo, hi + 1));
  axes(ctx, L, T, w - R, h - B, "", "");
  for (let i = lo; i <= hi; i++) {
    const bh = (h - B - T) * counts[i] / cmax, x = L + (i - lo) * bw;
    ctx.fillStyle = label === "itl" ? "#5aa469" : label === "ttft" ? COLORS.prefill : COLORS.decode;
    ctx.fillRect(x + 1, h - B - bh, bw - 2, bh);
  }
  ctx.fillStyle = "#5b6475"; ctx.textAlign = "left";
  ctx.fillText(lo === 0 ? "<" + fmtMs(edges[0]) : fmtMs(edges[lo - 1]), L, h - B + 12);
  ctx.textAlign = "right";
  ctx.fillText(hi >= edges.length ? "≥" + fmtMs(edges[edges.length - 1]) : fmtMs(edges[hi]), w - R, h - B + 12);
  ctx.textAlign = "center"; ctx.fillText("(log scale)", w / 2, h - B + 12);
  if (med !== null) {
    const pos = Math.log10(med) * 4 + 4 - lo + 1;  // bucket coordinates: 4 edges per decade from 0.1 ms
    const x = L + Math.min(n, Math.max(0, pos)) * bw;
    ctx.strokeStyle = "#111"; ctx.setLineDash([3, 3]); ctx.beginPath(); ctx.moveTo(x, T); ctx.lineTo(x, h - B); ctx.stroke();
    ctx.setLineDash([]);
  }
}

function drawHeadline(f) {
  const r = state.rates.slice(-4), avg = k => r.length ? r.reduce((a, p) => a + p[k], 0) / r.length : null;
  $("h-tps").textContent = fmt(avg("decode"));
  $("h-ptps").textContent = fmt(avg("prefill"));
  $("h-sps").textContent = fmt(avg("steps"));
  $("h-kv").textContent = (100 * f.kv_state.usage).toFixed(1) + "%";
  $("h-req").textContent = f.queues.running.count + " · " + f.queues.waiting.count;
  const foot = "servescope dashboard · data from /v1/internals/stream · step " + f.last_step +
    (f.steps_dropped ? " · " + f.steps_dropped + " steps skipped in the last update" : "") +
    (state.dropped ? " · " + state.dropped + " updates dropped (this page fell behind)" : "");
  $("foot").textContent = foot;
}

function drawOptional() {
  if (state.sawSpec) {
    $("panel-spec").classList.remove("hidden");
    const s = state.steps.filter(x => x.spec_proposed > 0);
    lineChart("c-spec", [{ color: "#5aa469", values: s.map(x => x.spec_accepted / x.spec_proposed) }],
      { ymax: 1, fmt: v => (100 * v).toFixed(0) + "%" });
  }
  if (state.sawComm) {
    $("panel-comm").classList.remove("hidden");
    const s = state.steps.filter(x => x.comm_seconds !== undefined && x.ms > 0);
    lineChart("c-comm", [{ color: COLORS.mixed, values: s.map(x => x.comm_seconds * 1e3 / x.ms) }],
      { ymax: 1, fmt: v => (100 * v).toFixed(0) + "%" });
  }
}

const MOE_LOAD_STEPS = 100;  // steps summed in the tokens-per-expert bars

function drawExperts() {
  const steps = state.steps.filter(s => s.moe_tokens !== undefined);
  if (!steps.length) return;
  $("panel-moe").classList.remove("hidden");
  lineChart("c-moe-active", [
    { color: COLORS.decode, values: steps.map(s => s.moe_active) },
    { color: "#111", values: steps.map(s => s.moe_expected) }],
    { fmt: v => v.toFixed(1), xlabel: "the last " + steps.length + " MoE steps, newest right" });
  const recent = steps.slice(-MOE_LOAD_STEPS), E = recent[recent.length - 1].moe_tokens.length;
  const load = new Array(E).fill(0);
  for (const s of recent) s.moe_tokens.forEach((n, e) => { load[e] += n; });
  $("moe-experts").textContent = E;
  $("moe-window").textContent = recent.length;
  $("moe-imbalance").textContent = fmt(recent[recent.length - 1].moe_imbalance) + "×";
  const { ctx, w, h } = canvas("c-moe-load");
  const L = 40, R = 8, T = 8, B = 18, top = Math.max(1, ...load), bw = (w - L - R) / E;
  const y = v => h - B - (h - B - T) * v / top;
  axes(ctx, L, T, w - R, h - B, "expert 0 … " + (E - 1), "");
  ctx.fillStyle = "#5b6475"; ctx.textAlign = "right"; ctx.fillText(fmt(top), L - 4, T + 8); ctx.fillText("0", L - 4, h - B);
  // expert parallelism: rank r holds experts [r E/N, (r + 1) E/N), shaded alternately, with its share of the rows
  const ep = recent.filter(s => Array.isArray(s.moe_rank_rows)), N = ep.length ? ep[ep.length - 1].moe_rank_rows.length : 0;
  const rankOf = e => N ? Math.floor(e * N / E) : 0;
  load.forEach((n, e) => {
    ctx.fillStyle = rankOf(e) % 2 ? COLORS.decode : COLORS.mixed;
    ctx.fillRect(L + e * bw + (bw > 3 ? 0.5 : 0), y(n), Math.max(1, bw - (bw > 3 ? 1 : 0)), h - B - y(n));
  });
  const even = load.reduce((a, b) => a + b, 0) / E;
  ctx.strokeStyle = "#111"; ctx.setLineDash([4, 3]); ctx.beginPath(); ctx.moveTo(L, y(even)); ctx.lineTo(w - R, y(even));
  ctx.stroke(); ctx.setLineDash([]);
  $("moe-ep").classList.toggle("hidden", !N);
  if (N) drawRanks(ep, N);
}

function drawRanks(ep, N) {
  // rows each rank's experts ran over the same steps, the busiest over the mean, the all-to-alls' share of the time
  const rows = new Array(N).fill(0);
  let a2a = 0, ms = 0;
  for (const s of ep) {
    s.moe_rank_rows.forEach((n, r) => { rows[r] += n; });
    a2a += s.a2a_ms || 0; ms += s.ms || 0;
  }
  const mean = rows.reduce((a, b) => a + b, 0) / N;
  $("moe-ep-ranks").textContent = N;
  $("moe-ep-rows").textContent = rows.map(v => v >= 1000 ? fmt(v) : String(v)).join(" / ");
  $("moe-ep-imbalance").textContent = mean > 0 ? fmt(Math.max(...rows) / mean) + "×" : "–";
  $("moe-ep-a2a").textContent = ms > 0 ? (100 * a2a / ms).toFixed(0) + "%" : "–";
}

function draw() {
  const f = state.frame;
  if (!f || document.hidden) return;
  drawHeadline(f);
  drawTimeline();
  drawRoofline();
  drawBlocks(f.kv);
  lineChart("c-kvusage", [{ color: "#5aa469", values: state.steps.map(s => s.kv_usage) }],
    { ymax: 1, fmt: v => (100 * v).toFixed(0) + "%" });
  for (const q of ["running", "waiting", "preempted"]) fillQueue(q, f.queues[q]);
  $("lat-n").textContent = f.latency.finished;
  for (const k of ["ttft", "tpot", "itl"]) drawHist(k, f.latency[k], f.latency.edges_ms, k);
  lineChart("c-throughput", [
    { color: COLORS.decode, values: state.rates.map(r => r.decode) },
    { color: COLORS.prefill, values: state.rates.map(r => r.prefill) }],
    { fmt: v => fmt(v, " tok/s"), xlabel: "the last " + state.rates.length + " updates, newest right" });
  drawOptional();
  if (state.sawMoe) drawExperts();
  document.body.dataset.lastStep = f.last_step;  // for tests: the newest step drawn
}

window.addEventListener("resize", schedule);
document.addEventListener("visibilitychange", schedule);
document.addEventListener("DOMContentLoaded", () => {
  $("keyform").addEventListener("submit", ev => {
    ev.preventDefault();
    sessionStorage.setItem("servescope-key", $("key").value);
    connect();
  });
  connect();
});
