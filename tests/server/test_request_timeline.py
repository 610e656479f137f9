"""server/request_timeline.py (DYNASPEC_REQUEST_TIMELINE): a served request's marks come in
causal order on one clock, the engine's steps are logged beside them, and
bench/served_timeline.py turns the file into intervals."""

from __future__ import annotations

import json

import httpx

from dynaspec.bench.local_server import LocalServer
from dynaspec.bench.served_timeline import summarize
from dynaspec.server.request_timeline import ENV

ORDER = ("accept", "tokenized", "added", "first_token", "first_delta", "first_write", "done")


def test_marks_in_causal_order_and_steps_logged(tiny_llama_dir, tmp_path, monkeypatch):
    path = tmp_path / "timeline.jsonl"
    monkeypatch.setenv(ENV, str(path))
    kwargs = {"model": tiny_llama_dir, "dtype": "float32", "num_kv_blocks": 64,
              "max_model_len": 256}
    with LocalServer(kwargs, model_name="m") as server:
        for i in range(3):
            body = {"model": "m", "prompt": f"a b c {i}", "max_tokens": 6, "ignore_eos": True,
                    "temperature": 0, "stream": True}
            with httpx.stream("POST", server.url + "/v1/completions", json=body,
                              timeout=60) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
        r = httpx.post(server.url + "/v1/completions", json={**body, "stream": False},
                       timeout=60)
        assert r.status_code == 200
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    reqs = [x for x in lines if x["kind"] == "request"]
    steps = [x for x in lines if x["kind"] == "step"]
    assert len(reqs) == 4 and len({r["id"] for r in reqs}) == 4
    for r in reqs[:3]:  # streamed: every mark, each no earlier than the one before
        marks = [r[k] for k in ORDER]
        assert marks == sorted(marks), r
        assert r["deltas"] >= 1 and r["chunks"] >= 1
    assert set(ORDER) - {"first_delta", "first_write"} <= set(reqs[3])  # not streamed
    assert sum(s["prompt_tokens"] for s in steps) >= 4 * 4
    assert sum(s["generation_tokens"] for s in steps) == 4 * 6
    s = summarize(lines)
    assert s["requests"] == 4 and s["intervals_ms"]["engine_ttft"]["n"] == 4
    assert s["intervals_ms"]["server_ttft"]["n"] == 3 and s["engine"]["prefill_steps"] >= 4
    assert 0 < s["engine"]["busy_share"] <= 1
