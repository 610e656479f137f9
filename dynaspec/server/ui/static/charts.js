// Small hand-written SVG charts (no library, nothing fetched): time lines and a scatter.
// Each chart's container gets data-points (non-null points drawn) and data-series (series
// with at least one point), which the browser test reads.
"use strict";

const DSCharts = (() => {
  const NS = "http://www.w3.org/2000/svg";
  const W = 560, H = 200, L = 52, R = 10, T = 10, B = 24;  // viewBox and plot margins
  const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2",
                  "#db2777", "#65a30d", "#4b5563", "#ca8a04"];

  function el(name, attrs, parent) {
    const e = document.createElementNS(NS, name);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, v);
    if (parent) parent.appendChild(e);
    return e;
  }

  function fmt(v) {
    const a = Math.abs(v);
    if (a === 0) return "0";
    if (a >= 1e6) return (v / 1e6).toFixed(1) + "M";
    if (a >= 1e3) return (v / 1e3).toFixed(1) + "k";
    if (a >= 10) return v.toFixed(0);
    if (a >= 1) return v.toFixed(1);
    if (a >= 0.01) return v.toFixed(2);
    return v.toExponential(0);
  }

  // The chart's <svg> and legend inside `box` (made once, cleared on each draw).
  function frame(box) {
    let svg = box.querySelector("svg.chart-svg");
    if (!svg) {
      svg = el("svg", {class: "chart-svg", viewBox: `0 0 ${W} ${H}`}, box);
      const legend = document.createElement("div");
      legend.className = "legend";
      box.appendChild(legend);
    }
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    return {svg, legend: box.querySelector(".legend")};
  }

  function yAxis(svg, ymax) {
    for (let i = 0; i <= 4; i++) {
      const v = ymax * i / 4, y = T + (H - T - B) * (1 - i / 4);
      el("line", {x1: L, x2: W - R, y1: y, y2: y, class: "gridline"}, svg);
      el("text", {x: L - 4, y: y + 4, "text-anchor": "end", class: "tick"}, svg).textContent = fmt(v);
    }
  }

  function niceMax(m) {
    if (!(m > 0)) return 1;
    const p = Math.pow(10, Math.floor(Math.log10(m)));
    for (const f of [1, 1.25, 2, 2.5, 5, 10]) if (m <= f * p) return f * p;
    return 10 * p;
  }

  function legendRow(legend, items) {
    legend.textContent = "";
    for (const it of items) {
      const s = document.createElement("span");
      s.className = "key";
      const sw = document.createElement("i");
      sw.style.background = it.color;
      s.appendChild(sw);
      s.appendChild(document.createTextNode(it.label));
      legend.appendChild(s);
    }
  }

  function empty(svg, text) {
    el("text", {x: W / 2, y: H / 2, "text-anchor": "middle", class: "empty"}, svg).textContent = text;
  }

  // series: [{name, points: [[t_seconds, value|null], ...]}]; x spans [now - span, now].
  function lines(box, series, opts) {
    const {svg, legend} = frame(box);
    const now = opts.now, span = opts.span;
    let ymax = opts.ymax || 0, npoints = 0, nseries = 0;
    for (const s of series) for (const [, v] of s.points) if (v != null) ymax = Math.max(ymax, v);
    ymax = opts.ymax || niceMax(ymax * 1.05);
    yAxis(svg, ymax);
    for (let m = 0; m <= span; m += 60) {
      const x = L + (W - L - R) * (1 - m / span);
      el("text", {x, y: H - 6, "text-anchor": "middle", class: "tick"}, svg).textContent =
        m === 0 ? "now" : `-${m / 60}m`;
    }
    const keys = [];
    series.forEach((s, i) => {
      const color = COLORS[i % COLORS.length];
      let d = "", pen = false, n = 0;
      for (const [t, v] of s.points) {
        if (v == null || t < now - span) { pen = false; continue; }
        const x = L + (W - L - R) * (1 - (now - t) / span);
        const y = T + (H - T - B) * (1 - Math.min(v, ymax) / ymax);
        d += `${pen ? "L" : "M"}${x.toFixed(1)},${y.toFixed(1)}`;
        pen = true; n++;
      }
      if (n === 1) d += "l0.1,0";  // a lone point still shows (round line caps)
      if (n) el("path", {d, stroke: color, class: "line"}, svg);
      npoints += n; nseries += n > 0;
      keys.push({label: s.name, color});
    });
    if (!npoints) empty(svg, opts.emptyText || "no data yet");
    legendRow(legend, keys);
    box.dataset.points = npoints;
    box.dataset.series = nseries;
  }

  // points: [[x, y], ...]
  function scatter(box, points, opts) {
    const {svg, legend} = frame(box);
    const xmax = niceMax(Math.max(1, ...points.map(p => p[0])));
    const ymax = niceMax(Math.max(1, ...points.map(p => p[1])));
    yAxis(svg, ymax);
    for (let i = 0; i <= 4; i++) {
      const x = L + (W - L - R) * i / 4;
      el("text", {x, y: H - 6, "text-anchor": "middle", class: "tick"}, svg).textContent =
        fmt(xmax * i / 4);
    }
    points.forEach(([x, y], i) => {
      const age = (points.length - 1 - i) / Math.max(1, points.length - 1);  // older: fainter
      el("circle", {cx: L + (W - L - R) * x / xmax, cy: T + (H - T - B) * (1 - y / ymax), r: 4,
                    fill: COLORS[0], "fill-opacity": (1 - 0.8 * age).toFixed(2)}, svg);
    });
    if (!points.length) empty(svg, opts.emptyText || "no data yet");
    legendRow(legend, [{label: opts.label, color: COLORS[0]}]);
    box.dataset.points = points.length;
    box.dataset.series = points.length ? 1 : 0;
  }

  // One bar per step: height = tokens emitted, text = the step's K.
  function strip(svg, steps) {
    while (svg.firstChild) svg.removeChild(svg.firstChild);
    const n = Math.max(steps.length, 1), bw = Math.min(24, 600 / n);
    const tmax = Math.max(1, ...steps.map(s => s.tokens));
    steps.forEach((s, i) => {
      const h = 44 * s.tokens / tmax, x = i * bw;
      const color = s.drafted ? (s.accepted === s.drafted ? COLORS[2] : COLORS[0]) : COLORS[8];
      const bar = el("rect", {x: x + 0.5, y: 50 - h, width: Math.max(bw - 1, 0.5), height: h,
                              fill: color}, svg);
      el("title", {}, bar).textContent =
        `step ${i + 1}: K=${s.k == null ? "off" : s.k}, drafted ${s.drafted}, ` +
        `accepted ${s.accepted}, tokens ${s.tokens}`;
      if (bw >= 8) {
        el("text", {x: x + bw / 2, y: 64, "text-anchor": "middle", class: "tick"}, svg)
          .textContent = s.k == null ? "-" : s.k;
      }
    });
    svg.dataset.steps = steps.length;
  }

  return {lines, scatter, strip, fmt};
})();
