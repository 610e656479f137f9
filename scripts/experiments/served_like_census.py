"""A served-like offline run with a per-step census (docs/history/benchmarks-waves-1-4.md,
thirteenth session).

  python scripts/experiments/served_like_census.py THREADS CONCURRENCY REQUESTS

runs REQUESTS random 230-token prompts with 48 output tokens each, CONCURRENCY at once, on THREADS
torch threads (`serve` runs the engine on one), and prints output tok/s and how the time splits
between steps that prefill and decode-only steps, by prefill tokens and decode rows. A/B two
checkouts by running it with PYTHONPATH set to each in turn."""

import collections
import random
import sys
import time

from dynaspec import LLM, SamplingParams


def main() -> None:
    threads, conc, n = (int(a) for a in sys.argv[1:4])
    llm = LLM(model="default", speculator="none", num_threads=threads, max_num_seqs=conc,
              enable_prefix_caching=False)
    eng = llm.engine
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(230)] for _ in range(n)]
    sp = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:8], [sp] * 8)  # warm-up
    for p in prompts:
        eng.add_request(p, sp)
    rows = []  # (prefill tokens, decode rows, seconds) per step
    t00 = time.perf_counter()
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        plan = eng.schedule()
        if not plan.scheduled:
            continue
        prefill = [s for s in plan.scheduled
                   if s.request.num_computed_tokens < s.request.num_prompt_tokens]
        eng.emit(eng.land(eng.launch(plan)))
        rows.append((sum(s.num_new_tokens for s in prefill), len(plan.scheduled) - len(prefill),
                     time.perf_counter() - t0))
    wall = time.perf_counter() - t00
    print(f"{threads} thr c{conc}: {wall:.1f} s, {n * 48 / wall:.1f} out tok/s, steps {len(rows)}")
    tp = sum(t for p, _, t in rows if p > 0)
    td = sum(t for p, _, t in rows if p == 0)
    print(f"steps with prefill: {sum(1 for r in rows if r[0] > 0)} {tp:.1f} s, prefill tokens "
          f"{sum(r[0] for r in rows)}; decode-only: {sum(1 for r in rows if r[0] == 0)} {td:.1f} s")
    count, secs = collections.Counter(), collections.defaultdict(float)
    for p, d, t in rows:
        key = (min(p, 2048) // 256 * 256, d // 16 * 16)
        count[key] += 1
        secs[key] += t
    for k in sorted(count):
        print(f"prefill {k[0]:5d}+ decode rows {k[1]:3d}+: {count[k]:4d} steps, {secs[k]:.2f} s, "
              f"{secs[k] / count[k] * 1000:.0f} ms a step")


if __name__ == "__main__":
    main()
