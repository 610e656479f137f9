"""Helpers for the data-parallel tests: drain an engine, check that rank processes are gone."""

from __future__ import annotations

import os
import subprocess
import time


def finish_all(eng, timeout_s: float = 120.0) -> dict:
    """Step until nothing is unfinished; the final output of each request."""
    final = {}
    deadline = time.monotonic() + timeout_s
    while eng.has_unfinished_requests():
        assert time.monotonic() < deadline, "requests did not finish in time"
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def assert_processes_gone(pids, timeout_s: float = 15.0) -> None:
    """No rank process left: not in /proc (reaped, not even a zombie) nor in `ps`."""
    pids = set(pids)
    deadline = time.monotonic() + timeout_s
    while any(os.path.exists(f"/proc/{p}") for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = {p for p in pids if os.path.exists(f"/proc/{p}")}
    listing = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    ranks = {int(line.split()[0]) for line in listing.splitlines() if "dynaspec.dp.rank" in line}
    assert not left and not (ranks & pids), f"rank processes left behind: {left | (ranks & pids)}"
