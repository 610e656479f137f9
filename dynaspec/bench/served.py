"""`dynaspec bench served`: two OpenAI servers under a real load client, paired, per concurrency.

Each arm is a server command (`dynaspec serve ...`, `vllm serve ...`, anything that answers
`/v1/models`); `{concurrency}` in it is replaced by the run's concurrency (vLLM's
`--max-num-seqs {concurrency}`). For every concurrency the arms alternate (docs/design.md §8):
each server is started alone, NVIDIA aiperf (streaming chat, fixed concurrency, input/output
lengths, `ignore_eos`) loads it after a warm-up, and it is stopped before the other starts, so
the two never share the CPU with each other, only with aiperf.

Per run it keeps aiperf's output tokens/s, requests/s, TTFT and ITL p50/p99 and errors, the
server's own latency histograms over the run (their means, from `/metrics`: what the engine saw,
against what the client saw), and the CPU seconds of every thread of the server's processes and
of aiperf (where the cores went). The report gives per concurrency and arm the medians and the
paired B/A ratios with 95% intervals; `--write-md` puts that table into a results file.

aiperf lives in its own venv (`--aiperf PATH`); its tokenizer is a local folder (`--tokenizer`),
because its built-in one downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field

from dynaspec.bench.served_probe import cpu_seconds, histogram_means, scrape
from dynaspec.bench.served_report import report, write_md
from dynaspec.bench.stats import run_order


@dataclass(frozen=True)
class ServedRun:
    arm: str
    pair: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    requests_ok: int
    errors: int
    concurrency: int = 0
    ttft_p99_ms: float = 0.0
    itl_p99_ms: float = 0.0
    request_per_s: float = 0.0
    server_means_s: dict = field(default_factory=dict)  # /metrics histogram means over the run
    cpu_s: dict = field(default_factory=dict)  # CPU seconds by process/thread, aiperf, wall


def register(bsub) -> None:
    p = bsub.add_parser("served", help="two servers under aiperf load, alternating, paired",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="arm A's server command (its --port must be "
                   "--port-a; {concurrency} is replaced)")
    p.add_argument("--b", required=True, help="arm B's server command")
    p.add_argument("--label-a", default="a", help="arm A's name in the report")
    p.add_argument("--label-b", default="b", help="arm B's name in the report")
    p.add_argument("--port-a", type=int, default=8301, help="port arm A listens on")
    p.add_argument("--port-b", type=int, default=8302, help="port arm B listens on")
    p.add_argument("--aiperf", required=True, help="the aiperf executable (its own venv)")
    p.add_argument("--tokenizer", required=True, help="a local HF tokenizer folder for aiperf")
    p.add_argument("--concurrency", default="16",
                   help="requests in flight; a comma list runs each in turn (e.g. 1,16,64)")
    p.add_argument("--requests", type=int, default=None,
                   help="requests per run (default: --requests-per-client x concurrency)")
    p.add_argument("--requests-per-client", type=int, default=10)
    p.add_argument("--warmup", type=int, default=None,
                   help="warm-up requests before each measured run (default: the concurrency)")
    p.add_argument("--isl", type=int, default=230, help="synthetic input tokens per request")
    p.add_argument("--osl", type=int, default=48, help="output tokens per request (ignore_eos)")
    p.add_argument("--pairs", type=int, default=3, help="A/B pairs per concurrency")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /v1/models")
    p.add_argument("--out", default=None, help="directory for aiperf artifacts and results.json "
                   "(runs of other concurrencies already there are kept and reported too)")
    p.add_argument("--write-md", default=None, metavar="PATH",
                   help="write the table into this markdown file (its bench-served section)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = args.out or tempfile.mkdtemp(prefix="served-")
    os.makedirs(out, exist_ok=True)
    levels = [int(c) for c in str(args.concurrency).split(",")]
    runs = [r for r in _load_runs(out) if r.concurrency not in levels]
    for conc in levels:
        arms = {"a": (args.a.replace("{concurrency}", str(conc)), args.port_a),
                "b": (args.b.replace("{concurrency}", str(conc)), args.port_b)}
        for pair, arm in run_order(args.pairs):
            cmd, port = arms[arm]
            log = os.path.join(out, f"server-c{conc}-{arm}-{pair}.log")
            with _server(cmd, port, log, args.start_timeout) as server:
                art = os.path.join(out, f"aiperf-c{conc}-{arm}-{pair}")
                runs.append(_load(args, arm, pair, conc, port, art, server.proc.pid))
            print(json.dumps(asdict(runs[-1])), flush=True)
    meta = {"a": args.a, "b": args.b, "label_a": args.label_a, "label_b": args.label_b,
            "isl": args.isl, "osl": args.osl, "requests_per_client": args.requests_per_client}
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"runs": [asdict(r) for r in runs], **meta}, f, indent=1)
    text = report(runs, meta)
    print(text)
    if args.write_md:
        write_md(args.write_md, text, meta)
        print(f"table written to {args.write_md}")
    print(f"artifacts in {out}/")
    return 0 if all(r.errors == 0 for r in runs) else 1


def _load_runs(out: str) -> list[ServedRun]:
    path = os.path.join(out, "results.json")
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [ServedRun(**r) for r in json.load(f)["runs"]]


class _server:
    """Start a server command in its own process group; stop the whole group on exit."""

    def __init__(self, cmd: str, port: int, log: str, timeout_s: float) -> None:
        self.cmd, self.port, self.log, self.timeout_s = cmd, port, log, timeout_s

    def __enter__(self) -> _server:
        self.f = open(self.log, "w", encoding="utf-8")
        self.proc = subprocess.Popen(shlex.split(self.cmd), stdout=self.f, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.timeout_s
        while not _answers(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"server did not start (see {self.log}): {self.cmd}")
            time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.f.close()


def _answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def _aiperf_cmd(args: argparse.Namespace, url: str, model: str, conc: int, out: str) -> list[str]:
    requests = args.requests or args.requests_per_client * conc
    warmup = conc if args.warmup is None else args.warmup
    cmd = [args.aiperf, "profile", "--url", url, "--model", model, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", args.tokenizer, "--use-server-token-count",
           "--concurrency", str(conc), "--request-count", str(requests),
           "--isl", str(args.isl), "--osl", str(args.osl), "--extra-inputs", "ignore_eos:true",
           "--workers-max", str(conc), "--record-processor-service-count", "1",
           "--ui", "none", "--no-gpu-telemetry", "--output-artifact-dir", out]
    return cmd + (["--warmup-request-count", str(warmup)] if warmup else [])


def _load(args: argparse.Namespace, arm: str, pair: int, conc: int, port: int, out: str,
          server_pid: int) -> ServedRun:
    url = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    before, cpu_before = scrape(url), cpu_seconds(server_pid)
    kids_before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    with open(out + ".log", "w", encoding="utf-8") as f:
        subprocess.run(_aiperf_cmd(args, url, model, conc, out), stdout=f,
                       stderr=subprocess.STDOUT, check=False)
    wall, kids = time.monotonic() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = {k: round(v - cpu_before.get(k, 0.0), 2) for k, v in cpu_seconds(server_pid).items()}
    cpu = {k: v for k, v in sorted(cpu.items(), key=lambda kv: -kv[1]) if v >= 0.05}
    cpu["aiperf (all its processes)"] = round(
        kids.ru_utime + kids.ru_stime - kids_before.ru_utime - kids_before.ru_stime, 2)
    cpu["wall (warm-up included)"] = round(wall, 2)
    summary = _find(out, "profile_export_aiperf.json")
    if summary is None:
        raise RuntimeError(f"aiperf wrote no summary (see {out}.log)")
    with open(summary, encoding="utf-8") as f:
        d = json.load(f)
    return ServedRun(arm, pair, _stat(d, "output_token_throughput", "avg"),
                     _stat(d, "time_to_first_token", "p50"), _stat(d, "inter_token_latency", "p50"),
                     int(_stat(d, "request_count", "avg")),
                     int(_stat(d, "error_request_count", "avg")), conc,
                     _stat(d, "time_to_first_token", "p99"), _stat(d, "inter_token_latency", "p99"),
                     _stat(d, "request_throughput", "avg"),
                     histogram_means(before, scrape(url)), cpu)


def _find(root: str, name: str) -> str | None:
    for dirpath, _, files in os.walk(root):
        if name in files:
            return os.path.join(dirpath, name)
    return None


def _stat(d: dict, key: str, stat: str) -> float:
    v = d.get(key)
    if v is None:  # some aiperf versions nest the metrics
        v = next((d[k][key] for k in ("records", "metrics")
                  if isinstance(d.get(k), dict) and key in d[k]), None)
    if isinstance(v, dict):
        v = v.get(stat)
    return float(v) if isinstance(v, (int, float)) else 0.0
