"""`dynaspec bench decode|compare|reliability`: benchmarks that print numbers."""

from __future__ import annotations

import argparse
import json

from dynaspec.engine_flags import add_engine_args, engine_kwargs


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks")
    bsub = p.add_subparsers(dest="bench_command", required=True)
    d = bsub.add_parser("decode", help="decode tokens/s beside the bandwidth limit")
    d.add_argument("--batch-sizes", default="1,8")
    d.add_argument("--prompt-len", type=int, default=64)
    d.add_argument("--context-lens", default=None,
                   help="comma-separated prompt lengths to sweep (overrides --prompt-len)")
    d.add_argument("--gen-tokens", type=int, default=64)
    d.add_argument(
        "--widths",
        default=None,
        help="comma-separated verify widths (e.g. 1,5,9): time synthetic steps of each width "
        "per batch size and context instead of decoding; the widths take turns step by step "
        "(1 5 9 1 5 9 ...) and each is reported as its ratio to width 1 (always timed) per "
        "round: median, IQR and 95%% CI over --rounds",
    )
    d.add_argument(
        "--rounds", type=int, default=30, help="rounds of the --widths sweep (default: 30; "
        "on an idle 2-vCPU VM the ratio of 5 rounds varied by up to 14%%, of 20 by <= 3%%)"
    )
    d.add_argument("--steps", type=int, default=5,
                   help="steps per width in each round of the --widths sweep; a round's "
                   "sample is their median (default: 5)")
    d.add_argument("--json", action="store_true")
    d.add_argument("--peer-hf", default=None, metavar="ARMS",
                   help="also run HF transformers generate on the same HF folder, same batches "
                   "and tokens, and print it beside ours: comma-separated arms of "
                   "static,static_compile (static cache; static cache + its torch.compile)")
    add_engine_args(d)
    d.set_defaults(func=run_decode_cmd)
    a = bsub.add_parser("admission", help="measure compiled vs eager per (batch bucket, width)",
                        description="Paired timing of the fixed-shape (compiled / CUDA graph) and "
                        "eager decode step for every shape of the execution grid; writes the "
                        "admission JSON that --execution auto reads.")
    a.add_argument("--ctx", type=int, default=256, help="context length of the synthetic requests")
    a.add_argument(
        "--pairs", type=int, default=5, help="alternating eager/compiled pairs per shape"
    )
    a.add_argument("--steps", type=int, default=5, help="steps per sample (median)")
    a.add_argument("--out", default=None,
                   help="output JSON (default: next to a --k-schedule file, else admission.json)")
    add_engine_args(a)
    a.set_defaults(func=run_admission_cmd)
    from dynaspec.bench import (
        async_cmd,
        census,
        compare_cmd,
        matrix_cmd,
        reliability,
        served,
        structured_cmd,
    )

    async_cmd.register(bsub)
    served.register(bsub)
    compare_cmd.register(bsub)
    reliability.register(bsub)
    structured_cmd.register(bsub)
    census.register(bsub)
    matrix_cmd.register(bsub)


def run_admission_cmd(args: argparse.Namespace) -> int:
    import sys

    from dynaspec.bench.admission import measure_admission
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine
    from dynaspec.spec_decode.plan.execution_plan import default_admission_path

    kw = {**engine_kwargs(args), "execution": "compiled", "admission": None}
    engine = LLMEngine(EngineConfig.from_kwargs(**kw))
    table = measure_admission(engine, args.ctx, args.pairs, args.steps,
                              lambda line: print(line, file=sys.stderr, flush=True))
    out = args.out or default_admission_path(args.k_schedule) or "admission.json"
    with open(out, "w", encoding="utf-8") as f:
        json.dump(table.to_json(), f, indent=1)
    print(f"admission table: {out}")
    return 0


