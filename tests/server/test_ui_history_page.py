"""The dashboard script (ui/static/dashboard.js) under Node with a stub page and fetch: it starts
from /ui/history's samples before its first /ui/live poll, and the goodput chart's empty text is
the server's reason when the goodput policy is not running. Skips where Node is not installed
(the browser test covers the page in Chromium)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

STATIC = Path(__file__).resolve().parents[2] / "dynaspec" / "server" / "ui" / "static"
NOTE = "the K policy running is 'table' (--k-policy auto): goodput fell back to the table"

# `node -e HARNESS answers static_dir` (process.argv[1] and [2]). Stubs for what the script
# touches: elements by id, fetch of the two routes, the playground's health line and the charts
# (recording what they were asked to draw).
HARNESS = """
const vm = require("vm");
const fs = require("fs");
const drawn = {};
const el = () => ({textContent: "", classList: {contains: () => false},
                   querySelector: () => ({textContent: ""})});
const answers = JSON.parse(process.argv[1]);
const ctx = {
  console, setInterval: () => 0, clearInterval: () => 0,
  document: {getElementById: el},
  fetch: async (url) => ({ok: true, json: async () => answers[url]}),
  DSPlayground: {health: () => {}},
  DSCharts: {lines: (box, series, opts) => { drawn[series.length + ":" + opts.emptyText] = 1; },
             scatter: () => {}},
};
vm.createContext(ctx);
// Top-level consts are shared between the scripts of one context (as between a page's
// scripts); the last line hands the dashboard to this harness.
const read = (f) => fs.readFileSync(process.argv[2] + "/" + f, "utf8");
vm.runInContext(read("series.js"), ctx);
vm.runInContext(read("dashboard.js") + "\\nthis.DSDashboard = DSDashboard;", ctx);
(async () => {
  await ctx.DSDashboard.start();
  await new Promise(r => setTimeout(r, 50));
  ctx.DSDashboard.draw();
  console.log(JSON.stringify({times: ctx.DSDashboard.history().map(s => s.time),
                              note: ctx.DSDashboard.goodputNote(), drawn: Object.keys(drawn)}));
})();
"""


def _sample(t: float, generated: float) -> dict:
    return {"time": t, "prefix": "dynaspec:", "model_name": "m",
            "series": {"generation_tokens_total": [[{}, generated]],
                       "num_requests_running": [[{}, 0.0]]},
            "state": {"kv_num_blocks": 8, "kv_free_blocks": 8}}


def test_the_page_starts_from_the_servers_history():
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed (the browser test covers the page)")
    answers = {"/ui/history": {"interval_s": 5, "span_s": 300, "goodput_note": NOTE,
                               "samples": [_sample(100.0 + 5 * i, 10.0 * i) for i in range(4)]},
               "/ui/live": _sample(121.0, 40.0)}
    out = subprocess.run([node, "-e", HARNESS, json.dumps(answers), str(STATIC)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["times"] == [100.0, 105.0, 110.0, 115.0, 121.0]  # history first, then the poll
    assert got["note"] == NOTE
    assert any(key.endswith(NOTE) for key in got["drawn"]), got["drawn"]  # the goodput chart
