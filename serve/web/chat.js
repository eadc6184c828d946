// The chat page: a conversation with a served model or adapter through the server's own
// /v1/chat/completions, streamed. The conversation and settings stay in this browser.
"use strict";

const $ = (id) => document.getElementById(id);
const STORE = "jaxllm.chat";
const SETTINGS = ["system", "temperature", "top_p", "max_tokens", "seed"];
const KEY_STORE = "jaxllm.key";  // the API key lives only as long as the tab (sessionStorage)

const state = { messages: [], model: null, controller: null };

function save() {
  const settings = {};
  for (const k of SETTINGS) settings[k] = $(k).value;
  localStorage.setItem(STORE, JSON.stringify({ messages: state.messages, model: state.model, settings }));
  sessionStorage.setItem(KEY_STORE, $("api_key").value);
}

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "{}");
    state.messages = Array.isArray(saved.messages) ? saved.messages : [];
    state.model = saved.model || null;
    for (const k of SETTINGS) if (saved.settings && saved.settings[k] != null) $(k).value = saved.settings[k];
    $("api_key").value = sessionStorage.getItem(KEY_STORE) || "";
  } catch (e) {
    state.messages = [];
  }
}

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = $("api_key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

function notice(text) {
  $("notice").textContent = text || "";
  $("notice").hidden = !text;
}

async function errorText(resp) {
  try {
    const body = await resp.json();
    if (body && body.error && body.error.message) return body.error.message;
  } catch (e) { /* not JSON */ }
  return `HTTP ${resp.status}`;
}

let retry = null;

async function loadModels() {
  clearTimeout(retry);
  let resp;
  try {
    resp = await fetch("/v1/models", { headers: headers() });
  } catch (e) {
    notice("No answer from the server; trying again…");
    retry = setTimeout(loadModels, 2000);
    return;
  }
  if (resp.status === 401) {
    notice("This server needs an API key: enter it under settings.");
    $("settings").hidden = false;
    return;
  }
  if (resp.status === 503) {
    notice("The model is still loading…");
    retry = setTimeout(loadModels, 2000);
    return;
  }
  if (!resp.ok) {
    notice("Could not list the models: " + (await errorText(resp)));
    return;
  }
  const { data } = await resp.json();
  const select = $("model");
  select.replaceChildren();
  for (const m of data) {
    const opt = document.createElement("option");
    opt.value = m.id;
    opt.textContent = m.parent ? `${m.id} (adapter of ${m.parent})` : m.id;
    select.append(opt);
  }
  if (state.model && data.some((m) => m.id === state.model)) select.value = state.model;
  state.model = select.value;
  notice("");
}

function bubble(role) {
  const div = document.createElement("div");
  div.className = "msg " + role;
  const body = document.createElement("div");
  body.className = "body";
  div.append(body);
  $("messages").append(div);
  return div;
}

function show(div, text, role) {
  const body = div.querySelector(".body");
  if (role === "assistant") body.replaceChildren(Markdown.render(text));
  else body.textContent = text;
}

function stats(div, line) {
  let s = div.querySelector(".stats");
  if (!s) {
    s = document.createElement("div");
    s.className = "stats";
    div.append(s);
  }
  s.textContent = line;
}

function redraw() {
  $("messages").replaceChildren();
  for (const m of state.messages) {
    const div = bubble(m.role);
    show(div, m.content, m.role);
    if (m.stats) stats(div, m.stats);
    if (m.error) div.classList.add("error");
  }
  scrollDown();
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function number(id, parse) {
  const v = $(id).value.trim();
  if (v === "") return undefined;
  const x = parse(v);
  return Number.isFinite(x) ? x : undefined;
}

function requestBody() {
  const messages = [];
  const system = $("system").value.trim();
  if (system) messages.push({ role: "system", content: system });
  // a reply that failed is left out with the message it answered: roles keep alternating
  state.messages.forEach((m, i) => {
    const next = state.messages[i + 1];
    if (m.error || (m.role === "user" && next && next.error)) return;
    messages.push({ role: m.role, content: m.content });
  });
  const body = { model: state.model, messages, stream: true, stream_options: { include_usage: true } };
  const fields = { temperature: parseFloat, top_p: parseFloat, max_tokens: (v) => parseInt(v, 10), seed: (v) => parseInt(v, 10) };
  for (const [k, parse] of Object.entries(fields)) {
    const v = number(k, parse);
    if (v !== undefined) body[k] = v;
  }
  return body;
}

function busy(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("input").disabled = on;
}

// The server's events, one "data: {...}" block each, ending with "data: [DONE]".
async function* events(resp) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
      if (!data) continue;
      if (data === "[DONE]") return;
      yield JSON.parse(data);
    }
  }
}

