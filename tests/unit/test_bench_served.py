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
        json.dump({{"output_token_throughput": {{"avg": port / 100}},
                   "time_to_first_token": {{"p50": 100.0}}, "inter_token_latency": {{"p50": 20.0}},
                   "request_count": {{"avg": 8}}, "error_request_count": {{"avg": 0}}}},
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
    assert "B/A output throughput: 1.012x" in text
    results = json.load(open(tmp_path / "out" / "results.json"))
    assert {r["output_tok_s"] for r in results["runs"]} == {83.91, 84.91}
