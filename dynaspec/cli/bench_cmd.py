"""`dynaspec bench decode|compare`: benchmarks that print numbers."""

from __future__ import annotations

import argparse
import json

from dynaspec.cli.engine_args import add_engine_args, engine_kwargs


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    d = bsub.add_parser("decode", help="decode tokens/s beside the bandwidth limit")
    d.add_argument("--batch-sizes", default="1,8")
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--context-lens", default=None,
                   help="comma-separated prompt lengths to sweep (overrides --prompt-len)")
    d.add_argument("--gen-tokens", type=int, default=64)
    d.add_argument("--json", action="store_true")
    add_engine_args(d)
    d.set_defaults(func=run_decode_cmd)
    try:
        from dynaspec.bench import compare_cmd
    except ImportError:  # not built in this checkout
        return
    compare_cmd.register(bsub)


def run_decode_cmd(args: argparse.Namespace) -> int:
    from dynaspec.bench.decode import measure_read_bandwidth, report, run_decode
    from dynaspec.engine.llm_engine import LLMEngine
    from dynaspec.config import EngineConfig

    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    from dynaspec.models.quant_linear import cpu_info

    run_decode(engine, 1, args.prompt_len, 8)  # warm-up
    contexts = [int(c) for c in args.context_lens.split(",")] if args.context_lens else [args.prompt_len]
    results = [run_decode(engine, int(b), c, args.gen_tokens)
               for c in contexts for b in args.batch_sizes.split(",")]
    bw = measure_read_bandwidth()
    if args.json:
        m = engine.parts.model
        print(json.dumps({"bandwidth_bytes_per_s": bw, "weight_bytes_per_step": m.weight_bytes_per_step(),
                          "quantization": m.weights.mode, "attention": m.attn.name,
                          "cpu": cpu_info().summary(), "results": results}))
    else:
        print(report(engine, results, bw))
    return 0
