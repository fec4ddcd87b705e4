// specdec playground: chat against the server and show where each token came from (the `specdec_trace`
// extension of the SSE chunks, docs/server.md). No build step, no dependencies.
"use strict";

const $ = (id) => document.getElementById(id);
const PALETTE = ["#2e7d32", "#1565c0", "#8e24aa", "#00838f", "#c2185b", "#6d4c41", "#ef6c00"];
const ORIGINS = { correction: "#ffb86b", bonus: "#a98bff", target: "#cfcfcf" };
const state = { history: [], colours: {}, controller: null, drafters: [] };

// -- HTTP -------------------------------------------------------------------------------------------

class ApiError extends Error {}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = localStorage.getItem("specdec.key");
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

/** A readable message for a failed response. */
async function failure(res) {
  let detail = "";
  try { detail = (await res.json()).error.message; } catch (e) { detail = res.statusText; }
  if (res.status === 429) return "The server is busy (429): every slot and the queue are full. Try again in a moment.";
  if (res.status === 401) return "The server needs an API key (401): enter it in the API key field.";
  return `Request failed (${res.status}): ${detail}`;
}

async function getJSON(path) {
  const res = await fetch(path, { headers: headers() });
  if (!res.ok) throw new ApiError(await failure(res));
  return res.json();
}

/** POST a streaming chat completion; call onChunk for each SSE data object; return the last one. */
async function streamChat(body, onChunk, signal) {
  const init = { method: "POST", headers: headers(), body: JSON.stringify(body), signal };
  const res = await fetch("/v1/chat/completions", init);
  if (!res.ok) throw new ApiError(await failure(res));
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buf = "", last = null;
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      if (!event.startsWith("data: ")) continue;
      const data = event.slice(6);
      if (data === "[DONE]") return last;
      const obj = JSON.parse(data);
      if (obj.error) throw new ApiError(`The request failed: ${obj.error.message}`);
      onChunk(obj);
      last = obj;
    }
  }
  return last;
}

// -- errors -----------------------------------------------------------------------------------------

function showError(msg) { $("error").textContent = msg; $("error").hidden = false; }
function clearError() { $("error").hidden = true; }

// -- drafters and request body ------------------------------------------------------------------------

function colour(drafter) {
  if (!(drafter in state.colours)) state.colours[drafter] = PALETTE[Object.keys(state.colours).length % PALETTE.length];
  return state.colours[drafter];
}

async function loadServer() {
  try {
    const models = await getJSON("/v1/models");
    $("model").textContent = "model: " + models.data[0].id;
    const info = await getJSON("/v1/drafters");
    state.drafters = info.types;
    const select = $("drafter");
    select.length = 1;
    select.options[0].textContent = `server default (${info.server.type})`;
    select.add(new Option("none (plain decoding)", "none"));
    for (const t of info.types) {
      const needs = t.draft_model && !info.server.draft_model ? " (needs -md)"
        : t.target_features ? " (needs a head)" : "";
      select.add(new Option(t.name + needs, t.name));
    }
    clearError();
  } catch (e) {
    showError(e.message);
  }
  describeDrafter();
  drawLegend();
}

function describeDrafter() {
  const t = state.drafters.find((d) => d.name === $("drafter").value);
  const el = $("drafter-help");
  el.textContent = "";
  if (!t) return;
  const head = document.createElement("div");
  head.textContent = t.help;
  el.append(head);
  for (const o of t.options) {
    const line = document.createElement("div");
    if (o.per_request) {  // a model-free drafter's numeric option: this request may set it
      const label = document.createElement("label");
      const input = document.createElement("input");
      input.className = "drafter-option";
      input.dataset.name = o.name;
      input.dataset.server = JSON.stringify(o.value);
      input.value = Array.isArray(o.value) ? o.value.join(",") : o.value;
      input.size = 8;
      label.append(`${o.flag} `, input);
      line.append(label, ` ${o.help}`);
    } else {
      line.textContent = `${o.flag} = ${JSON.stringify(o.value)} (set at server start): ${o.help}`;
    }
    el.append(line);
  }
}

/** The drafter options changed from the server's values (sent as `speculative.options`). */
function drafterOptions() {
  const out = {};
  for (const input of document.querySelectorAll(".drafter-option")) {
    const server = JSON.parse(input.dataset.server);
    const text = input.value.trim();
    if (text === "" || text === String(Array.isArray(server) ? server.join(",") : server)) continue;
    out[input.dataset.name] = Array.isArray(server) ? text.split(",").map(Number) : Number(text);
  }
  return out;
}

/** The `speculative` field: false (plain), a type/chain with draft_max, or undefined (the server's). */
function speculative(on) {
  if (!on) return false;
  const chain = $("chain").value.trim();
  const type = chain || ($("drafter").value === "server" ? null : $("drafter").value);
  if (type === "none") return false;
  const spec = {};
  if (type) spec.type = type;
  if ($("draft_max").value) spec.draft_max = parseInt($("draft_max").value, 10);
  const options = drafterOptions();
  if (Object.keys(options).length) spec.options = options;
  return Object.keys(spec).length ? spec : true;
}

