"""Replay recorded greedy outputs through model-free drafters (n-gram, suffix), no model needed.

Greedy verification accepts a draft's longest prefix that equals the target's next tokens, so
given the target's greedy output for each request, a drafter's accepted tokens per step can be
computed exactly without running the model: record once (one engine run), replay any number of
drafter settings in seconds. Deterministic, so unlike timings it is unaffected by a busy
machine. It measures acceptance only: the step cost of verifying the drafts is not modelled.
Requests replay one after another, in workload order (as at concurrency 1), and each is
forgotten when done, so the suffix drafter's global cache fills as in a real run.

    python -m dynaspec.bench.replay --workload agentic --num-prompts 9 --max-tokens 128 \\
        --record out/agentic.json --drafter "--speculator ngram --num-spec-tokens 8" \\
        --drafter "--speculator suffix --num-spec-tokens 8"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys


def make_model_free_proposer(spec):
    """An n-gram or suffix proposer from a SpecConfig (drafters that need no model)."""
    if spec.speculator == "ngram":
        from dynaspec.spec_decode.drafters.ngram import NgramProposer
        return NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
    if spec.speculator == "suffix":
        from dynaspec.spec_decode.drafters.suffix import SuffixParams, SuffixProposer
        return SuffixProposer(SuffixParams(spec.suffix_max_depth, spec.suffix_spec_factor,
                                           spec.suffix_min_token_prob),
                              spec.suffix_cache_max_requests, spec.suffix_cache_max_tokens)
    raise ValueError(
        f"replay needs a model-free drafter (ngram or suffix), got {spec.speculator!r}"
    )


def replay(proposer, records: list[dict], k: int) -> dict:
    """Per-step acceptance of `proposer` at cap k over records [{prompt, output}, ...]."""
    from dynaspec.request import Request
    from dynaspec.sampling_params import SamplingParams
    steps = drafted = accepted = tokens = 0
    for i, rec in enumerate(records):
        req = Request(f"replay-{i}", list(rec["prompt"]), SamplingParams(max_tokens=1 << 30))
        truth = rec["output"]
        while len(req.output_token_ids) < len(truth):
            pos = len(req.output_token_ids)
            cap = min(k, len(truth) - pos - 1)  # the engine's max_tokens cap
            draft = proposer.propose([req], [cap]).token_ids[0] if cap > 0 else []
            a = 0
            while a < len(draft) and draft[a] == truth[pos + a]:
                a += 1
            req.output_token_ids.extend(truth[pos: pos + a + 1])
            steps, drafted, accepted = steps + 1, drafted + len(draft), accepted + a
        proposer.forget(req.request_id)
        tokens += len(truth)
    return {"steps": steps, "tokens": tokens, "tokens_per_step": tokens / steps if steps else 0.0,
            "drafted_per_step": drafted / steps if steps else 0.0,
            "acceptance_rate": accepted / drafted if drafted else None}


def record(
    workload: str, num_prompts: int, max_tokens: int, seed: int, engine_flags: list[str]
) -> list[dict]:
    """Greedy outputs of the workload, one request at a time (n-gram speculation: lossless,
    faster)."""
    from dynaspec.bench.workloads import load_workload
    from dynaspec.engine_flags import parse_engine_args
    from dynaspec.llm import LLM
    from dynaspec.sampling_params import SamplingParams
    kw = parse_engine_args(engine_flags)
    if kw["speculator"] == "none":
        kw.update(speculator="ngram", num_spec_tokens=8)
    llm = LLM(**kw)
    out = []
    for it in load_workload(workload, llm.engine.tokenizer, num_prompts, seed):
        o = llm.generate(
            [it.prompt_ids],
            SamplingParams(temperature=0.0, max_tokens=min(max_tokens, it.max_tokens)),
        )[0]
        out.append({"label": it.label, "prompt": it.prompt_ids, "output": o.token_ids})
    return out


def main(argv: list[str] | None = None) -> int:
    from dynaspec.config import EngineConfig
    from dynaspec.engine_flags import parse_engine_args
    p = argparse.ArgumentParser(prog="python -m dynaspec.bench.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--record", required=True, help="outputs JSON: read if it exists, else recorded")
    p.add_argument("--workload", default="agentic")
    p.add_argument("--num-prompts", type=int, default=9)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine", default="", help="engine flags for recording (model, dtype)")
    p.add_argument("--drafter", action="append", required=True, help="engine flags of a drafter")
    args = p.parse_args(argv)
    if os.path.exists(args.record):
        with open(args.record) as fh:
            records = json.load(fh)
    else:
        records = record(
            args.workload, args.num_prompts, args.max_tokens, args.seed, shlex.split(args.engine)
        )
        os.makedirs(os.path.dirname(os.path.abspath(args.record)), exist_ok=True)
        with open(args.record, "w") as fh:
            json.dump(records, fh)
    for flags in args.drafter:
        spec = EngineConfig.from_kwargs(**parse_engine_args(shlex.split(flags))).spec
        res = replay(make_model_free_proposer(spec), records, spec.num_spec_tokens)
        print(json.dumps({"drafter": flags, **res}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
