"""One arm of a paired run across two checkouts (issue 52's before/after check): run it from a
checkout's root with that checkout on PYTHONPATH, alternating the two checkouts:

    for p in 1 2 3; do for d in ../before ../after; do
      (cd $d && PYTHONPATH=. python /path/to/commit_pair_run.py "" code_edit 16 32 64); done; done

Arguments: engine flags (one string), workload, concurrency, prompts, max tokens (0: the
workload's own). `--data-parallel-size N` in the flags runs the data-parallel front end (its
ranks are processes of their own; the front end steps them as the engine's step). Prints tok/s
of generation (model load and a 2-request warm-up excluded), a hash of the greedy outputs (equal
hashes: identical outputs) and the process's CPU/wall (the front end's alone under DP).
Used for docs/results/speculation.md's async + DP rows."""
import hashlib
import shlex
import sys
import time

from dynaspec.bench.compare import RunRecord, make_params, run_closed_loop
from dynaspec.bench.workloads import load_workload
from dynaspec.config import EngineConfig
from dynaspec.engine.llm_engine import LLMEngine
from dynaspec.engine_flags import parse_engine_args


def main() -> None:
    flags, workload = sys.argv[1], sys.argv[2]
    conc, n, maxt = (int(a) for a in sys.argv[3:6])
    kw = parse_engine_args(shlex.split(flags))
    kw["enable_prefix_caching"] = False
    cfg = EngineConfig.from_kwargs(**kw)
    if cfg.parallel.data_parallel_size > 1:
        from dynaspec.dp.front_end import DPEngine

        e = DPEngine(cfg)
    else:
        e = LLMEngine(cfg)
    items = load_workload(workload, e.tokenizer, n, 1234)
    params = make_params(items, maxt, 0.0, 1234)
    run_closed_loop(e, items[:2], params[:2], 2, RunRecord("w", -1, 0, 0.0), "w")  # warm-up
    rec = RunRecord("a", -1, 0, 0.0)
    cpu0 = time.process_time()
    run_closed_loop(e, items, params, conc, rec, "a")
    cpu = (time.process_time() - cpu0) / rec.elapsed_s
    h = hashlib.sha256(repr(rec.outputs).encode()).hexdigest()[:12]
    print(f"RESULT tok/s {rec.tokens / rec.elapsed_s:.2f} tokens {rec.tokens} "
          f"s {rec.elapsed_s:.2f} hash {h} cpu/wall {cpu:.2f}", flush=True)
    if cfg.parallel.data_parallel_size > 1:
        e.shutdown()


if __name__ == "__main__":
    main()
