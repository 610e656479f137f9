"""A real Prometheus (Debian's /usr/bin/prometheus, which .ci/run installs) scrapes running servers
under traffic every second, and every panel query of deploy/grafana/dynaspec.json, evaluated
through Prometheus' HTTP API, returns data: one engine with the default prefix, one with
`--metrics-prefix vllm`, and data parallelism (2 ranks) where the per-rank panels have one series
per rank. Skips, naming why, where Prometheus is not installed."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.cost_tables import FREE_VERIFY
from tests.server.conftest import MODEL
from tests.server.test_ui_grafana import load, panels

PROMETHEUS = os.environ.get("DYNASPEC_PROMETHEUS", "/usr/bin/prometheus")
RATE_WINDOW = "10s"  # $__rate_interval: ten 1 s scrapes
# Repetitive, so the n-gram drafter finds matches and drafts are verified; the random model
# rejects most, so the policy also runs K=0 steps and requests skip drafting.
PROMPTS = ["one two three four five six. one two three four five six. one two three",
           "a b c d a b c d a b c d a b", "def f(x):\n    return x\n\ndef f(x):\n    return"]
COMMON = dict(dtype="float32", max_model_len=256, num_kv_blocks=128, speculator="ngram",
              num_spec_tokens=3, cost_table=FREE_VERIFY)
# job (its series relabelled model_name=job, how the dashboard's $model_name picks a server),
# the prefix, and engine arguments.
SERVERS = {"single": ("dynaspec", {}), "vllm": ("vllm", {"metrics_prefix": "vllm"}),
           "dp2": ("dynaspec", {"data_parallel_size": 2, "max_num_seqs": 4})}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(targets: dict[str, str]) -> str:
    jobs = []
    for job, url in targets.items():
        jobs.append(f"""  - job_name: {job}
    scrape_interval: 1s
    scrape_timeout: 1s
    static_configs: [{{targets: ["{url.removeprefix('http://')}"]}}]
    metric_relabel_configs:
      - {{target_label: model_name, replacement: {job}}}
""")
    return "global: {evaluation_interval: 1s}\nscrape_configs:\n" + "".join(jobs)


@pytest.fixture(scope="module")
def prometheus_binary() -> str:
    if not (os.path.exists(PROMETHEUS) and os.access(PROMETHEUS, os.X_OK)):
        pytest.skip(f"no Prometheus at {PROMETHEUS} (apt-get install prometheus; .ci/run does, "
                    "and a failed install leaves this test skipped)")
    return PROMETHEUS


@pytest.fixture(scope="module")
def servers(prometheus_binary, live_server_factory, tiny_llama_dir):
    return {job: live_server_factory(model=tiny_llama_dir, **COMMON, **kw)
            for job, (_, kw) in SERVERS.items()}


@pytest.fixture(scope="module")
def prometheus(prometheus_binary, servers, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("prometheus")
    (tmp / "prometheus.yml").write_text(_config({job: s.url for job, s in servers.items()}))
    url = f"http://127.0.0.1:{_free_port()}"
    log = open(tmp / "prometheus.log", "wb")
    proc = subprocess.Popen([prometheus_binary, f"--config.file={tmp / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp / 'data'}",
                             f"--web.listen-address={url.removeprefix('http://')}"],
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_ready(url, proc, tmp / "prometheus.log")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
        shutil.rmtree(tmp / "data", ignore_errors=True)


def _wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"prometheus exited {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            if httpx.get(url + "/-/ready", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"prometheus not ready in 30 s: {log.read_text()[-2000:]}")


def _query(url: str, expr: str) -> list[dict]:
    r = httpx.get(url + "/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def _traffic(server) -> None:
    """Concurrent greedy completions: batches, drafts verified and rejected, finished requests."""
    def one(prompt: str) -> None:
        r = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True})
        assert r.status_code == 200, r.text

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


@pytest.fixture(scope="module")
def scraped(prometheus, servers) -> str:
    """Every server scraped before and after its traffic (a rate needs two samples in its
    window); returns once each has been scraped 3 times since the traffic ended."""
    _wait_scrapes(prometheus, len(servers), time.time(), 2)
    for server in servers.values():
        _traffic(server)
    _wait_scrapes(prometheus, len(servers), time.time(), 3)
    return prometheus


def _wait_scrapes(url: str, num_jobs: int, since: float, count: int) -> None:
    """Until every job has `count` successful scrapes stamped after `since` (unix seconds)."""
    deadline = time.monotonic() + 30
    while True:
        done = {s["metric"]["job"] for s in _query(url, "up[30s]")
                if sum(float(t) > since and v == "1" for t, v in s["values"]) >= count}
        if len(done) == num_jobs:
            return
        assert time.monotonic() < deadline, f"only {sorted(done)} were scraped {count} times"
        time.sleep(0.2)


def _dashboard_queries(prefix: str, model_name: str) -> list[tuple[str, str, str]]:
    """(panel title, legend, expr) with the variables filled as Grafana would."""
    subs = {"${prefix}": prefix, "$__rate_interval": RATE_WINDOW, "$model_name": model_name}
    out = []
    for p in panels(load()):
        for t in p["targets"]:
            expr = t["expr"]
            for var, value in subs.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"{p['title']}: a variable left in {expr}"
            out.append((p["title"], t.get("legendFormat", ""), expr))
    return out


@pytest.mark.parametrize("job", list(SERVERS))
def test_every_panel_query_returns_data(scraped, job):
    prefix, _ = SERVERS[job]
    empty = [f"{title}: {expr}" for title, _, expr in _dashboard_queries(prefix, job)
             if not _query(scraped, expr)]
    assert not empty, "panel queries without data:\n" + "\n".join(empty)


def test_per_rank_panels_have_a_series_per_rank_under_data_parallelism(scraped):
    per_rank = [(title, expr) for title, legend, expr in _dashboard_queries("dynaspec", "dp2")
                if "{{rank}}" in legend]
    assert len(per_rank) >= 5  # tokens, running, waiting, KV, goodput
    for title, expr in per_rank:
        ranks = {r["metric"].get("rank") for r in _query(scraped, expr)}
        assert ranks == {"0", "1"}, (title, expr, ranks)
    # One engine has no rank label: the same panels draw one series, not a rank "all".
    for title, expr in [(t, e) for t, legend, e in _dashboard_queries("dynaspec", "single")
                        if "{{rank}}" in legend]:
        assert {r["metric"].get("rank") for r in _query(scraped, expr)} == {None}, title


