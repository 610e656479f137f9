"""One drafted token of the shipped EAGLE-3 head against one target decode step at batch 1, on
the CPU kernels (issue 62 item 3: <= 10%), and what the goodput policy is handed as its price.

Per round, interleaved: a plain decode step of the default model (batch 1, width 1, `ctx` cached
tokens: cost_profile.synthetic_step, what the policy's cost table times) and one request's
drafting step of the head at the same context (EagleProposer.measure_draft_cost: one new pair
fed and a chain of k drafts on the compiled path, per drafted token). Medians over rounds. Run
it alone on an idle machine (cpu-excl):

  python scripts/experiments/head_cost.py [--rounds 15] [--contexts 128,512] [--ks 1,3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from dynaspec import LLM
from dynaspec.spec_decode.policy.cost_profile import synthetic_step


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--contexts", default="128,512")
    ap.add_argument("--ks", default="1,3")
    a = ap.parse_args()
    llm = LLM(model="default", speculator="eagle", num_spec_tokens=3)
    eng = llm.engine
    p, cc = eng.parts, eng.config.cache
    prop = p.runner.proposer
    prior = eng.scheduler.policy.settings.draft_cost_prior
    print(json.dumps({"policy_draft_cost_prior_ms": round(prior * 1e3, 4)}), flush=True)
    for ctx in map(int, a.contexts.split(",")):
        step = synthetic_step(p.model, p.runner.kv_caches, cc.block_size, p.kv.num_blocks, 1,
                              ctx, 1)
        for _ in range(3):
            step()  # warm-up
        for k in map(int, a.ks.split(",")):
            target, head = [], []
            for _ in range(a.rounds):
                t0 = time.perf_counter()
                step()
                target.append(time.perf_counter() - t0)
                head.append(prop.measure_draft_cost(ctx=ctx, k=k, reps=3))
            t, h = statistics.median(target), statistics.median(head)
            ratios = sorted(x / y for x, y in zip(head, target))
            print(json.dumps({"ctx": ctx, "k": k, "target_step_ms": round(t * 1e3, 3),
                              "head_ms_per_drafted_token": round(h * 1e3, 4),
                              "ratio": round(h / t, 4),
                              "ratio_iqr": [round(ratios[len(ratios) // 4], 4),
                                            round(ratios[3 * len(ratios) // 4], 4)],
                              "rounds": a.rounds}), flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
