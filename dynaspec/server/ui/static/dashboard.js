// The dashboard: starts from the last minutes the server kept (/ui/history: one sample every
// few seconds), then polls /ui/live once a second (one small GET: no engine work), keeps the
// last five minutes of snapshots in the tab and redraws the charts from them.
"use strict";

const DSDashboard = (() => {
  const POLL_MS = 1000, SPAN_S = 300, WINDOW_S = 10, LAT_WINDOW_S = 30;
  const S = DSSeries;
  const history = [];
  let timer = null, lastError = null;
  // stop() may come while start() still awaits the history: then nothing more is polled or added.
  let stopped = false;
  // Why the goodput chart is empty when the goodput policy is not running (from /ui/history).
  let goodputNote = null;

  function box(id) { return document.getElementById(id); }

  // Every rank's series and the total under data parallelism; one unlabelled scope otherwise.
  function scopes(snap) {
    const r = S.ranks(snap);
    return r.length ? r.map(x => ({want: {rank: x}, tag: x === "all" ? "all ranks" : `rank ${x}`}))
                    : [{want: {}, tag: ""}];
  }
  const named = (tag, what) => tag ? `${what} (${tag})` : what;

  function drawTokens(h, now, sc, opts) {
    const lines = [];
    for (const {want, tag} of sc) {
      lines.push({name: named(tag, "generated"), points: S.rate(h, "generation_tokens_total", want, WINDOW_S)});
      if (tag === "" || want.rank === "all") {
        lines.push({name: named(tag, "prompt"), points: S.rate(h, "prompt_tokens_total", want, WINDOW_S)});
        lines.push({name: named(tag, "accepted drafts"),
                    points: S.rate(h, "spec_decode_num_accepted_tokens_total", want, WINDOW_S)});
      }
    }
    DSCharts.lines(box("chart-tokens"), lines, opts);
  }

  function drawAcceptance(h, now, want, opts) {
    const last = h[h.length - 1];
    const pos = S.labelValues(last, "spec_decode_num_drafted_tokens_per_pos_total", "position", want);
    const lines = pos.map(p => ({name: `position ${parseInt(p) + 1}`,
      points: S.ratio(h, "spec_decode_num_accepted_tokens_per_pos_total",
                      "spec_decode_num_drafted_tokens_per_pos_total", {...want, position: p}, WINDOW_S)}));
    DSCharts.lines(box("chart-acceptance"), lines,
                   {...opts, ymax: 1, emptyText: "no drafts verified yet"});
  }

  function drawK(h, now, want, opts) {
    const last = h[h.length - 1];
    const ks = S.labelValues(last, "spec_decode_steps_total", "k", want);
    DSCharts.lines(box("chart-k-steps"), ks.map(k => ({name: `K=${k}`,
      points: S.rate(h, "spec_decode_steps_total", {...want, k}, WINDOW_S)})),
      {...opts, emptyText: "no speculative steps yet"});
    DSCharts.scatter(box("chart-k-batch"), S.kByBatch(h.slice(-120), want, WINDOW_S),
      {label: "x: requests running, y: mean K of the last 10 s (last 2 min; older fainter)",
       emptyText: "no speculative steps yet"});
  }

  function drawGoodput(h, now, sc, opts) {
    const lines = [];
    for (const {want, tag} of sc) {
      for (const kind of ["modelled", "observed"]) {
        lines.push({name: named(tag, kind),
          points: S.gauge(h, "k_policy_goodput_tokens_per_second", {...want, kind})});
      }
    }
    DSCharts.lines(box("chart-goodput"), lines,
      {...opts, emptyText: goodputNote || "no goodput estimate yet (the goodput policy " +
                                          "publishes one once requests decode)"});
  }

  function drawSkips(h, now, want, opts) {
    const last = h[h.length - 1];
    const reasons = S.labelValues(last, "spec_decode_draft_skips_total", "reason", want);
    const lines = reasons.map(r => ({name: r,
      points: S.rate(h, "spec_decode_draft_skips_total", {...want, reason: r}, WINDOW_S)}));
    lines.push({name: "steps with K=0", points: S.rate(h, "spec_decode_steps_total", {...want, k: "0"}, WINDOW_S)});
    DSCharts.lines(box("chart-skips"), lines, {...opts, emptyText: "every request-step drafted"});
  }

  function drawLatency(h, now, want, opts) {
    for (const [id, base] of [["chart-ttft", "time_to_first_token_seconds"],
                              ["chart-itl", "inter_token_latency_seconds"]]) {
      const lines = [0.5, 0.9, 0.99].map(q => ({name: `p${Math.round(q * 100)}`,
        points: S.quantiles(h, base, q, want, LAT_WINDOW_S)}));
      DSCharts.lines(box(id), lines, {...opts, emptyText: "no finished requests in the window"});
    }
  }

  function drawQueues(h, now, sc, opts, state) {
    const lines = [];
    for (const {want, tag} of sc) {
      lines.push({name: named(tag, "running"), points: S.gauge(h, "num_requests_running", want)});
      lines.push({name: named(tag, "waiting"), points: S.gauge(h, "num_requests_waiting", want)});
    }
    DSCharts.lines(box("chart-requests"), lines, opts);
    DSCharts.lines(box("chart-kv"), sc.map(({want, tag}) => ({name: named(tag, "target KV used"),
      points: S.gauge(h, "kv_cache_usage_perc", want, 100)})), {...opts, ymax: 100});
    const used = state.kv_num_blocks - state.kv_free_blocks;
    box("chart-kv").querySelector("h2").textContent =
      `KV cache used (%): ${used} of ${state.kv_num_blocks} blocks now`;
  }

  function draw() {
    if (!history.length) return;
    const last = history[history.length - 1], now = last.time;
    const sc = scopes(last), total = sc[0].want;
    const opts = {now, span: SPAN_S};
    document.getElementById("ranks-note").textContent = sc.length > 1 ?
      `Data parallel: ${sc.length - 1} ranks; per-rank lines where it matters, totals elsewhere.` : "";
    drawTokens(history, now, sc, opts);
    drawAcceptance(history, now, total, opts);
    drawK(history, now, total, opts);
    drawGoodput(history, now, sc.length > 1 ? sc.slice(1) : sc, opts);
    drawSkips(history, now, total, opts);
    drawLatency(history, now, total, opts);
    drawQueues(history, now, sc, opts, last.state);
  }

  async function poll() {
    try {
      const r = await fetch("/ui/live", {cache: "no-store"});
      if (!r.ok) throw new Error(`/ui/live answered ${r.status}`);
      const snap = await r.json();
      if (stopped) return;  // a poll in flight when the page stopped polling adds nothing
      history.push(snap);
      while (history.length && snap.time - history[0].time > SPAN_S + WINDOW_S) history.shift();
      lastError = null;
      DSPlayground.health(snap.state, null);
      if (!document.getElementById("view-dashboard").classList.contains("hidden")) draw();
    } catch (e) {
      lastError = String(e);
      DSPlayground.health(null, lastError);
    }
  }

  // The samples the server kept before this page opened, so the charts show the last minutes
  // at once; a failure only means starting from the first poll, as before.
  async function loadHistory() {
    try {
      const r = await fetch("/ui/history", {cache: "no-store"});
      if (!r.ok) return;
      const past = await r.json();
      goodputNote = past.goodput_note;
      if (!stopped) history.push(...past.samples);
    } catch (e) {
      lastError = String(e);
    }
  }

  async function start() {
    document.getElementById("window-s").textContent = WINDOW_S;
    await loadHistory();
    if (stopped) return;
    poll();
    timer = setInterval(poll, POLL_MS);
  }

  return {start, draw, history: () => history, goodputNote: () => goodputNote,
          stop: () => { stopped = true; clearInterval(timer); }};
})();