async function send(text) {
  state.messages.push({ role: "user", content: text });
  show(bubble("user"), text, "user");
  const reply = { role: "assistant", content: "" };
  const div = bubble("assistant");
  div.classList.add("streaming");
  scrollDown();
  const body = requestBody();
  state.messages.push(reply);
  save();
  busy(true);
  const controller = (state.controller = new AbortController());
  const t0 = performance.now();
  let first = null;
  let usage = null;
  let pending = false;
  const paint = () => {
    pending = false;
    show(div, reply.content, "assistant");
    scrollDown();
  };
  try {
    const resp = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) throw new Error(await errorText(resp));
    for await (const event of events(resp)) {
      if (event.error) throw new Error(event.error.message || "the server failed this request");
      if (event.usage) usage = event.usage;
      const delta = event.choices && event.choices[0] && event.choices[0].delta;
      if (delta && delta.content) {
        reply.content += delta.content;
        if (first === null) {
          // the first token is drawn now, not at the next frame: this is the time to see it
          paint();
          first = performance.now();
          div.dataset.ttftMs = (first - t0).toFixed(1);
        } else if (!pending) {
          pending = true;
          requestAnimationFrame(paint);  // at most one redraw a frame
        }
      }
    }
  } catch (e) {
    if (e.name === "AbortError") {
      reply.stopped = true;
    } else {
      reply.error = true;
      reply.content = reply.content ? reply.content + "\n\n" + e.message : e.message;
      div.classList.add("error");
    }
  } finally {
    state.controller = null;
    busy(false);
    paint();
    div.classList.remove("streaming");
    const end = performance.now();
    const parts = [];
    const tokens = usage ? usage.completion_tokens : null;
    if (tokens != null) parts.push(`${tokens} tokens`);
    if (usage) parts.push(`${usage.prompt_tokens} in`);
    if (first !== null) parts.push(`TTFT ${((first - t0) / 1000).toFixed(2)} s`);
    if (tokens > 1 && first !== null && end > first) parts.push(`${((tokens - 1) / ((end - first) / 1000)).toFixed(1)} tok/s`);
    if (reply.stopped) parts.push("stopped");
    reply.stats = parts.join(" · ");
    stats(div, reply.stats);
    div.dataset.done = "1";
    save();
    $("input").focus();
  }
}

function init() {
  load();
  redraw();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("input").value.trim();
    if (!text || state.controller) return;
    $("input").value = "";
    send(text);
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  $("stop").addEventListener("click", () => state.controller && state.controller.abort());
  $("clear").addEventListener("click", () => {
    if (state.controller) state.controller.abort();
    state.messages = [];
    save();
    redraw();
  });
  $("model").addEventListener("change", () => {
    state.model = $("model").value;
    save();
  });
  $("settings-toggle").addEventListener("click", () => {
    const box = $("settings");
    box.hidden = !box.hidden;
    $("settings-toggle").setAttribute("aria-expanded", String(!box.hidden));
  });
  for (const k of [...SETTINGS, "api_key"]) $(k).addEventListener("change", save);
  $("api_key").addEventListener("change", loadModels);
  loadModels();
}

document.addEventListener("DOMContentLoaded", init);