def _parse_widths(text: str, rounds: int, steps: int) -> list[int]:
    """The widths to time, ascending, width 1 included (every ratio is to width 1)."""
    try:
        widths = {int(w) for w in text.split(",") if w.strip()}
    except ValueError:
        raise ValueError(f"--widths takes comma-separated integers, got {text!r}") from None
    if not widths or min(widths) < 1:
        raise ValueError(f"--widths takes widths >= 1, got {text!r}")
    if rounds < 1 or steps < 1:
        raise ValueError(f"--rounds and --steps must be >= 1, got {rounds} and {steps}")
    return sorted(widths | {1})


def _run_widths_cmd(args: argparse.Namespace, engine, contexts: list[int],
                    widths: list[int]) -> int:
    from dynaspec.bench.decode import measure_read_bandwidth, report_widths, run_widths
    from dynaspec.bench.machine import machine_record
    from dynaspec.models.quant_linear import cpu_info, linear_kernel_summary

    batches = [int(b) for b in args.batch_sizes.split(",")]
    results = run_widths(engine, batches, contexts, widths, rounds=args.rounds, steps=args.steps)
    bw = measure_read_bandwidth()
    m = engine.parts.model
    machine = machine_record(m.device)
    if args.json:
        print(
            json.dumps(
                {
                    "machine": machine,
                    "rounds": args.rounds,
                    "steps_per_round": args.steps,
                    "bandwidth_bytes_per_s": bw,
                    "weight_bytes_per_step": m.weight_bytes_per_step(),
                    "bandwidth_limited_step_ms": m.weight_bytes_per_step() / bw * 1e3,
                    "linear_kernel": linear_kernel_summary(m),
                    "attention": m.attn.name,
                    "cpu": cpu_info().summary(),
                    "results": results,
                }
            )
        )
    else:
        print(report_widths(engine, results, bw, machine))
    return 0


def run_decode_cmd(args: argparse.Namespace) -> int:
    from dynaspec.bench.decode import measure_read_bandwidth, report, run_decode
    from dynaspec.config import EngineConfig
    from dynaspec.engine.llm_engine import LLMEngine

    # Bad widths fail before the model loads.
    widths = _parse_widths(args.widths, args.rounds, args.steps) if args.widths else None
    engine = LLMEngine(EngineConfig.from_kwargs(**engine_kwargs(args)))
    from dynaspec.models.quant_linear import cpu_info

    contexts = (
        [int(c) for c in args.context_lens.split(",")] if args.context_lens else [args.prompt_len]
    )
    if widths:
        return _run_widths_cmd(args, engine, contexts, widths)
    run_decode(engine, 1, args.prompt_len, 8)  # warm-up
    results = [run_decode(engine, int(b), c, args.gen_tokens)
               for c in contexts for b in args.batch_sizes.split(",")]
    dev = engine.parts.model.device
    if dev.type == "cuda":  # HBM, not the host's memory, bounds a GPU step
        from dynaspec.bench.decode import measure_device_bandwidth

        bw = measure_device_bandwidth(dev)
    else:
        bw = measure_read_bandwidth()
    if args.json:
        from dynaspec.bench.machine import machine_record

        m = engine.parts.model
        print(
            json.dumps(
                {
                    "machine": machine_record(m.device),
                    "bandwidth_bytes_per_s": bw,
                    "weight_bytes_per_step": m.weight_bytes_per_step(),
                    "quantization": m.weights.mode,
                    "attention": m.attn.name,
                    "cpu": cpu_info().summary(),
                    "results": results,
                }
            )
        )
    else:
        print(report(engine, results, bw))
    if getattr(args, "peer_hf", None):
        from dynaspec.bench.hf_peer import run_peer, side_by_side

        arms = tuple(a for a in args.peer_hf.split(",") if a)
        peer = run_peer(args.model, str(engine.parts.model.device),
                        [int(b) for b in args.batch_sizes.split(",")], arms, contexts[0],
                        args.gen_tokens)
        print(json.dumps({"peer_hf": peer}) if args.json else side_by_side(results, peer))
    return 0
