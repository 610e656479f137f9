// The playground: the model card, the sampling fields and a streamed chat whose chunks carry
// their engine step (stream_options.include_spec_steps), so the answer's speculation is shown
// as it arrives; the final chunk's dynaspec.spec is the engine's own summary of the request.
"use strict";

const DSPlayground = (() => {
  const messages = [];  // the conversation sent with each request
  let model = null, controller = null;

  const $ = id => document.getElementById(id);

  function apiKey() {
    return $("sampling").elements.api_key.value.trim();
  }

  function headers() {
    const h = {"Content-Type": "application/json"};
    if (apiKey()) h.Authorization = `Bearer ${apiKey()}`;
    return h;
  }

  function addCard(dl, key, value) {
    const dt = document.createElement("dt"), dd = document.createElement("dd");
    dt.textContent = key;
    dd.textContent = typeof value === "object" && value !== null ? JSON.stringify(value) : String(value);
    dl.append(dt, dd);
  }

  async function loadModel() {
    const dl = $("model-card");
    try {
      const r = await fetch("/v1/models", {headers: headers()});
      const body = await r.json();
      if (!r.ok) throw new Error(body.error ? body.error.message : r.status);
      const card = body.data[0], ext = card.dynaspec || {};
      model = card.id;
      dl.textContent = "";
      addCard(dl, "model", card.id);
      addCard(dl, "max_model_len", card.max_model_len);
      const plan = ext.spec_plan || {}, policy = ext.k_policy || {};
      addCard(dl, "speculating", plan.speculating ? `yes, K up to ${plan.max_k}` : "no");
      addCard(dl, "plan", plan.kind);
      addCard(dl, "verify widths", (plan.widths || []).join(", "));
      addCard(dl, "K policy", policy.name || "none");
      if (policy.cost_table) addCard(dl, "cost table", policy.cost_table);
      addCard(dl, "lossless", ext.lossless);
      if (ext.execution_plan) addCard(dl, "execution", `${ext.execution_plan.mode} (${ext.execution_plan.graph_path})`);
      $("model-json").textContent = JSON.stringify(card, null, 1);
      dl.dataset.loaded = "1";
    } catch (e) {
      dl.textContent = `could not read /v1/models: ${e.message || e} (an API key may be needed)`;
    }
  }

  function sampling() {
    const f = $("sampling").elements, out = {};
    for (const name of ["temperature", "top_p", "max_tokens", "top_k", "seed"]) {
      const raw = f[name].value.trim();
      if (raw !== "") out[name] = name === "temperature" || name === "top_p" ? parseFloat(raw) : parseInt(raw);
    }
    return out;
  }

  function bubble(role, text) {
    const div = document.createElement("div");
    div.className = `msg ${role}`;
    div.textContent = text;
    $("messages").appendChild(div);
    $("messages").scrollTop = $("messages").scrollHeight;
    return div;
  }

  // Per-answer stats from the chunks' step records.
  function newStats() {
    return {steps: [], t0: performance.now(), tFirst: null, tLast: null};
  }

  function showStats(st) {
    const steps = st.steps, cell = k => $("answer-stats").querySelector(`[data-stat="${k}"]`);
    const sum = f => steps.reduce((a, s) => a + s[f], 0);
    const drafted = sum("drafted"), accepted = sum("accepted"), tokens = sum("tokens");
    cell("steps").textContent = steps.length;
    cell("drafted").textContent = drafted;
    cell("accepted").textContent = accepted;
    cell("acceptance").textContent = drafted ? `${(100 * accepted / drafted).toFixed(1)}%` : "no drafts";
    cell("tokens").textContent = tokens;
    cell("tokens_per_step").textContent = steps.length ? (tokens / steps.length).toFixed(2) : "-";
    cell("ttft").textContent = st.tFirst == null ? "-" : `${((st.tFirst - st.t0) / 1000).toFixed(2)} s`;
    const dt = st.tLast != null && st.tFirst != null ? (st.tLast - st.tFirst) / 1000 : 0;
    const later = steps.length ? tokens - steps[0].tokens : 0;  // after the first step's
    cell("tps").textContent = dt > 0 && later > 0 ? (later / dt).toFixed(1) : "-";
    DSCharts.strip($("k-strip"), steps);
  }

  function summary(spec) {
    const p = $("answer-summary");
    if (!spec) { p.textContent = "speculation is off for this server"; return; }
    const mal = spec.num_drafts ? (1 + spec.num_accepted_tokens / spec.num_drafts).toFixed(2) : "-";
    p.textContent = `engine summary: ${spec.num_steps} steps, ${spec.num_drafts} drafts, ` +
      `${spec.num_accepted_tokens}/${spec.num_draft_tokens} drafts accepted, mean acceptance ` +
      `length ${mal}, steps by K ${JSON.stringify(spec.steps_by_k)}, skips ` +
      `${JSON.stringify(spec.draft_skips)}${spec.lossless ? "" : " (not lossless)"}`;
    p.dataset.final = "1";
    p.dataset.drafted = spec.num_draft_tokens;  // for the browser test: the engine's own totals
    p.dataset.accepted = spec.num_accepted_tokens;
  }

  // Server-sent events from a fetch body: yields each `data:` payload.
  async function* events(body) {
    const reader = body.getReader(), dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const {value, done} = await reader.read();
      if (done) return;
      buf += dec.decode(value, {stream: true});
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const event = buf.slice(0, i);
        buf = buf.slice(i + 2);
        for (const line of event.split("\n")) if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }

  async function send(text) {
    messages.push({role: "user", content: text});
    bubble("user", text);
    const out = bubble("assistant", ""), st = newStats();
    $("answer-summary").textContent = "";
    delete $("answer-summary").dataset.final;
    showStats(st);
    controller = new AbortController();
    $("send").disabled = true; $("stop").disabled = false;
    let answer = "";
    try {
      const r = await fetch("/v1/chat/completions", {method: "POST", headers: headers(),
        signal: controller.signal, body: JSON.stringify({model, messages, stream: true,
          stream_options: {include_usage: true, include_spec_steps: true}, ...sampling()})});
      if (!r.ok) {
        const body = await r.json().catch(() => ({}));
        throw new Error(body.error ? body.error.message : `HTTP ${r.status}`);
      }
      for await (const data of events(r.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.error) throw new Error(chunk.error.message);
        const ext = chunk.dynaspec || {};
        const delta = chunk.choices.length ? chunk.choices[0].delta || {} : {};
        if (delta.content) {
          answer += delta.content;
          out.textContent = answer;
        }
        if (ext.step) {
          st.tLast = performance.now();
          if (st.tFirst == null) st.tFirst = st.tLast;
          st.steps.push(ext.step);
          showStats(st);
        }
        if ("spec" in ext) summary(ext.spec);
      }
      messages.push({role: "assistant", content: answer});
      out.dataset.done = "1";
    } catch (e) {
      out.classList.add("error");
      out.textContent = answer + (e.name === "AbortError" ? " [stopped]" : ` [error: ${e.message}]`);
      messages.pop();  // the question without its answer is not sent again
    } finally {
      $("send").disabled = false; $("stop").disabled = true;
      controller = null;
    }
  }

  function health(state, error) {
    const h = $("health");
    h.textContent = error ? `server unreachable: ${error}` :
      `running ${state.num_running}, waiting ${state.num_waiting}, KV ${(100 * state.kv_usage).toFixed(1)}%`;
    h.classList.toggle("error", !!error);
  }

  function show(view) {
    for (const b of document.querySelectorAll(".tab")) b.classList.toggle("active", b.dataset.view === view);
    for (const v of ["playground", "dashboard"]) $(`view-${v}`).classList.toggle("hidden", v !== view);
    if (view === "dashboard") DSDashboard.draw();
    history.replaceState(null, "", `#${view}`);
  }

  function start() {
    const key = sessionStorage.getItem("dynaspec-api-key");
    if (key) $("sampling").elements.api_key.value = key;
    $("sampling").elements.api_key.addEventListener("change", () => {
      sessionStorage.setItem("dynaspec-api-key", apiKey());
      loadModel();
    });
    for (const b of document.querySelectorAll(".tab")) b.addEventListener("click", () => show(b.dataset.view));
    $("composer").addEventListener("submit", ev => {
      ev.preventDefault();
      const text = $("prompt").value.trim();
      if (!text || controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", ev => {
      if (ev.key === "Enter" && !ev.shiftKey) { ev.preventDefault(); $("composer").requestSubmit(); }
    });
    $("stop").addEventListener("click", () => controller && controller.abort());
    $("clear").addEventListener("click", () => {
      messages.length = 0;
      $("messages").textContent = "";
    });
    loadModel();
    show(location.hash === "#dashboard" ? "dashboard" : "playground");
  }

  return {start, health};
})();

document.addEventListener("DOMContentLoaded", () => {
  DSPlayground.start();
  DSDashboard.start();
});
