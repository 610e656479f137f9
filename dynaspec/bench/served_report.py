"""The `bench served` table: per concurrency and arm the medians, the paired B/A ratios, and
where each arm's CPU time and latency went; `write_md` puts it into a results file."""

from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from dynaspec.bench.stats import paired_ratio

BEGIN, END = "<!-- bench served: begin -->", "<!-- bench served: end -->"
# The server's histograms shown beside the client's view (names as both servers write them).
_MEANS = ("time_to_first_token_seconds", "inter_token_latency_seconds",
          "e2e_request_latency_seconds", "request_queue_time_seconds",
          "request_prefill_time_seconds")


def _median(xs: Sequence[float]) -> float:
    s = sorted(xs)
    if not s:
        return 0.0
    return s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2


def _ratio(runs: list, key: str) -> str:
    """Paired B/A of one field over the pairs where both arms have it, with its 95% interval."""
    by_pair: dict[int, dict[str, float]] = {}
    for r in runs:
        by_pair.setdefault(r.pair, {})[r.arm] = getattr(r, key)
    pairs = [p for p in by_pair.values() if p.get("a", 0) > 0 and p.get("b", 0) > 0]
    if not pairs:
        return "-"
    est = paired_ratio([p["a"] for p in pairs], [p["b"] for p in pairs])
    ci = f" [{est.lo:.2f}, {est.hi:.2f}]" if est.lo is not None else ""
    return f"{est.ratio:.2f}x{ci}"


def report(runs: list, meta: dict[str, Any]) -> str:
    labels = {"a": meta.get("label_a", "a"), "b": meta.get("label_b", "b")}
    lines = [f"ISL ~{meta['isl']}, OSL {meta['osl']} (ignore_eos), streaming chat, aiperf on the "
             "same cores; medians over the pairs",
             "",
             "| c | server | output tok/s | req/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | "
             "errors | runs |",
             "|---|---|---|---|---|---|---|---|"]
    ratios = ["", f"Paired {labels['b']} / {labels['a']} (95% interval over the pairs):", ""]
    for conc in sorted({r.concurrency for r in runs}):
        at = [r for r in runs if r.concurrency == conc]
        for arm in ("a", "b"):
            rs = [r for r in at if r.arm == arm]
            if not rs:
                continue
            m = {k: _median([getattr(r, k) for r in rs]) for k in (
                "output_tok_s", "request_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms",
                "itl_p99_ms")}
            lines.append(
                f"| {conc} | {labels[arm]} | {m['output_tok_s']:.1f} | {m['request_per_s']:.2f} "
                f"| {m['ttft_p50_ms']:.0f} / {m['ttft_p99_ms']:.0f} | {m['itl_p50_ms']:.1f} / "
                f"{m['itl_p99_ms']:.1f} | {sum(r.errors for r in rs)} | {len(rs)} |")
        ratios.append(f"- c{conc}: output tok/s {_ratio(at, 'output_tok_s')}, TTFT p50 "
                      f"{_ratio(at, 'ttft_p50_ms')}, ITL p50 {_ratio(at, 'itl_p50_ms')}")
    return "\n".join(lines + ratios + ["", *where(runs, labels)])


def where(runs: list, labels: dict[str, str]) -> list[str]:
    """Per concurrency and arm, the last run's CPU seconds (top threads, aiperf, wall) and the
    server's own mean latencies over the run, beside the client's TTFT p50."""
    out = ["Where the time went (the last run of each; CPU seconds by process/thread, and the "
           "server's own histogram means over the run):", ""]
    for conc in sorted({r.concurrency for r in runs}):
        for arm in ("a", "b"):
            rs = [r for r in runs if r.concurrency == conc and r.arm == arm]
            if not rs:
                continue
            r = rs[-1]
            cpu = ", ".join(f"{k} {v:.1f}" for k, v in list(r.cpu_s.items())[:6])
            means = ", ".join(f"{k.replace('_seconds', '')} {v * 1000:.0f} ms"
                              for k, v in r.server_means_s.items() if k in _MEANS)
            out.append(f"- c{conc} {labels[arm]}: CPU {cpu or '-'}; server means: {means or '-'}")
    return out


def write_md(path: str, table: str, meta: dict[str, Any]) -> None:
    """Replace (or append) the bench-served section of `path` with the table, headed by the
    commit, the CPU, the date and the command."""
    argv = sys.argv[sys.argv.index("served"):] if "served" in sys.argv else ["served"]
    command = "python -m dynaspec.cli.main bench " + " ".join(_quote(a) for a in argv)
    section = "\n".join([
        BEGIN,
        f"Commit {_commit()}, {datetime.date.today().isoformat()}, CPU: {_cpu_line()}.",
        "",
        f"Command: `{command}`",
        "",
        f"Arm A ({meta.get('label_a', 'a')}): `{meta['a']}`; arm B ({meta.get('label_b', 'b')}): "
        f"`{meta['b']}`.",
        "",
        table,
        END,
    ])
    text = open(path, encoding="utf-8").read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        text = text[:text.index(BEGIN)] + section + text[text.index(END) + len(END):]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def _quote(arg: str) -> str:
    return f"'{arg}'" if re.search(r"[\s{}$]", arg) else arg


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "?"


def _cpu_line() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            info = f.read()
    except OSError:
        return platform.processor() or "?"
    model = re.search(r"model name\s*:\s*(.*)", info)
    found = re.search(r"^flags\s*:\s*(.*)$", info, re.M)
    flags = set(found.group(1).split()) if found else set()
    isa = [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{os.cpu_count()} vCPUs, {model.group(1) if model else '?'} ({', '.join(isa)})"
