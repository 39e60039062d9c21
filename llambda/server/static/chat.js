// The chat page `llambda serve` answers GET / with (docs/server.md, "The chat page").
//
// It streams the server's own POST /v1/chat/completions (Server-Sent Events read from
// fetch's ReadableStream) into a conversation kept in localStorage. The model's text is
// only ever put into the page as text (textContent), never parsed as HTML: a reply that
// says <script> shows those characters.
"use strict";

const STORE = {chat: "llambda.chat", settings: "llambda.settings", apiKey: "llambda.apiKey"};
const NUMBERS = {temperature: parseFloat, top_p: parseFloat, max_tokens: parseInt, seed: parseInt};
const $ = (id) => document.getElementById(id);

let messages = [];      // [{role, content, stats?}], as stored
let modelId = null;     // the first id GET /v1/models lists
let running = null;     // {controller, message} of the reply being streamed

// -- storage ------------------------------------------------------------------------------
function loadJSON(key, fallback) {
  try {
    return JSON.parse(localStorage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

function saveChat() {
  localStorage.setItem(STORE.chat, JSON.stringify(messages));
}

function saveSettings() {
  const settings = {system: $("system").value};
  for (const name in NUMBERS) settings[name] = $(name).value;
  localStorage.setItem(STORE.settings, JSON.stringify(settings));
  localStorage.setItem(STORE.apiKey, $("api-key").value);
}

function restoreSettings() {
  const settings = loadJSON(STORE.settings, {});
  for (const name of ["system", ...Object.keys(NUMBERS)]) $(name).value = settings[name] ?? "";
  $("api-key").value = localStorage.getItem(STORE.apiKey) ?? "";
}

// -- talking to the server ------------------------------------------------------------------
function headers() {
  const h = {"Content-Type": "application/json"};
  const key = $("api-key").value.trim();
  if (key) h.Authorization = "Bearer " + key;
  return h;
}

async function errorMessage(response) {
  // the message of OpenAI's error body when there is one, else the status line
  try {
    const body = await response.json();
    if (body.error && body.error.message) return `${response.status}: ${body.error.message}`;
  } catch { /* not JSON */ }
  return `${response.status} ${response.statusText}`;
}

async function findModel() {
  const response = await fetch("/v1/models", {headers: headers()});
  if (!response.ok) {
    const hint = response.status === 401 ? " (enter the API key under Settings)" : "";
    throw new Error(`GET /v1/models: ${await errorMessage(response)}${hint}`);
  }
  modelId = (await response.json()).data[0].id;
  $("model").textContent = modelId;
}

function requestBody() {
  const history = messages.filter((m) => m !== running.message).map(({role, content}) => ({role, content}));
  const system = $("system").value.trim();
  const body = {
    model: modelId,
    messages: system ? [{role: "system", content: system}, ...history] : history,
    stream: true,
    stream_options: {include_usage: true},
  };
  for (const [name, parse] of Object.entries(NUMBERS)) {
    const value = $(name).value.trim();
    if (value !== "") body[name] = parse(value);
  }
  return body;
}

// Calls onChunk(object) for each `data: {json}` line of the event stream, until [DONE].
async function readEvents(response, onChunk) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let pending = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    pending += value;
    const lines = pending.split("\n");
    pending = lines.pop();              // a line not finished yet
    for (const line of lines) {
      if (!line.startsWith("data: ")) continue;
      const data = line.slice("data: ".length);
      if (data === "[DONE]") return;
      onChunk(JSON.parse(data));
    }
  }
}

// -- sending --------------------------------------------------------------------------------
async function send(text) {
  status("");
  const user = {role: "user", content: text};
  const reply = {role: "assistant", content: ""};
  messages.push(user, reply);
  render();
  const view = $("messages").lastElementChild;
  running = {controller: new AbortController(), message: reply};
  setRunning(true);
  let t0 = null, tFirst = null, chunks = 0, usage = null, drawPending = false;
  const draw = () => {
    drawPending = false;
    const follow = atEnd();             // a reader who scrolled up to read stays where they are
    fillBody(view.querySelector(".body"), reply.content);
    saveChat();
    if (follow) scrollToEnd();
  };
  try {
    if (!modelId) await findModel();
    t0 = performance.now();
    const response = await fetch("/v1/chat/completions", {
      method: "POST", headers: headers(), body: JSON.stringify(requestBody()), signal: running.controller.signal,
    });
    if (!response.ok) throw new Error(await errorMessage(response));
    await readEvents(response, (chunk) => {
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const piece = chunk.choices && chunk.choices[0] && chunk.choices[0].delta.content;
      if (!piece) return;
      tFirst ??= performance.now();
      chunks += 1;
      reply.content += piece;
      if (!drawPending) {
        drawPending = true;
        requestAnimationFrame(draw);
      }
    });
    reply.stats = stats(usage, chunks, t0, tFirst, performance.now());
  } catch (e) {
    const stopped = e.name === "AbortError";
    if (chunks === 0 && messages.includes(user)) {
      // nothing came back: the message goes back into the box, to edit or send again
      messages.splice(messages.indexOf(user), 2);
      $("prompt").value = text;
      status(stopped ? "stopped before the reply began" : e.message);
    } else {
      reply.stats = stats(null, chunks, t0, tFirst, performance.now());
      if (stopped) reply.stats.stopped = true;
      else reply.stats.error = e.message;
    }
  } finally {
    running = null;
    setRunning(false);
    saveChat();
    render();
  }
}

// TTFT from sending to the first text; tokens/s over the tokens after the first. Without the
// usage chunk (a stopped reply has none) the tokens are counted as the text chunks seen, which
// may miss a few (a character split over tokens arrives as one chunk): shown as "≈".
function stats(usage, chunks, t0, tFirst, tEnd) {
  const tokens = usage ? usage.completion_tokens : chunks;
  const s = {tokens, approx: !usage};
  if (tFirst !== null) {
    s.ttft = (tFirst - t0) / 1000;
    if (tokens > 1 && tEnd > tFirst) s.tps = (tokens - 1) / ((tEnd - tFirst) / 1000);
  }
  return s;
}

function statsText(s) {
  const parts = [`${s.approx ? "≈" : ""}${s.tokens} tokens`];
  if (s.ttft !== undefined) parts.push(`TTFT ${s.ttft.toFixed(2)} s`);
  if (s.tps !== undefined) parts.push(`${s.tps.toFixed(1)} tokens/s`);
  if (s.stopped) parts.push("stopped");
  if (s.error) parts.push(`error: ${s.error}`);
  return parts.join(" · ");
}

// -- the page -------------------------------------------------------------------------------
function status(text) {
  $("status").textContent = text;
}

function setRunning(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
}

function atEnd() {
  return window.innerHeight + window.scrollY >= document.body.scrollHeight - 40;
}

function scrollToEnd() {
  window.scrollTo(0, document.body.scrollHeight);
}

// The text with its ``` fences as code blocks with a Copy button, all of it as text nodes. A
// fence not closed yet (a reply still streaming) runs to the end.
function fillBody(body, text) {
  const blocks = [];                    // [{code, lines}]
  let open = null;                      // the code block whose closing fence is still to come
  for (const line of text.split("\n")) {
    if (/^\s*```/.test(line)) {
      if (open) {
        open = null;
      } else {
        open = {code: true, lines: []};
        blocks.push(open);
      }
    } else if (open) {
      open.lines.push(line);
    } else if (blocks.length && !blocks.at(-1).code) {
      blocks.at(-1).lines.push(line);
    } else {
      blocks.push({code: false, lines: [line]});
    }
  }
  const views = [];
  for (const b of blocks) {
    const text = b.lines.join("\n");
    if (b.code) views.push(codeBlock(text));
    else if (text.trim()) views.push(textBlock(text.trim()));
  }
  body.replaceChildren(...views);
}

function textBlock(text) {
  const p = document.createElement("p");
  p.className = "text";
  p.textContent = text;
  return p;
}

function codeBlock(text) {
  const box = document.createElement("div");
  box.className = "code";
  const pre = document.createElement("pre");
  const code = document.createElement("code");
  code.textContent = text;
  pre.append(code);
  const button = document.createElement("button");
  button.type = "button";
  button.textContent = "Copy";
  button.setAttribute("aria-label", "Copy this code");
  button.addEventListener("click", () => copy(code, button));
  box.append(button, pre);
  return box;
}

async function copy(code, button) {
  try {
    await navigator.clipboard.writeText(code.textContent);
    button.textContent = "Copied";
  } catch {
    // no clipboard API (plain http off loopback is not a secure context): select the code instead
    const range = document.createRange();
    range.selectNodeContents(code);
    getSelection().removeAllRanges();
    getSelection().addRange(range);
    button.textContent = "Selected: press Ctrl+C";
  }
  setTimeout(() => { button.textContent = "Copy"; }, 2000);
}

function messageView(m) {
  const li = document.createElement("li");
  li.className = `message ${m.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = m.role === "user" ? "You" : "Assistant";
  const body = document.createElement("div");
  body.className = "body";
  if (m.role === "assistant") fillBody(body, m.content);
  else body.append(textBlock(m.content));
  li.append(role, body);
  if (m.stats) {
    const p = document.createElement("p");
    p.className = "stats" + (m.stats.stopped ? " stopped" : "") + (m.stats.error ? " error" : "");
    p.textContent = statsText(m.stats);
    li.append(p);
  }
  return li;
}

function render() {
  $("messages").replaceChildren(...messages.map(messageView));
  scrollToEnd();
}

function newChat() {
  if (running) running.controller.abort();
  messages = [];
  saveChat();
  render();
  status("");
  $("prompt").focus();
}

function start() {
  restoreSettings();
  messages = loadJSON(STORE.chat, []).filter((m) => m && typeof m.content === "string");
  render();
  for (const id of ["system", "api-key", ...Object.keys(NUMBERS)]) $(id).addEventListener("change", saveSettings);
  $("api-key").addEventListener("change", () => findModel().then(() => status(""), (e) => status(e.message)));
  $("new-chat").addEventListener("click", newChat);
  $("stop").addEventListener("click", () => running && running.controller.abort());
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    const text = $("prompt").value;
    if (running || !text.trim()) return;
    $("prompt").value = "";
    send(text);
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      $("composer").requestSubmit();
    }
  });
  findModel().catch((e) => {
    $("model").textContent = "no model";
    status(e.message);
  });
  $("prompt").focus();
}

start();
