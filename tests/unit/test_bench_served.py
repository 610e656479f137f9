"""`bench served`: servers started alone in turn, aiperf's summary read, the pair reported."""

from __future__ import annotations

import json
import sys
import textwrap

from dynaspec.cli.main import main


def _fake_server(tmp_path) -> str:
    """A tiny HTTP server answering /v1/models on the port given as its argument."""
    path = tmp_path / "server.py"
    path.write_text(textwrap.dedent('''
        import http.server, json, sys
        class H(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                body = json.dumps({"data": [{"id": "m"}]}).encode()
                self.send_response(200); self.end_headers(); self.wfile.write(body)
            def log_message(self, *a): pass
        http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    '''))
    return str(path)


def _fake_aiperf(tmp_path) -> str:
    """Writes a summary whose throughput is the port number / 100 (so arms differ)."""
    path = tmp_path / "aiperf"
    path.write_text(textwrap.dedent(f'''\
        #!{sys.executable}
        import json, os, sys
        a = sys.argv
        url, out = a[a.index("--url") + 1], a[a.index("--output-artifact-dir") + 1]
        port = int(url.rsplit(":", 1)[1])
        os.makedirs(out, exist_ok=True)
        conc = int(a[a.index("--concurrency") + 1])
        json.dump({{"output_token_throughput": {{"avg": port / 100}},
                   "time_to_first_token": {{"p50": 100.0 * conc, "p99": 150.0 * conc}},
                   "inter_token_latency": {{"p50": 20.0, "p99": 30.0}},
                   "request_throughput": {{"avg": port / 1000}},
                   "request_count": {{"avg": int(a[a.index("--request-count") + 1])}},
                   "error_request_count": {{"avg": 0}}}},
                  open(os.path.join(out, "profile_export_aiperf.json"), "w"))
    '''))
    path.chmod(0o755)
    return str(path)


def test_alternates_arms_and_reports_the_paired_ratio(tmp_path, capsys):
    server = _fake_server(tmp_path)
    rc = main(["bench", "served", "--a", f"{sys.executable} {server} 8391",
               "--b", f"{sys.executable} {server} 8491", "--port-a", "8391", "--port-b", "8491",
               "--aiperf", _fake_aiperf(tmp_path), "--tokenizer", str(tmp_path), "--pairs", "2",
               "--out", str(tmp_path / "out"), "--start-timeout", "30"])
    assert rc == 0
    text = capsys.readouterr().out
    runs = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    assert [r["arm"] for r in runs] == ["a", "b", "a", "b"]
    assert "- c16: output tok/s 1.01x [1.01, 1.01]" in text
    results = json.load(open(tmp_path / "out" / "results.json"))
    assert {r["output_tok_s"] for r in results["runs"]} == {83.91, 84.91}


def test_each_concurrency_in_turn_into_one_markdown_table(tmp_path, capsys):
    server = _fake_server(tmp_path)
    md = tmp_path / "serving.md"
    md.write_text("# Serving\n\nkept text\n")
    argv = ["bench", "served", "--a", f"{sys.executable} {server} 8392",
            "--b", f"{sys.executable} {server} 8{{concurrency}}92", "--port-a", "8392",
            "--port-b", "8492", "--label-a", "ours", "--label-b", "theirs",
            "--aiperf", _fake_aiperf(tmp_path), "--tokenizer", str(tmp_path), "--pairs", "1",
            "--concurrency", "4", "--requests-per-client", "3", "--out", str(tmp_path / "out"),
            "--start-timeout", "30", "--write-md", str(md)]
    assert main(argv) == 0  # arm B's port comes from {concurrency}: 8492 only when replaced
    argv[argv.index("4")] = "1"
    b = argv.index("--b") + 1
    argv[b] = argv[b].replace("8{concurrency}92", "8492")
    assert main(argv) == 0  # a second concurrency into the same --out: both reported
    results = json.load(open(tmp_path / "out" / "results.json"))
    runs = {(r["concurrency"], r["arm"]): r for r in results["runs"]}
    assert set(runs) == {(4, "a"), (4, "b"), (1, "a"), (1, "b")}
    assert runs[(4, "a")]["requests_ok"] == 12 and runs[(1, "a")]["requests_ok"] == 3
    assert runs[(4, "b")]["ttft_p99_ms"] == 600.0 and runs[(4, "b")]["request_per_s"] == 8.492
    assert runs[(4, "a")]["cpu_s"]["wall (warm-up included)"] > 0
    text = md.read_text()
    assert text.startswith("# Serving\n\nkept text\n") and text.count("bench served: begin") == 1
    assert "| 1 | ours | 83.9 | 8.39 | 100 / 150 | 20.0 / 30.0 | 0 | 1 |" in text
    assert "| 4 | theirs | 84.9 | 8.49 | 400 / 600 |" in text
    assert "- c4: output tok/s 1.01x" in text and "Command: `python -m dynaspec.cli.main" in text
