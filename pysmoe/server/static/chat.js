// The chat page of `pysmoe serve`: one conversation, kept in this page, sent to
// /v1/chat/completions with stream=true. Reasoning (delta.reasoning_content) is shown apart, in a
// collapsible block above the answer. No framework, no build step, nothing fetched from elsewhere.
"use strict";

const $ = (id) => document.getElementById(id);
const state = { messages: [], controller: null, model: "" };

function apiKey() { return localStorage.getItem("pysmoe-api-key") || ""; }

function headers() {
  const h = { "Content-Type": "application/json" };
  const key = apiKey();
  if (key) h["Authorization"] = "Bearer " + key;
  return h;
}

function showError(text) {
  const e = $("error");
  e.textContent = text;
  e.hidden = !text;
}

function askKey() {
  $("key-button").hidden = false;
  $("key-input").value = apiKey();
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

async function loadModel() {
  try {
    const r = await fetch("/v1/models", { headers: headers() });
    if (r.status === 401) {
      askKey();
      return;
    }
    const body = await r.json();
    state.model = body.data && body.data[0] ? body.data[0].id : "";
    $("model").textContent = state.model;
    showError("");
  } catch (err) {
    showError("cannot reach the server: " + err);
  }
}

function bubble(role) {
  $("empty").hidden = true;
  const div = document.createElement("div");
  div.className = "msg " + role;
  const label = document.createElement("span");
  label.className = "role";
  label.textContent = role === "user" ? "you" : (state.model || "model");
  div.appendChild(label);
  $("log").appendChild(div);
  return div;
}

function addUser(text) {
  const div = bubble("user");
  div.appendChild(document.createTextNode(text));
}

function addAssistant() {
  const div = bubble("assistant");
  const details = document.createElement("details");
  details.className = "reasoning";
  details.open = true;
  details.hidden = true;
  const summary = document.createElement("summary");
  summary.textContent = "Reasoning";
  const thought = document.createElement("div");
  thought.className = "thought";
  details.append(summary, thought);
  const answer = document.createElement("div");
  answer.className = "answer";
  div.append(details, answer);
  return { div, details, thought, answer };
}

function scrollDown() { $("log").scrollTop = $("log").scrollHeight; }

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// Reads a server-sent-events body, calling onData with each `data:` payload.
async function readEvents(response, onData) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) onData(line.slice(6));
      }
    }
  }
}

async function send(text) {
  showError("");
  addUser(text);
  state.messages.push({ role: "user", content: text });
  const view = addAssistant();
  scrollDown();
  const controller = new AbortController();
  state.controller = controller;
  setBusy(true);
  let content = "", reasoning = "", finish = null;
  try {
    const r = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), signal: controller.signal,
      body: JSON.stringify({ model: state.model, messages: state.messages, stream: true }),
    });
    if (!r.ok) {
      let message = r.statusText;
      try { message = (await r.json()).error.message; } catch (_) { /* not JSON */ }
      if (r.status === 401) askKey();
      throw new Error(message);
    }
    await readEvents(r, (data) => {
      if (data === "[DONE]") return;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) return;
      const d = choice.delta || {};
      if (d.reasoning_content) {
        reasoning += d.reasoning_content;
        view.details.hidden = false;
        view.thought.textContent = reasoning;
      }
      if (d.content) {
        content += d.content;
        view.answer.textContent = content;
      }
      if (choice.finish_reason) finish = choice.finish_reason;
      scrollDown();
    });
  } catch (err) {
    if (err.name === "AbortError") {
      const note = document.createElement("span");
      note.className = "stopped";
      note.textContent = "(stopped)";
      view.div.appendChild(note);
    } else {
      showError(String(err.message || err));
    }
  } finally {
    if (reasoning && content) view.details.open = false;
    view.div.dataset.finish = finish || "stopped";
    state.messages.push({ role: "assistant", content });
    state.controller = null;
    setBusy(false);
    $("prompt").focus();
  }
}

function newChat() {
  if (state.controller) state.controller.abort();
  state.messages = [];
  for (const m of [...document.querySelectorAll(".msg")]) m.remove();
  $("empty").hidden = false;
  showError("");
  $("prompt").focus();
}

$("composer").addEventListener("submit", (e) => {
  e.preventDefault();
  const text = $("prompt").value.trim();
  if (!text || state.controller) return;
  $("prompt").value = "";
  send(text);
});
$("prompt").addEventListener("keydown", (e) => {
  if (e.key === "Enter" && !e.shiftKey) {
    e.preventDefault();
    $("composer").requestSubmit();
  }
});
$("stop").addEventListener("click", () => { if (state.controller) state.controller.abort(); });
$("new").addEventListener("click", newChat);
$("key-button").addEventListener("click", askKey);
$("key-form").addEventListener("submit", () => {
  localStorage.setItem("pysmoe-api-key", $("key-input").value.trim());
  loadModel();
});

loadModel();
