"""The page in a real browser: headless Chromium (Debian's /usr/bin/chromium, driven by
Playwright; no browser is downloaded) against a live server with the default model and n-gram
speculation. It sends a chat message, sees the streamed answer and its speculation stats agree
with the engine's own summary, sees every dashboard chart drawn with data, and checks that the
page asked nothing of any other origin. One screenshot per view goes to out/ui-screenshots/
(git-ignored; DYNASPEC_UI_SCREENSHOTS to change), and the paths are printed."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.cost_tables import FREE_VERIFY

CHROMIUM = os.environ.get("DYNASPEC_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(os.environ.get("DYNASPEC_UI_SCREENSHOTS",
                            Path(__file__).resolve().parents[2] / "out" / "ui-screenshots"))
# Repetitive text the answer copies, so the n-gram drafter's drafts are verified (greedy).
PROMPT = "Repeat exactly: one two three four five six. one two three four five six. one two three"
# Charts that must have data once one answer has finished (every chart of the dashboard).
CHARTS = ("tokens", "acceptance", "k-steps", "k-batch", "goodput", "skips", "ttft", "itl",
          "requests", "kv")


def _playwright():
    if not (os.path.exists(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        pytest.skip(f"no browser at {CHROMIUM} (apt-get install chromium; .ci/run does)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the Python package playwright is not installed (the test extra has it)")
    return sync_playwright


@pytest.fixture(scope="module")
def browser():
    sync_playwright = _playwright()
    with sync_playwright() as p:
        # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start;
        # --disable-dev-shm-usage: a container's small /dev/shm crashes its renderer.
        b = p.chromium.launch(executable_path=CHROMIUM,
                              args=["--no-sandbox", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture(scope="module")
def server(browser, live_server_factory):  # the browser first: a skip starts no server
    return live_server_factory(speculator="ngram", num_spec_tokens=4, cost_table=FREE_VERIFY)


def test_chat_and_dashboard_in_chromium(browser, server, capsys):
    page = browser.new_page(viewport={"width": 1400, "height": 1000})
    page.set_default_timeout(60_000)
    foreign, errors = [], []
    host = urlsplit(server.url).netloc

    def only_this_server(route):  # nothing may come from elsewhere (no CDN, no fonts)
        if urlsplit(route.request.url).netloc == host or route.request.url.startswith("data:"):
            route.continue_()
        else:
            foreign.append(route.request.url)
            route.abort()

    page.route("**/*", only_this_server)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    SHOTS.mkdir(parents=True, exist_ok=True)

    page.goto(server.url + "/")
    assert urlsplit(page.url).path == "/ui"  # / redirects to the page
    page.wait_for_selector("#model-card[data-loaded]")
    card = page.inner_text("#model-card")
    assert "yes, K up to 4" in card and "goodput" in card, card
    page.fill("[name=max_tokens]", "24")
    page.fill("#prompt", PROMPT)
    t0 = time.monotonic()
    page.click("#send")
    page.wait_for_selector(".msg.assistant[data-done]")
    answer = page.inner_text(".msg.assistant")
    assert answer.strip(), "no answer streamed"
    stat = {k: page.inner_text(f'[data-stat="{k}"]') for k in ("steps", "drafted", "accepted",
                                                              "tokens")}
    summary = page.locator("#answer-summary")
    # The per-step records the stream carried add up to the engine's summary of the request.
    assert int(stat["drafted"]) == int(summary.get_attribute("data-drafted")) > 0
    assert int(stat["accepted"]) == int(summary.get_attribute("data-accepted"))
    assert int(page.get_attribute("#k-strip", "data-steps")) == int(stat["steps"]) > 0
    assert int(stat["tokens"]) >= len(answer.split())  # every word took >= 1 token
    play = SHOTS / "playground.png"
    page.screenshot(path=str(play), full_page=True)

    page.click("#tab-dashboard")
    # Polled once a second: the charts fill within a few polls of the answer.
    for name in CHARTS:
        page.wait_for_selector(f"#chart-{name}[data-points]:not([data-points='0'])",
                               timeout=15_000)
    counts = {n: int(page.get_attribute(f"#chart-{n}", "data-series")) for n in CHARTS}
    assert all(counts.values()), counts
    assert counts["acceptance"] >= 1 and counts["goodput"] == 2, counts
    dash = SHOTS / "dashboard.png"
    page.screenshot(path=str(dash), full_page=True)
    with capsys.disabled():  # shown without -s too
        print(f"\nscreenshots: {play} {dash} ({time.monotonic() - t0:.1f} s from send)")

    assert not foreign, f"the page fetched from other origins: {foreign}"
    assert not errors, errors
    page.close()


def test_the_quantile_matches_prometheus(browser, server):
    """series.js's histogram_quantile on known buckets (the dashboard's TTFT/ITL lines)."""
    page = browser.new_page()
    page.goto(server.url + "/ui")
    page.wait_for_function("typeof DSSeries !== 'undefined'")
    q = "([q, b]) => DSSeries.quantile(q, b.map(([le, c]) => [le === 'inf' ? Infinity : le, c]))"
    buckets = [[0.1, 2], [0.2, 6], [0.4, 10], ["inf", 10]]
    # Prometheus: rank 5 of 10 lies in (0.1, 0.2] at (5-2)/(6-2) of the way: 0.175.
    assert page.evaluate(q, [0.5, buckets]) == pytest.approx(0.175)
    assert page.evaluate(q, [0.9, buckets]) == pytest.approx(0.2 + 0.2 * (9 - 6) / 4)
    assert page.evaluate(q, [0.99, [[1.0, 1], ["inf", 2]]]) == 1.0  # +Inf: its lower bound
    assert page.evaluate(q, [0.5, [[1.0, 0], ["inf", 0]]]) is None  # nothing observed
    page.close()


def _dp_snapshots() -> list[dict]:
    """Two /ui/live answers of a two-rank server, 5 s apart (live_stats over DPMetrics)."""
    from dynaspec.dp.metrics import DPMetrics
    from dynaspec.metrics.records import EngineSnapshot, RequestStepSpec, StepStats
    from dynaspec.server.ui.live import live_stats

    m, out = DPMetrics(2, {"model_name": "m"}, "dynaspec"), []
    for t in (100.0, 105.0):
        for rank in (0, 1):
            for _ in range(1 + rank):  # rank 1 runs twice the steps
                m.rank_step(rank, StepStats(k=2, requests=(RequestStepSpec("a", 2, 1, 2, None),),
                                            num_generation_tokens=2))
            m.rank_snapshot(
                rank,
                EngineSnapshot(
                    num_running=1 + rank,
                    num_waiting=0,
                    kv_usage=0.1,
                    kv_pool_tokens_target=1024,
                    kv_pool_tokens_drafter=0,
                    prefix_cache_queries=0,
                    prefix_cache_hits=0,
                    num_preemptions_total=0,
                    modelled_goodput=20.0,
                    observed_goodput=18.0,
                    k_policy="goodput",
                ),
            )
        live = live_stats(m, None, {"num_running": 3, "num_waiting": 0, "kv_usage": 0.1,
                                    "kv_num_blocks": 128, "kv_free_blocks": 100})
        out.append({**live, "time": t})
    return out


def test_data_parallel_draws_every_rank(browser, server):
    """Under data parallelism the dashboard draws a line per rank beside the total."""
    page = browser.new_page()
    page.goto(server.url + "/ui#dashboard")
    page.wait_for_function("typeof DSDashboard !== 'undefined'")
    page.evaluate("""snaps => { DSDashboard.stop(); const h = DSDashboard.history();
                                h.length = 0; h.push(...snaps); DSDashboard.draw(); }""",
                  _dp_snapshots())
    legend = page.inner_text("#chart-tokens .legend")
    for tag in ("generated (all ranks)", "generated (rank 0)", "generated (rank 1)"):
        assert tag in legend, legend
    assert "observed (rank 1)" in page.inner_text("#chart-goodput .legend")
    assert "2 ranks" in page.inner_text("#ranks-note")
    # rank 1 generated 4 tokens in the 5 s, rank 0 two: the lines' last values say so.
    rates = page.evaluate("""() => { const h = DSDashboard.history();
        return ["0", "1", "all"].map(r => DSSeries.rate(h, "generation_tokens_total",
                                                         {rank: r}, 10).pop()[1]); }""")
    assert rates == pytest.approx([2 / 5, 4 / 5, 6 / 5])
    page.close()


def test_skips_with_the_reason_without_a_browser(monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "CHROMIUM", "/nonexistent/chromium")
    with pytest.raises(pytest.skip.Exception, match="no browser at /nonexistent/chromium"):
        _playwright()
