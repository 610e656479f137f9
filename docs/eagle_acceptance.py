"""Acceptance of the shipped EAGLE head vs n-gram on held-out bench prompts (token counts, no
timings).

Workloads: code_edit and chat from dynaspec/bench/workloads.py (their modules and questions are
excluded from the head's training corpus, dynaspec/train/corpus.py). Greedy, K fixed per arm
(--k-policy table: the goodput policy would measure step costs, which need an idle machine).
Reports, per arm and workload: share of output tokens that came from accepted drafts, acceptance
rate, mean acceptance length, conditional acceptance per draft position, steps without drafts.
Run: python docs/eagle_acceptance.py [n_prompts] [max_tokens] [head_dir]
"""

from __future__ import annotations

import json
import sys

from dynaspec import LLM, SamplingParams
from dynaspec.bench.workloads import load_workload


def measure(arm: dict, workload: str, n: int, max_tokens: int) -> dict:
    llm = LLM(model="default", k_policy="table", **arm)
    items = load_workload(workload, llm.tokenizer, n, seed=0)
    params = [
        SamplingParams(temperature=0.0, max_tokens=min(max_tokens, it.max_tokens)) for it in items
    ]
    outs = llm.generate([it.prompt_ids for it in items], params)
    c = llm.engine.counters
    emitted = sum(len(o.token_ids) for o in outs)
    res = {
        "workload": workload,
        "arm": arm,
        "prompts": len(items),
        "output_tokens": emitted,
        "accepted": c.num_accepted_tokens,
        "draft_tokens": c.num_draft_tokens,
        "drafts": c.num_drafts,
        "share_from_drafts": round(c.num_accepted_tokens / max(1, emitted), 3),
        "acceptance_rate": round(c.num_accepted_tokens / max(1, c.num_draft_tokens), 3),
        "mean_acceptance_length": round(1 + c.num_accepted_tokens / max(1, c.num_drafts), 3),
        "per_position": [
            round(a / d, 3) if d else None for a, d in zip(c.accepted_per_pos, c.drafted_per_pos)
        ],
        "accepted_per_pos": list(c.accepted_per_pos),
        "drafted_per_pos": list(c.drafted_per_pos),
        "draft_skips": dict(c.draft_skips),
    }
    llm.shutdown()
    return res


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    eagle = {"speculator": "eagle", "num_spec_tokens": 3}
    if len(sys.argv) > 3:
        eagle["draft_head"] = sys.argv[3]
    arms = [eagle, {"speculator": "ngram", "num_spec_tokens": 3}]
    for workload in ("code_edit", "chat"):
        for arm in arms:
            print(json.dumps(measure(arm, workload, n, max_tokens)), flush=True)


if __name__ == "__main__":
    main()
