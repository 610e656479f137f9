"""`dynaspec bench served`: two OpenAI servers under a real load client, paired.

Each arm is a server command (`dynaspec serve ...`, `vllm serve ...`, anything that answers
`/v1/models`). Arms alternate (docs/design.md §8): for every pair each server is started alone,
NVIDIA aiperf (streaming chat, fixed concurrency, input/output lengths, `ignore_eos`) loads it,
and it is stopped before the other starts, so the two never share the CPU. The report gives per
arm the median output tokens/s, TTFT p50 and ITL p50 and errors, and the paired B/A throughput
ratio with its 95% interval.

aiperf lives in its own venv (`--aiperf PATH`); its tokenizer is a local folder (`--tokenizer`),
because its built-in one downloads.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass

from dynaspec.bench.stats import paired_ratio, run_order


@dataclass(frozen=True)
class ServedRun:
    arm: str
    pair: int
    output_tok_s: float
    ttft_p50_ms: float
    itl_p50_ms: float
    requests_ok: int
    errors: int


def register(bsub) -> None:
    p = bsub.add_parser("served", help="two servers under aiperf load, alternating, paired",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--a", required=True, help="arm A's server command (its --port must be --port-a)"
    )
    p.add_argument("--b", required=True, help="arm B's server command")
    p.add_argument("--port-a", type=int, default=8301, help="port arm A listens on")
    p.add_argument("--port-b", type=int, default=8302, help="port arm B listens on")
    p.add_argument("--aiperf", required=True, help="the aiperf executable (its own venv)")
    p.add_argument("--tokenizer", required=True, help="a local HF tokenizer folder for aiperf")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight")
    p.add_argument("--requests", type=int, default=160, help="requests per run")
    p.add_argument("--isl", type=int, default=230, help="synthetic input tokens per request")
    p.add_argument("--osl", type=int, default=48, help="output tokens per request (ignore_eos)")
    p.add_argument("--pairs", type=int, default=3, help="A/B pairs")
    p.add_argument("--start-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer /v1/models")
    p.add_argument("--out", default=None, help="directory for aiperf artifacts and results.json")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    out = args.out or tempfile.mkdtemp(prefix="served-")
    os.makedirs(out, exist_ok=True)
    arms = {"a": (args.a, args.port_a), "b": (args.b, args.port_b)}
    runs: list[ServedRun] = []
    for pair, arm in run_order(args.pairs):
        cmd, port = arms[arm]
        log = os.path.join(out, f"server-{arm}-{pair}.log")
        with _server(cmd, port, log, args.start_timeout):
            runs.append(_load(args, arm, pair, port, os.path.join(out, f"aiperf-{arm}-{pair}")))
        print(json.dumps(asdict(runs[-1])), flush=True)
    _report(runs, args)
    with open(os.path.join(out, "results.json"), "w", encoding="utf-8") as f:
        json.dump({"runs": [asdict(r) for r in runs], "a": args.a, "b": args.b,
                   "concurrency": args.concurrency, "isl": args.isl, "osl": args.osl}, f, indent=1)
    print(f"artifacts in {out}/")
    return 0 if all(r.errors == 0 for r in runs) else 1


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


def _load(args: argparse.Namespace, arm: str, pair: int, port: int, out: str) -> ServedRun:
    url = f"http://127.0.0.1:{port}"
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    cmd = [args.aiperf, "profile", "--url", url, "--model", model, "--endpoint-type", "chat",
           "--streaming", "--tokenizer", args.tokenizer, "--use-server-token-count",
           "--concurrency", str(args.concurrency), "--request-count", str(args.requests),
           "--isl", str(args.isl), "--osl", str(args.osl), "--extra-inputs", "ignore_eos:true",
           "--workers-max", str(args.concurrency), "--record-processor-service-count", "1",
           "--ui", "none", "--no-gpu-telemetry", "--output-artifact-dir", out]
    with open(out + ".log", "w", encoding="utf-8") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, check=False)
    summary = _find(out, "profile_export_aiperf.json")
    if summary is None:
        raise RuntimeError(f"aiperf wrote no summary (see {out}.log)")
    with open(summary, encoding="utf-8") as f:
        d = json.load(f)
    return ServedRun(arm, pair, _stat(d, "output_token_throughput", "avg"),
                     _stat(d, "time_to_first_token", "p50"), _stat(d, "inter_token_latency", "p50"),
                     int(_stat(d, "request_count", "avg")),
                     int(_stat(d, "error_request_count", "avg")))


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


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _report(runs: list[ServedRun], args: argparse.Namespace) -> None:
    print(f"\nconcurrency {args.concurrency}, {args.requests} requests, ISL ~{args.isl}, "
          f"OSL {args.osl}, {args.pairs} pairs")
    print("| arm | output tok/s (median) | TTFT p50 ms | ITL p50 ms | errors |")
    print("|---|---|---|---|---|")
    for arm, cmd in (("a", args.a), ("b", args.b)):
        rs = [r for r in runs if r.arm == arm]
        print(
            f"| {arm}: `{cmd}` | {_median([r.output_tok_s for r in rs]):.1f} | "
            f"{_median([r.ttft_p50_ms for r in rs]):.0f} | "
            f"{_median([r.itl_p50_ms for r in rs]):.1f}"
            f" | {sum(r.errors for r in rs)} |"
        )
    a = [r.output_tok_s for r in sorted(runs, key=lambda r: r.pair) if r.arm == "a"]
    b = [r.output_tok_s for r in sorted(runs, key=lambda r: r.pair) if r.arm == "b"]
    if a and all(a) and all(b):
        est = paired_ratio(a, b)
        ci = f" [{est.lo:.3f}, {est.hi:.3f}]" if est.lo is not None else " (one pair: no interval)"
        print(f"B/A output throughput: {est.ratio:.3f}x{ci}")
    sys.stdout.flush()
