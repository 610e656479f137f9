"""The multi-machine path on one machine: a front end that starts only rank 0, and a separate
`dynaspec dp-worker` for rank 1 that joins through the torchrun-style environment
(MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK) and the shared secret, over loopback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from dynaspec import LLM, SamplingParams
from dynaspec.dp.rendezvous import SECRET_ENV
from tests.e2e.dp_helpers import assert_processes_gone


def _two_free_ports() -> int:
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two adjacent free ports")


def test_worker_joins_through_the_standard_rendezvous(tiny_llama_dir, monkeypatch):
    port = _two_free_ports()
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": "2",
           "RANK": "1", SECRET_ENV: "test-secret"}
    worker = subprocess.Popen([sys.executable, "-m", "dynaspec.cli.main", "dp-worker",
                               "--model", tiny_llama_dir, "--dtype", "float32",
                               "--num-kv-blocks", "64"], env=env)
    try:
        monkeypatch.setenv(SECRET_ENV, "test-secret")
        llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, data_parallel_size=2,
                  dp_local_size=1, dp_master_addr="127.0.0.1", dp_master_port=port)
        pids = llm.engine.rank_pids()
        assert set(llm.engine.procs) == {0}  # rank 1 is not ours: it joined from the worker
        outs = llm.generate([[5, 6, 7], [8, 9, 10], [11, 12], [13, 14, 15]],
                            SamplingParams(temperature=0, max_tokens=8))
        assert all(len(o.token_ids) > 0 for o in outs)
        emitted = [c.num_emitted_tokens for c in llm.engine.query("counters")]
        assert all(n > 0 for n in emitted), emitted
        llm.shutdown()
        assert worker.wait(timeout=30) == 0  # the worker leaves when its rank is stopped
        assert_processes_gone(pids.values())
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def test_multi_machine_without_secret_is_refused(tiny_llama_dir, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(ValueError, match=SECRET_ENV):
        LLM(model=tiny_llama_dir, data_parallel_size=2, dp_local_size=1, dp_master_port=29555)


def test_front_end_killed_outright_leaves_no_rank(tiny_llama_dir, tmp_path):
    """SIGKILL the front end (no shutdown code runs): the kernel takes its ranks down too."""
    script = tmp_path / "front.py"
    script.write_text(  # no __main__ guard needed: ranks are fresh interpreters
        "import sys, time\n"
        "from dynaspec import LLM\n"
        f"llm = LLM(model={tiny_llama_dir!r}, dtype='float32', num_kv_blocks=32, "
        f"data_parallel_size=2)\n"
        "print(' '.join(map(str, llm.engine.rank_pids().values())), flush=True)\n"
        "time.sleep(600)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    front = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": root})
    try:
        pids = [int(p) for p in front.stdout.readline().split()]
        assert len(pids) == 2 and all(os.path.exists(f"/proc/{p}") for p in pids)
        front.kill()
        front.wait(10)
        assert_processes_gone(pids)
    finally:
        if front.poll() is None:
            front.kill()
            front.wait()
