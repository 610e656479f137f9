"""`dynaspec generate`: one prompt through the engine, text or one JSON object out."""

from __future__ import annotations

import argparse
import json
import sys
import time

from dynaspec.engine_flags import add_engine_args, engine_kwargs


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate text for one prompt")
    p.add_argument("--prompt", required=True, help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest (0 = off)")
    p.add_argument("--seed", type=int, default=None,
                   help="sampling seed (None: a fresh one per run)")
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dynaspec.llm import LLM
    from dynaspec.sampling_params import SamplingParams

    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens)
    llm = LLM(**engine_kwargs(args))
    prompt = args.prompt
    if args.chat:
        prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    t0 = time.perf_counter()
    out = llm.generate(prompt, params)[0]
    elapsed = time.perf_counter() - t0
    n = len(out.token_ids)
    failed = out.finish_reason == "error"
    if args.json:
        obj = {"text": out.text, "token_ids": out.token_ids,
               "num_prompt_tokens": len(out.prompt_token_ids), "num_output_tokens": n,
               "finish_reason": out.finish_reason, "elapsed_s": round(elapsed, 4),
               "tokens_per_s": round(n / elapsed, 2) if elapsed > 0 else None}
        if failed:
            obj["error"] = out.error or "engine error"
        if out.spec is not None:
            obj["spec"] = out.spec.to_json()
        print(json.dumps(obj))
    else:
        print(out.text)
        print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    if failed:  # what it produced is printed above; the run still failed
        print(f"dynaspec: error: generation failed after {n} tokens: "
              f"{out.error or 'engine error'}", file=sys.stderr)
        return 1
    return 0
