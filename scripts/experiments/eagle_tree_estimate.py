"""Would tree drafting pay? The shipped head's top-b hit rate at draft position 1 on held-out
prompts (issue 27 item 5: tree drafting only if the chain's measurement says it pays).

A tree with b branches at the first draft position verifies b - 1 more rows per step; it gains
where the target's next token is the head's 2nd..b-th choice. This measures that share directly:
greedy outputs of the target on the bench's held-out code_edit and chat prompts, the target's
features over prompt + output (one forward), the head run teacher-forced over them (pass 1 of
its training-time unrolling, exactly a first draft given verified features), and the rank of the
target's actual next token among the head's draft logits. Token counts only, no timings.
Run: python scripts/experiments/eagle_tree_estimate.py [n_prompts] [max_tokens]
"""

from __future__ import annotations

import json
import sys

import torch

from dynaspec import LLM, SamplingParams
from dynaspec.bench.workloads import load_workload
from dynaspec.train.draft_head import target_pass

TOPS = (1, 2, 3, 4, 8)


def hit_rates(llm: LLM, workload: str, n: int, max_tokens: int) -> dict:
    items = load_workload(workload, llm.tokenizer, n, seed=0)
    params = [SamplingParams(temperature=0.0, max_tokens=min(max_tokens, it.max_tokens))
              for it in items]
    outs = llm.generate([it.prompt_ids for it in items], params)
    model, head = llm.engine.parts.model, llm.engine.runner.proposer.head
    hits, total = dict.fromkeys(TOPS, 0), 0
    for it, o in zip(items, outs):
        seq = list(it.prompt_ids) + list(o.token_ids)
        feats, _ = target_pass(model, [seq], torch.float32)[0]  # [n, F]
        emb = model.embed(torch.tensor(seq[1:])).float()  # row s: token s+1
        with torch.inference_mode():
            out = head.unrolled(feats[None, :-1], emb[None], 1)[0][0]  # [n-1, H]
            logits = head.logits(out)  # [n-1, draft_vocab]; row s predicts token s+2
        p0 = len(it.prompt_ids) - 2  # rows whose prediction is an output token
        truth = torch.tensor(seq[p0 + 2:])  # [m]
        top = head.draft_to_target[logits[p0: p0 + len(truth)].topk(max(TOPS), -1).indices]
        rank_hit = top == truth[:, None]  # [m, max(TOPS)]
        for b in TOPS:
            hits[b] += int(rank_hit[:, :b].any(-1).sum())
        total += len(truth)
    return {"workload": workload, "positions": total,
            "top_b_hit_rate": {b: round(hits[b] / total, 3) for b in TOPS}}


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    max_tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    # The eagle drafter attached so the target captures the head's layers; K=1 leaves outputs
    # as plain greedy (verification is lossless).
    llm = LLM(model="default", speculator="eagle", k_policy="table", num_spec_tokens=1)
    for wl in ("code_edit", "chat"):
        print(json.dumps(hit_rates(llm, wl, n, max_tokens)), flush=True)


if __name__ == "__main__":
    main()
