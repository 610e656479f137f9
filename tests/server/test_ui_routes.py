"""The page's routes on a live server with n-gram speculation: the page and its assets (nothing
from another origin), /ui/live saying exactly what /metrics says and matching its published
schema, `--no-ui`, and the opt-in per-step records in a stream (stream_options extension)."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from dynaspec.server.api_server import build_app
from dynaspec.server.ui.live import DASHBOARD_SERIES, LIVE_SCHEMA
from tests.cost_tables import FREE_VERIFY
from tests.server.conftest import MODEL

# Repetitive, so the n-gram drafter finds matches and drafts are verified.
PROMPT = "one two three four five six. one two three four five six. one two three four"


@pytest.fixture(scope="module")
def server(live_server_factory):
    return live_server_factory(speculator="ngram", num_spec_tokens=4, cost_table=FREE_VERIFY)


def test_the_page_and_its_assets_are_served_from_the_package(server):
    r = httpx.get(server.url + "/", follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "/ui"
    page = httpx.get(server.url + "/ui")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert refs and all(r.startswith("/ui/") or r.startswith("data:") for r in refs), refs
    for ref in refs:
        if ref.startswith("/ui/"):
            asset = httpx.get(server.url + ref)
            assert asset.status_code == 200 and asset.content, ref
            # Nothing of the page reaches for another origin (no CDN, no fonts, no analytics).
            assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", asset.text), ref
    missing = httpx.get(server.url + "/ui/nothing.js")
    assert missing.status_code == 404 and "nothing.js" in missing.json()["error"]["message"]


def _metrics_samples(url: str) -> dict[tuple, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name.removeprefix("dynaspec:"), labels)] = s.value
    return out


def _live_samples(live: dict) -> dict[tuple, float]:
    return {(name, tuple(sorted(labels.items()))): value
            for name, samples in live["series"].items() for labels, value in samples}


def test_live_says_what_metrics_says(server):
    client = server.client()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    server.wait_idle()
    live = httpx.get(server.url + "/ui/live").json()
    metrics = {key: v for key, v in _metrics_samples(server.url).items()
               if key[0] in DASHBOARD_SERIES}
    assert _live_samples(live) == metrics  # the same samples: one source of truth
    assert set(live["series"]) == set(DASHBOARD_SERIES)  # every one the dashboard draws
    assert live["prefix"] == "dynaspec:" and live["model_name"] == MODEL
    assert live["state"]["num_running"] == 0 and live["state"]["kv_num_blocks"] > 0
    assert sum(v for _, v in live["series"]["spec_decode_num_drafted_tokens_per_pos_total"]) > 0


def test_live_matches_its_published_schema(server):
    import jsonschema

    spec = httpx.get(server.url + "/openapi.json").json()
    schema = spec["paths"]["/ui/live"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]
    assert schema == json.loads(json.dumps(LIVE_SCHEMA))
    jsonschema.Draft202012Validator(schema).validate(httpx.get(server.url + "/ui/live").json())
    assert "/ui" not in spec["paths"] and "/" not in spec["paths"]  # the page is not an API


def test_no_ui_leaves_the_page_out(server):
    from starlette.testclient import TestClient

    # Not entered as a context manager: no lifespan, so the shared engine is not shut down.
    for ui in (False, True):
        client = TestClient(build_app(server.async_engine, MODEL, ui=ui))
        assert client.get("/metrics").status_code == 200
        for path in ("/", "/ui", "/ui/live", "/ui/charts.js"):
            r = client.get(path, follow_redirects=False)
            want = (307 if path == "/" else 200) if ui else 404
            assert r.status_code == want, (ui, path, r.status_code)
        assert ("/ui/live" in client.get("/openapi.json").json()["paths"]) == ui


def _stream(url: str, **extra) -> list[dict]:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "stream": True, **extra}
    chunks = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks


def test_stream_steps_add_up_to_the_requests_summary(server):
    chunks = _stream(server.url, stream_options={"include_usage": True,
                                                 "include_spec_steps": True})
    steps = [c["dynaspec"]["step"] for c in chunks if "step" in c.get("dynaspec", {})]
    final = next(c["dynaspec"]["spec"] for c in chunks if "spec" in c.get("dynaspec", {}))
    usage = chunks[-1]["usage"]
    assert steps and all(s["k"] is not None and s["drafted"] <= s["k"] for s in steps)
    assert len(steps) == final["num_steps"]  # one record per step that emitted tokens
    assert sum(s["drafted"] for s in steps) == final["num_draft_tokens"] > 0
    assert sum(s["accepted"] for s in steps) == final["num_accepted_tokens"]
    assert sum(s["tokens"] for s in steps) == usage["completion_tokens"] == final[
        "num_emitted_tokens"] > 0
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    plain = _stream(server.url)  # the same greedy answer without the option...
    assert "".join(c["choices"][0]["text"] for c in plain if c["choices"]) == text
    # ... and no chunk but the final one carries the extension (the old stream, unchanged).
    assert [c for c in plain if "dynaspec" in c] == [plain[-1]]
    assert "step" not in plain[-1]["dynaspec"]


def test_stream_options_refuses_a_wrong_type(server):
    r = httpx.post(server.url + "/v1/completions", json={
        "model": MODEL, "prompt": "hi", "max_tokens": 1, "stream": True,
        "stream_options": {"include_spec_steps": "yes"}})
    assert r.status_code == 400 and "include_spec_steps" in r.json()["error"]["message"]
