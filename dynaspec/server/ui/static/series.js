// Derived series from /ui/live snapshots, the way PromQL derives them from two scrapes:
// counters -> rate over a window, histogram buckets -> histogram_quantile of the window's
// increase, conditional acceptance = accepted increase / drafted increase per position.
// A snapshot: {time, series: {name: [[labels, value], ...]}}.
"use strict";

const DSSeries = (() => {
  function matches(labels, want) {
    for (const [k, v] of Object.entries(want || {})) if (labels[k] !== v) return false;
    return true;
  }

  // Sum of the samples of `name` whose labels include `want`; null when there are none.
  function value(snap, name, want) {
    let sum = null;
    for (const [labels, v] of snap.series[name] || []) {
      if (matches(labels, want) && v != null) sum = (sum || 0) + v;
    }
    return sum;
  }

  // The values of label `key` among the samples of `name` matching `want`, sorted.
  function labelValues(snap, name, key, want) {
    const out = new Set();
    for (const [labels] of snap.series[name] || []) {
      if (key in labels && matches(labels, want)) out.add(labels[key]);
    }
    return [...out].sort((a, b) => (parseFloat(a) - parseFloat(b)) || (a < b ? -1 : a > b));
  }

  // The snapshot `windowS` seconds before history[i] (or the oldest one), for rates.
  function before(history, i, windowS) {
    let j = i - 1;
    while (j > 0 && history[i].time - history[j].time < windowS) j--;
    return j >= 0 ? history[j] : null;
  }

  // Increase of `name`/`want` between two snapshots; null across a reset or when b lacks it.
  // A series the older snapshot lacks had not been touched yet: this server's counters and
  // buckets appear at their first increment, from 0 (a first request's TTFT is an increase).
  function increase(a, b, name, want) {
    const va = value(a, name, want) || 0, vb = value(b, name, want);
    if (vb == null || vb < va) return null;
    return vb - va;
  }

  // [[t, rate/s], ...] of a counter over the history.
  function rate(history, name, want, windowS) {
    const out = [];
    for (let i = 1; i < history.length; i++) {
      const a = before(history, i, windowS), b = history[i];
      const inc = increase(a, b, name, want), dt = b.time - a.time;
      out.push([b.time, inc == null || dt <= 0 ? null : inc / dt]);
    }
    return out;
  }

  // [[t, num increase / den increase], ...]; null where the denominator did not move.
  function ratio(history, num, den, want, windowS) {
    const out = [];
    for (let i = 1; i < history.length; i++) {
      const a = before(history, i, windowS), b = history[i];
      const n = increase(a, b, num, want), d = increase(a, b, den, want);
      out.push([b.time, n == null || !d ? null : n / d]);
    }
    return out;
  }

  // [[t, value], ...] of a gauge.
  function gauge(history, name, want, scale) {
    return history.map(s => {
      const v = value(s, name, want);
      return [s.time, v == null ? null : v * (scale || 1)];
    });
  }

  // Prometheus' histogram_quantile over cumulative bucket increases [[le, count], ...].
  function quantile(q, buckets) {
    const b = buckets.slice().sort((x, y) => x[0] - y[0]);
    if (!b.length) return null;
    const total = b[b.length - 1][1];
    if (!(total > 0)) return null;
    const rank = q * total;
    let prevLe = 0, prevCount = 0;
    for (const [le, count] of b) {
      if (count >= rank) {
        if (!isFinite(le)) return prevLe;  // in the +Inf bucket: its lower bound
        if (count === prevCount) return le;
        return prevLe + (le - prevLe) * (rank - prevCount) / (count - prevCount);
      }
      prevLe = le; prevCount = count;
    }
    return prevLe;
  }

  // The bucket increases of histogram `base` between two snapshots.
  function bucketIncrease(a, b, base, want) {
    const out = [];
    for (const le of labelValues(b, base + "_bucket", "le", want)) {
      const inc = increase(a, b, base + "_bucket", {...want, le});
      if (inc == null) return [];
      out.push([le === "+Inf" ? Infinity : parseFloat(le), inc]);
    }
    return out;
  }

  function quantiles(history, base, q, want, windowS) {
    const out = [];
    for (let i = 1; i < history.length; i++) {
      const a = before(history, i, windowS), b = history[i];
      out.push([b.time, quantile(q, bucketIncrease(a, b, base, want))]);
    }
    return out;
  }

  // [[running, mean K], ...]: the mean K of the steps in each window and the running count.
  function kByBatch(history, want, windowS) {
    const out = [];
    for (let i = 1; i < history.length; i++) {
      const a = before(history, i, windowS), b = history[i];
      let steps = 0, ksum = 0;
      for (const k of labelValues(b, "spec_decode_steps_total", "k", want)) {
        const inc = increase(a, b, "spec_decode_steps_total", {...want, k}) || 0;
        steps += inc; ksum += inc * parseFloat(k);
      }
      const running = value(b, "num_requests_running", want);
      if (steps > 0 && running != null) out.push([running, ksum / steps]);
    }
    return out;
  }

  // Data parallelism: the rank labels ("all" first), or [] for a single engine.
  function ranks(snap) {
    const r = labelValues(snap, "num_requests_running", "rank");
    return r.includes("all") ? ["all", ...r.filter(x => x !== "all")] : r;
  }

  return {value, labelValues, rate, ratio, gauge, quantile, quantiles, kByBatch, ranks};
})();
