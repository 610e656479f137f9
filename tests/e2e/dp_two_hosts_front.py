"""The front end of tests/e2e/test_dp_two_hosts.py, run inside its own network namespace (host
A): rank 0 is its own, rank 1 joins from host B's `dynaspec dp-worker`. It speaks to the test
through stdout (one JSON object a line) and stdin (one line to go on after the test restarted
the worker), so the test process, outside both namespaces, can restart host B's worker.

argv: model folder, master address, port, the prompts as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

from dynaspec import LLM, SamplingParams

KW = dict(dtype="float32", num_kv_blocks=96, speculator="ngram", num_spec_tokens=3,
          k_schedule=[[1, 8, 2], [9, 64, 2]], prompt_lookup_min=1)


def say(**msg) -> None:
    print(json.dumps(msg), flush=True)


def lockstep(eng, start: list[int]) -> list[list]:
    """The ticks both ranks logged since `start`: each rank's (K, global requests, context)."""
    logs = [{t.tick: t for t in log[s:]} for log, s in zip(eng.query("decisions"), start)]
    common = sorted(set.intersection(*(set(log) for log in logs)))
    return [[[log[t].k, log[t].num_reqs, log[t].ctx_stat, log[t].rank_reqs] for log in logs]
            for t in common]


def finish(eng, timeout_s: float = 120.0) -> dict:
    final, deadline = {}, time.monotonic() + timeout_s
    while eng.has_unfinished_requests():
        if time.monotonic() > deadline:
            raise TimeoutError("requests did not finish in time")
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    return final


def main() -> None:
    model, addr, port, prompts = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
    llm = LLM(model=model, data_parallel_size=2, dp_local_size=1, dp_master_addr=addr,
              dp_master_port=port, dp_rank_timeout_s=30.0, **KW)
    eng = llm.engine
    pids = eng.rank_pids()
    hosts = {r: i.host for r, i in eng.ready.items()}
    greedy = SamplingParams(temperature=0, max_tokens=16)
    start = [len(log) for log in eng.query("decisions")]
    outs = llm.generate(prompts, greedy)
    say(phase="served", pids=pids, hosts=hosts, outputs=[o.token_ids for o in outs],
        emitted=[c.num_emitted_tokens for c in eng.query("counters")],
        ticks=lockstep(eng, start))
    # A remote rank lost mid-stream: its streamed requests fail naming it, rank 0's go on.
    long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    ids = [eng.add_request(p, long) for p in prompts[:4]]
    owners = {rid: eng.records[rid].rank for rid in ids}
    deadline = time.monotonic() + 60
    while not all(eng.records[i].token_ids for i in ids if owners[i] == 1):
        if time.monotonic() > deadline:
            raise TimeoutError("rank 1 streamed nothing")
        eng._backlog = eng.step() + eng._backlog
    os.kill(pids[1], signal.SIGKILL)  # one PID namespace: the test's hosts share it
    final = finish(eng)
    r = eng.resilience
    say(phase="lost", owners=[owners[i] for i in ids],
        finals=[[final[i].finish_reason, final[i].error or "", final[i].token_ids] for i in ids],
        counts=[r.rank_losses, r.failed], health=eng.health())
    sys.stdin.readline()  # the test has restarted host B's dp-worker
    serving = eng.wait_serving(2, timeout_s=180)
    start = [len(log) for log in eng.query("decisions")]
    outs = llm.generate(prompts, greedy) if serving else []
    say(phase="replaced", serving=serving, replacements=r.replacements, pids=eng.rank_pids(),
        outputs=[o.token_ids for o in outs], ticks=lockstep(eng, start) if serving else [],
        health=eng.health())
    llm.shutdown()


if __name__ == "__main__":
    main()
