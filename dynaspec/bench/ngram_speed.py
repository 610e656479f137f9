"""Time NgramProposer.propose per engine step at batch 1/16/64 with 1k/2k/4k-token contexts.

    python -m dynaspec.bench.ngram_speed [--min-n 2] [--max-n 5] [--k 4] [--steps 200]

Steady state is what matters (the proposer runs every step): each timed step appends one token
per request, as a decode step would, then proposes, so the time includes the incremental cache
update. "cold" is the first call, which builds every request's buffer from its token lists.
Contexts: "text" is Zipf-distributed ids over a 32k vocab with copied spans (some matches,
some not); "repetitive" is a 4-token vocab, the worst case for the candidate filter.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dynaspec.request import Request
from dynaspec.sampling_params import SamplingParams
from dynaspec.spec_decode.drafters.ngram import NgramProposer

BATCHES = (1, 16, 64)
CONTEXTS = (1024, 2048, 4096)


def make_context(rng: np.random.Generator, length: int, kind: str) -> list[int]:
    if kind == "repetitive":
        return rng.integers(0, 4, length).tolist()
    tokens = (rng.zipf(1.3, length) % 32000).tolist()
    # Copy a few earlier spans forward, as quoted code or repeated phrases would.
    for _ in range(length // 200):
        src, dst, span = rng.integers(0, length - 64), rng.integers(0, length - 64), 32
        tokens[dst : dst + span] = tokens[src : src + span]
    return tokens


def time_case(
    batch: int, ctx: int, kind: str, args: argparse.Namespace
) -> tuple[float, float, float]:
    rng = np.random.default_rng(batch * 7919 + ctx)
    # The last `steps` tokens of each context arrive one per step, from the same distribution.
    streams = [make_context(rng, ctx, kind) for _ in range(batch)]
    prompts = [s[: ctx - args.steps] for s in streams]
    reqs = [Request(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)]
    proposer = NgramProposer(args.min_n, args.max_n)
    ks = [args.k] * batch
    t0 = time.perf_counter()
    proposer.propose(reqs, ks)
    cold = time.perf_counter() - t0
    times = []
    matched = 0
    for step in range(ctx - args.steps, ctx):
        for req, stream in zip(reqs, streams):
            req.output_token_ids.append(stream[step])
        t0 = time.perf_counter()
        drafts = proposer.propose(reqs, ks)
        times.append(time.perf_counter() - t0)
        matched += sum(1 for d in drafts.token_ids if d)
    return cold * 1e3, float(np.median(times)) * 1e3, matched / (args.steps * batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--min-n", type=int, default=2)
    parser.add_argument("--max-n", type=int, default=5)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    print(f"NgramProposer min_n={args.min_n} max_n={args.max_n} k={args.k}, ", end="")
    print(f"median of {args.steps} steps")
    header = ("context", "kind", "batch", "cold ms", "step ms", "us/req", "match")
    print("{:>10} {:>10} {:>5} {:>8} {:>8} {:>7} {:>6}".format(*header))
    for kind in ("text", "repetitive"):
        for ctx in CONTEXTS:
            for batch in BATCHES:
                cold, step, match_rate = time_case(batch, ctx, kind, args)
                print(
                    f"{ctx:>10} {kind:>10} {batch:>5} {cold:>8.3f} {step:>8.3f} "
                    f"{step * 1e3 / batch:>7.1f} {match_rate:>6.2f}"
                )


if __name__ == "__main__":
    main()