function requestBody(messages, spec) {
  const body = { messages, stream: true, specdec_trace: true, speculative: spec,
                 temperature: parseFloat($("temperature").value || "0"),
                 max_tokens: parseInt($("max_tokens").value || "128", 10) };
  if ($("seed").value !== "") body.seed = parseInt($("seed").value, 10);
  return body;
}

// -- statistics -----------------------------------------------------------------------------------

/** Counts over one answer's trace: steps (accepted, drafted), tokens, time since the first token. */
class Tally {
  constructor() { this.tokens = 0; this.steps = new Map(); this.t0 = null; this.t1 = null; this.final = null; }

  add(entry) {
    const now = performance.now();
    if (this.t0 === null) this.t0 = now;
    this.t1 = now;
    this.tokens += 1;
    const s = this.steps.get(entry.step) || { accepted: 0, drafted: null };
    if (entry.origin === "draft") s.accepted += 1;
    else s.drafted = entry.drafted;
    this.steps.set(entry.step, s);
  }

  /** Speculation steps (the prefill, step 0, excluded) whose draft size is known. */
  spec() { return [...this.steps].filter(([k, s]) => k > 0 && s.drafted !== null).map(([, s]) => s); }

  summary() {
    if (this.final) {
      const f = this.final;
      return { tps: f.timings.predicted_per_second, acc: f.speculative.acceptance_rate,
               mal: f.speculative.mean_accept_len, dps: f.timings.draft_n / Math.max(1, this.steps.size - 1) };
    }
    const spec = this.spec();
    const drafted = spec.reduce((a, s) => a + s.drafted, 0), accepted = spec.reduce((a, s) => a + s.accepted, 0);
    const secs = this.t0 === null ? 0 : (this.t1 - this.t0) / 1000;
    return { tps: secs > 0 ? (this.tokens - 1) / secs : null, acc: drafted ? accepted / drafted : null,
             mal: this.steps.size ? this.tokens / this.steps.size : null,
             dps: spec.length ? drafted / spec.length : null };
  }

  /** Per draft position: accepted / drafted. */
  byPosition() {
    const drafted = [], accepted = [];
    for (const s of this.spec()) {
      for (let i = 0; i < s.drafted; i++) {
        drafted[i] = (drafted[i] || 0) + 1;
        accepted[i] = (accepted[i] || 0) + (i < s.accepted ? 1 : 0);
      }
    }
    return drafted.map((d, i) => accepted[i] / d);
  }
}

const fmt = (x, digits) => (x === null || x === undefined || Number.isNaN(x) ? "-" : x.toFixed(digits));

function showStats(tally) {
  const s = tally.summary();
  $("stat-tps").textContent = fmt(s.tps, 1);
  $("stat-acc").textContent = s.acc === null ? "-" : (100 * s.acc).toFixed(1) + "%";
  $("stat-mal").textContent = fmt(s.mal, 2);
  $("stat-dps").textContent = fmt(s.dps, 2);
  drawChart(tally.byPosition());
}

function drawChart(rates) {
  const c = $("chart"), g = c.getContext("2d");
  const w = c.width, h = c.height, pad = 16;
  g.clearRect(0, 0, w, h);
  g.fillStyle = "#888";
  g.font = "10px sans-serif";
  g.fillText("100%", 0, 10);
  g.fillText("0", 0, h - pad + 4);
  g.strokeStyle = "#ddd";
  g.beginPath(); g.moveTo(26, 4); g.lineTo(26, h - pad); g.lineTo(w, h - pad); g.stroke();
  const n = Math.max(rates.length, 1), bw = (w - 30) / n;
  rates.forEach((r, i) => {
    const bh = r * (h - pad - 6);
    g.fillStyle = "#2b5fd9";
    g.fillRect(30 + i * bw, h - pad - bh, Math.max(bw - 3, 1), bh);
    g.fillStyle = "#666";
    if (n <= 16 || i % 2 === 0) g.fillText(String(i + 1), 30 + i * bw + bw / 2 - 3, h - 3);
  });
}

function drawLegend() {
  const el = $("legend");
  el.textContent = "";
  const items = [...Object.entries(state.colours).map(([d, c]) => [`draft: ${d}`, c]),
                 ["target: correction", ORIGINS.correction], ["target: bonus", ORIGINS.bonus],
                 ["target: no draft", ORIGINS.target]];
  for (const [label, c] of items) {
    const s = document.createElement("span");
    s.textContent = label;
    s.style.setProperty("--c", c);
    el.append(s);
  }
}

// -- rendering ------------------------------------------------------------------------------------

/** One streamed answer: coloured token spans and its tally. */
class Answer {
  constructor(parent, label) {
    this.el = document.createElement("div");
    this.el.className = "msg answer";
    this.head = document.createElement("div");
    this.head.className = "who";
    this.title = document.createElement("span");
    this.title.textContent = label;
    this.speed = document.createElement("span");
    this.speed.className = "speed";
    this.head.append(this.title, this.speed);
    this.body = document.createElement("div");
    this.body.className = "body";
    this.el.append(this.head, this.body);
    parent.append(this.el);
    this.text = "";
    this.tally = new Tally();
  }

