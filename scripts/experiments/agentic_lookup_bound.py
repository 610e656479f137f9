"""An upper bound for lookup drafters on the agentic workload (docs/history/benchmarks-waves-1-4.md,
wave 4 fourth session): plain greedy outputs first, then at every step the longest context suffix of
2-16 tokens found anywhere earlier (every earlier prompt and output, this request's prompt and
output so far), the most recent occurrence's next K tokens verified for free. Prints steps and
tokens per step per request; no step is priced (the bound is on steps, not seconds).

    python scripts/experiments/agentic_lookup_bound.py [K]
"""

from __future__ import annotations

import sys

from dynaspec.bench.compare import make_params
from dynaspec.bench.workloads import load_workload
from dynaspec.config import EngineConfig
from dynaspec.engine.llm_engine import LLMEngine

MIN_MATCH, MAX_MATCH = 2, 16


def greedy_outputs(engine: LLMEngine, items, params) -> list[list[int]]:
    outs = []
    for it, p in zip(items, params):
        engine.add_request(it.prompt_ids, p)
        toks: list[int] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks += o.new_token_ids
        outs.append(toks)
    return outs


def lookup(hay: list[int], ctx: list[int], k: int) -> list[int]:
    """The K tokens after the most recent occurrence of ctx's longest suffix found in hay."""
    for n in range(min(MAX_MATCH, len(ctx)), MIN_MATCH - 1, -1):
        pattern = ctx[-n:]
        for s in range(len(hay) - n - 1, -1, -1):
            if hay[s: s + n] == pattern:
                return hay[s + n: s + n + k]
    return []


def main() -> None:
    k = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    engine = LLMEngine(EngineConfig.from_kwargs(model="default", enable_prefix_caching=False))
    items = load_workload("agentic", engine.tokenizer, 8, 1234)
    params = make_params(items, None, 0.0, 1234)
    outs = greedy_outputs(engine, items, params)
    seen: list[int] = []  # every earlier prompt and output, separated
    total_steps = total_tokens = 0
    for it, out in zip(items, outs):
        steps = i = no_match = 0
        while i < len(out):
            ctx = it.prompt_ids + out[:i]
            draft = lookup(seen + [-1] + ctx, ctx, k)
            no_match += not draft
            a = 0
            while a < len(draft) and i + a < len(out) and draft[a] == out[i + a]:
                a += 1
            i, steps = i + a + 1, steps + 1
        print(f"{it.label[:45]:45s} tokens {len(out)} steps {steps} no-match {no_match} "
              f"tokens/step {len(out) / steps:.2f}")
        total_steps, total_tokens = total_steps + steps, total_tokens + len(out)
        seen += [-1] + it.prompt_ids + out
    print(f"total: {total_tokens} tokens in {total_steps} steps "
          f"({total_tokens / total_steps:.2f} a step)")


if __name__ == "__main__":
    main()
