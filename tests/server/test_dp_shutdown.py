"""`dynaspec serve --data-parallel-size 2` ends on SIGTERM within 10 s in every state (§7d):
healthy, a rank just killed (its replacement starting), a rank stopped with SIGSTOP (its peer
hung in the step exchange). No rank process is left behind, not even a zombie.

The server runs as a real process here: uvicorn re-raises the SIGTERM it caught once it
returns, so only a process shows what a user's Ctrl-C or `kill` does.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

import dynaspec
from tests.e2e.dp_helpers import assert_processes_gone

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(dynaspec.__file__)))
EXIT_BOUND_S = 10.0  # the contract (§7d); it takes about 0.2-2.5 s here


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(server_pid: int) -> list[int]:
    rows = subprocess.run(["ps", "-eo", "pid=,ppid=,args="], capture_output=True,
                          text=True).stdout.splitlines()
    return sorted(int(r.split()[0]) for r in rows
                  if int(r.split()[1]) == server_pid and "dynaspec.dp.rank" in r)


def _health(url: str) -> dict | None:
    try:
        return httpx.get(url + "/health", timeout=5).json()
    except httpx.HTTPError:
        return None


def _wait(cond, timeout_s: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.parametrize("state", ["healthy", "rank-killed-replacement-starting", "rank-hung"])
def test_sigterm_exits_within_10_s_and_leaves_no_rank(tiny_llama_dir, tmp_path, state):
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(tmp_path / "serve.log", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "dynaspec.cli.main", "serve", "--model", tiny_llama_dir,
         "--dtype", "float32", "--num-kv-blocks", "64", "--data-parallel-size", "2",
         "--port", str(port), "--log-level", "warning", "--dp-rank-timeout", "3"],
        cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    seen: set[int] = set()
    try:
        _wait(lambda: (_health(url) or {}).get("status") == "ok", 240, "the server")
        ranks = _ranks(server.pid)
        assert len(ranks) == 2, ranks
        seen |= set(ranks)
        if state == "rank-killed-replacement-starting":
            os.kill(ranks[1], signal.SIGKILL)
            _wait(lambda: (_health(url) or {}).get("ranks_starting") == [1]
                  and len(set(_ranks(server.pid)) - {ranks[1]}) == 2, 60,
                  "the replacement to start")
        elif state == "rank-hung":
            os.kill(ranks[1], signal.SIGSTOP)
            time.sleep(0.5)  # rank 0 is now waiting on it in the step exchange
        seen |= set(_ranks(server.pid))
        t0 = time.monotonic()
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
        elapsed = time.monotonic() - t0
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
        log.close()
    tail = (tmp_path / "serve.log").read_text(errors="replace")[-2000:]
    assert elapsed < EXIT_BOUND_S, f"{state}: SIGTERM took {elapsed:.1f} s\n{tail}"
    print(f"{state}: exited {elapsed:.2f} s after SIGTERM")
    assert_processes_gone(seen, timeout_s=15)
