"""A rank stopped with SIGSTOP is named by its silent heartbeat, not by the step exchange's
timeout (set far beyond this test's reach): the front end kills it, the other rank's requests
complete, and only the stopped rank's streamed requests fail, naming it (§7d)."""

from __future__ import annotations

import os
import signal
import time

from dynaspec import LLM, SamplingParams
from tests.e2e.dp_helpers import assert_processes_gone, finish_all

EXCHANGE_TIMEOUT_S = 120.0  # the backstop: far longer than this test may take
# Generous for a loaded machine (the default is 1 s): this test is about which rule fires.
HEARTBEAT_TIMEOUT_S = 3.0


def test_a_stopped_rank_is_named_by_its_heartbeat_and_the_other_serves_on(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, data_parallel_size=2,
              dp_rank_timeout_s=EXCHANGE_TIMEOUT_S, dp_heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    eng = llm.engine
    pids = eng.rank_pids()
    try:
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        ids = [eng.add_request([5 + k, 6, 7, 5 + k, 6], params, dp_rank=k % 2) for k in range(4)]
        deadline = time.monotonic() + 60
        while not all(eng.records[rid].token_ids for rid in ids):
            assert time.monotonic() < deadline, "a request streamed nothing"
            eng._backlog = eng.step() + eng._backlog
        os.kill(pids[1], signal.SIGSTOP)  # rank 0 now waits on it in the step exchange
        t0 = time.monotonic()
        final = finish_all(eng, timeout_s=EXCHANGE_TIMEOUT_S / 2)
        loss_s = eng.resilience.loss_times[0] - t0
        for k, rid in enumerate(ids):
            out = final[rid]
            if k % 2:  # streamed on the stopped rank
                assert out.finish_reason == "error", out
                assert "data-parallel rank 1 stopped answering (no heartbeat for" in out.error, \
                    out.error
            else:  # rank 0 stepped on in a group of its own
                assert out.finish_reason == "length" and len(out.token_ids) == 200, out
        assert eng.resilience.rank_losses == 1, eng.resilience
        # Well inside the exchange's backstop: the heartbeat rule named it.
        assert loss_s < EXCHANGE_TIMEOUT_S / 4, loss_s
        print(f"stopped rank named {loss_s:.2f} s after SIGSTOP; longest heartbeat gap seen "
              f"{eng.sup.watch.beats.longest_gap_s:.2f} s")
        assert_processes_gone([pids[1]])  # killed by the front end, not left stopped
        assert eng.failure() is None and eng.health()["status"] == "degraded"
        eng.check_integrity()
    finally:
        llm.shutdown()
    assert_processes_gone(set(pids.values()) | set(eng.rank_pids().values()))
