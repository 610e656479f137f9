"""What a served run looks like from inside: a server's `/metrics` and its threads' CPU time.

Used by `bench served` (before and after each load run) and the disconnect reliability scenario.
Both only read: `/metrics` over HTTP, and /proc for the CPU seconds of every thread of every
process in the server's process group (the server is started as a group leader), so the same
probe works on any server, dynaspec's or vLLM's (whose engine core is a child process).
"""

from __future__ import annotations

import os
import re
import urllib.request

_SAMPLE = re.compile(r'^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)$')
_TICK = os.sysconf("SC_CLK_TCK")


def scrape(url: str) -> dict[str, float]:
    """`/metrics` as {'name{labels}': value} (label sets verbatim); {} when it cannot be read."""
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
            text = r.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m:
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                continue
    return out


def family(samples: dict[str, float], suffix: str, label: str | None = None) -> dict[str, float]:
    """The samples of the family named <prefix>:`suffix`, summed by `label`'s value ('' if none)."""
    out: dict[str, float] = {}
    for key, value in samples.items():
        name, _, labels = key.partition("{")
        if not name.endswith(":" + suffix):
            continue
        m = re.search(rf'{label}="([^"]*)"', labels) if label else None
        k = m.group(1) if m else ""
        out[k] = out.get(k, 0.0) + value
    return out


def histogram_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Mean of every `*_seconds` histogram over the interval between two scrapes, by its name
    without the prefix (e.g. time_to_first_token_seconds), where it saw observations."""
    means: dict[str, float] = {}
    names = {k.partition("{")[0] for k in after if k.partition("{")[0].endswith("_seconds_sum")}
    for name in sorted(names):
        base = name.split(":", 1)[-1][: -len("_sum")]
        total = _sum(after, name) - _sum(before, name)
        count = _sum(after, name[:-4] + "_count") - _sum(before, name[:-4] + "_count")
        if count > 0:
            means[base] = round(total / count, 4)
    return means


def _sum(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.partition("{")[0] == name)


def cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of the threads of the processes in group `pgid`,
    summed by 'process name/thread name' (threads of one name, e.g. a pool, are added up)."""
    out: dict[str, float] = {}
    for pid in _group(pgid):
        proc = _comm(f"/proc/{pid}")
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            stat = _stat_fields(f"/proc/{pid}/task/{tid}/stat")
            if stat is None:
                continue
            key = f"{proc}/{_comm(f'/proc/{pid}/task/{tid}')}"
            out[key] = out.get(key, 0.0) + (int(stat[11]) + int(stat[12])) / _TICK
    return out


def _group(pgid: int) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = _stat_fields(f"/proc/{entry}/stat")
            if stat is not None and int(stat[2]) == pgid:
                pids.append(int(entry))
    return pids


def _stat_fields(path: str) -> list[str] | None:
    """The fields after the command name (field 3 on: state, ppid, pgrp, ...)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2:].split()


def _comm(path: str) -> str:
    try:
        with open(path + "/comm", encoding="utf-8", errors="replace") as f:
            return f.read().strip()
    except OSError:
        return "?"