  chunk(obj) {
    const choice = obj.choices && obj.choices[0];
    if (choice && choice.delta && choice.delta.content) this.text += choice.delta.content;
    for (const entry of obj.specdec_trace || []) this.token(entry);
    if (obj.speculative) this.tally.final = obj;
    showStats(this.tally);
    const tps = this.tally.summary().tps;
    this.speed.textContent = tps ? `${tps.toFixed(1)} tok/s` : "";
  }

  token(e) {
    this.tally.add(e);
    if (e.rejected.length) {
      const rej = document.createElement("span");
      rej.className = "rej";
      rej.textContent = e.rejected.map((r) => r.text).join("");
      rej.title = "rejected draft";
      this.body.append(rej);
    }
    const span = document.createElement("span");
    span.className = "tok " + e.origin;
    span.textContent = e.text;
    if (e.origin === "draft") {
      span.style.setProperty("--c", colour(e.drafter));
      drawLegend();
    }
    span.dataset.info = tooltipText(e);
    this.body.append(span);
  }
}

function tooltipText(e) {
  const who = e.origin === "draft" ? `accepted draft (${e.drafter})` : `target: ${e.origin}`;
  const lines = [who, `step ${e.step}, draft position ${e.pos}`, `target p = ${e.p.toFixed(4)}`,
                 `top-2 logit gap = ${e.gap.toFixed(3)}`];
  if (e.rejected.length) lines.push("rejected: " + e.rejected.map((r) => JSON.stringify(r.text)).join(" "));
  return lines.join("\n");
}

function addUser(text) {
  const el = document.createElement("div");
  el.className = "msg user";
  el.textContent = text;
  $("messages").append(el);
}

// -- sending --------------------------------------------------------------------------------------

function messages(prompt) {
  const system = $("system").value.trim();
  const head = system ? [{ role: "system", content: system }] : [];
  return [...head, ...state.history, { role: "user", content: prompt }];
}

async function run(answer, msgs, spec) {
  const last = await streamChat(requestBody(msgs, spec), (obj) => answer.chunk(obj), state.controller.signal);
  if (last && last.timings) answer.speed.textContent = `${last.timings.predicted_per_second.toFixed(1)} tok/s`;
  return answer.text;
}

async function send(ev) {
  ev.preventDefault();
  const prompt = $("prompt").value.trim();
  if (!prompt || state.controller) return;
  clearError();
  const msgs = messages(prompt);
  addUser(prompt);
  $("prompt").value = "";
  setBusy(true);
  try {
    state.history.push({ role: "user", content: prompt }, { role: "assistant", content: await answer(msgs) });
  } catch (e) {
    if (e.name === "AbortError") showError("Stopped.");
    else showError(e instanceof ApiError ? e.message : `Request failed: ${e.message}`);
  } finally {
    setBusy(false);
  }
}

/** One answer, or in compare mode the same request without and with speculation, side by side. */
async function answer(msgs) {
  if (!$("compare").checked) return run(new Answer($("messages"), "assistant"), msgs, speculative(true));
  const row = document.createElement("div");
  row.className = "msg compare";
  const verdict = document.createElement("div");
  verdict.className = "verdict";
  const answers = document.createElement("div");
  answers.className = "answers";
  row.append(answers, verdict);
  $("messages").append(row);
  const off = await run(new Answer(answers, "speculation off"), msgs, false);
  const on = await run(new Answer(answers, "speculation on"), msgs, speculative(true));
  const same = off === on;
  verdict.classList.add(same ? "same" : "differs");
  verdict.textContent = same ? "identical" : "texts differ (expected only when sampling without a seed)";
  return on;
}

function setBusy(busy) {
  state.controller = busy ? new AbortController() : null;
  $("send").disabled = busy;
  $("stop").disabled = !busy;
}

// -- wiring ---------------------------------------------------------------------------------------

function tooltip(ev) {
  const tip = $("tooltip"), info = ev.target.dataset && ev.target.dataset.info;
  if (!info) { tip.hidden = true; return; }
  tip.textContent = info;
  tip.hidden = false;
  const x = ev.clientX + 12 + tip.offsetWidth > window.innerWidth ? ev.clientX - 12 - tip.offsetWidth : ev.clientX + 12;
  tip.style.left = Math.max(0, x) + "px";
  tip.style.top = ev.clientY + 12 + "px";
}

function init() {
  $("key").value = localStorage.getItem("specdec.key") || "";
  $("key").addEventListener("change", () => {
    localStorage.setItem("specdec.key", $("key").value.trim());
    loadServer();
  });
  $("drafter").addEventListener("change", describeDrafter);
  $("show-rejected").addEventListener("change",
    (e) => document.body.classList.toggle("hide-rejected", !e.target.checked));
  $("composer").addEventListener("submit", send);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey) { e.preventDefault(); $("composer").requestSubmit(); }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => { state.history = []; $("messages").textContent = ""; });
  $("messages").addEventListener("mousemove", tooltip);
  $("messages").addEventListener("mouseleave", () => { $("tooltip").hidden = true; });
  drawChart([]);
  loadServer();
}

init();
