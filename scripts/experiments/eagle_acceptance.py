"""Acceptance of the shipped EAGLE head vs n-gram on held-out bench prompts (token counts, no
timings).

Workloads: code_edit and chat from dynaspec/bench/workloads.py (their modules and questions are
excluded from the head's training corpus, dynaspec/train/corpus.py). Greedy, K fixed per arm
(--k-policy table: the goodput policy would measure step costs, which need an idle machine).
Reports, per arm and workload: share of output tokens that came from accepted drafts, acceptance
rate, mean acceptance length, conditional acceptance per draft position, steps without drafts.
Run: python scripts/experiments/eagle_acceptance.py \
    [n_prompts] [max_tokens] [head_dir] [--arms eagle,ngram,...]
"""

from __future__ import annotations

import json

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


ARMS = {
    "eagle": {"speculator": "eagle"},
    "ngram": {"speculator": "ngram"},
    "suffix": {"speculator": "suffix"},
    "eagle+ngram": {"speculator": "eagle", "eagle_lookup": "ngram"},
    "eagle+suffix": {"speculator": "eagle", "eagle_lookup": "suffix"},
}


def main() -> None:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int, nargs="?", default=8)
    ap.add_argument("max_tokens", type=int, nargs="?", default=256)
    ap.add_argument("head", nargs="?", default=None, help="head folder (default: the shipped one)")
    ap.add_argument("--arms", default="eagle,ngram", help=",".join(ARMS))
    ap.add_argument("--workloads", default="code_edit,chat")
    a = ap.parse_args()
    for workload in a.workloads.split(","):
        for name in a.arms.split(","):
            arm = dict(ARMS[name], num_spec_tokens=3)
            if a.head and arm["speculator"] == "eagle":
                arm["draft_head"] = a.head
            print(json.dumps(measure(arm, workload, a.n, a.max_tokens)), flush=True)


if __name__ == "__main__":
    main()
