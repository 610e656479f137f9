"""The engine core in its own process (`--engine-process`: the DP front end with one rank) is
killed with requests that had streamed nothing: they wait for the replacement and complete as
in a run without the loss, and a request that had streamed ends with an error naming the rank.
"""

from __future__ import annotations

import os
import signal
import time

from dynaspec import LLM, SamplingParams
from tests.e2e.conftest import assert_greedy_equal
from tests.e2e.dp_helpers import assert_processes_gone, finish_all


def test_unstreamed_requests_wait_for_the_replacement(tiny_llama_dir):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64, engine_process=True)
    eng = llm.engine
    pids = {eng.rank_pids()[0]}
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        prompts = [[5, 6, 7, 5, 6], [9, 10, 11]]
        ref = [o.token_ids for o in llm.generate(prompts, params)]  # without the loss
        first = eng.add_request([3, 4, 5], SamplingParams(temperature=0, max_tokens=200,
                                                          ignore_eos=True))
        deadline = time.monotonic() + 60
        while not eng.records[first].token_ids:
            assert time.monotonic() < deadline, "nothing streamed"
            eng._backlog = eng.step() + eng._backlog
        old = eng.rank_pids()[0]
        os.kill(old, signal.SIGSTOP)  # what it is sent now it never reads
        ids = [eng.add_request(p, params) for p in prompts]
        os.kill(old, signal.SIGKILL)
        final = finish_all(eng, timeout_s=180)
        assert final[first].finish_reason == "error"
        assert "data-parallel rank 0 died (exit code -9)" in final[first].error
        for k, rid in enumerate(ids):
            assert final[rid].finish_reason == "length", final[rid]
            assert_greedy_equal(tiny_llama_dir, prompts[k], ref[k], final[rid].token_ids, rid)
        r = eng.resilience
        assert (r.rank_losses, r.requeued, r.failed, r.replacements) == (1, 2, 1, 1), r
        pids.add(eng.rank_pids()[0])
        assert eng.health()["status"] == "ok"
    finally:
        llm.shutdown()
    assert_processes_gone(pids)
