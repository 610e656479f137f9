"""`dynaspec bench structured`: constrained JSON generation, speculation vs none, paired A/B.

Arm A runs the engine flags given (no speculation), arm B the same flags plus `--spec`. Every
request carries the same JSON schema (an extraction task whose answer copies text from the
prompt, where prompt lookup can draft). For each concurrency the arms alternate over
`--pairs` pairs (docs/design.md §8) and the report gives the paired tokens/s ratio with its 95% CI,
the step census, how many outputs parse, and the grammar cost: mask time per step (draft
checks, bitmasks, masking, grammar state), its share of the step, and drafts cut by the grammar.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import replace

from dynaspec.structured_params import StructuredOutputParams, schema_text

SCHEMA = {
    "type": "object",
    "properties": {
        "module": {"type": "string", "maxLength": 40},
        "summary": {"type": "string", "maxLength": 300},
        "topics": {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": 3},
        "has_examples": {"type": "boolean"},
    },
    "required": ["module", "summary", "topics", "has_examples"],
    "additionalProperties": False,
}
_TASK = ("Read the documentation below and answer with a JSON object: module (its name), summary "
         "(its first sentence, copied word for word), topics (up to three keywords) and "
         "has_examples.\n\nModule {name}:\n\n{doc}")


def register(bsub) -> None:
    p = bsub.add_parser("structured", help="constrained JSON: speculation vs none, paired A/B",
                        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="--model default",
                   help="engine flags both arms share, in quotes")
    p.add_argument("--spec", default="--speculator ngram --num-spec-tokens 4 --prompt-lookup-min 2",
                   help="speculation flags arm B adds, in quotes")
    p.add_argument("--concurrency", default="1,8", help="comma-separated concurrencies")
    p.add_argument("--pairs", type=int, default=5)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run_structured_cmd)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def load_items(tokenizer, n: int, max_tokens: int):
    """n extraction prompts over stdlib module docs (present on every Python install)."""
    from dynaspec.bench.workloads import WorkItem, _chat_ids, module_docs
    docs = module_docs()
    if not docs:
        raise ValueError("no stdlib module docs found for the structured benchmark prompts")
    items = []
    for i in range(n):
        rel, parts = docs[i % len(docs)]
        doc = parts[0][:1200]
        content = _TASK.format(name=rel.removesuffix(".py").replace("/", "."), doc=doc)
        items.append(WorkItem(_chat_ids(tokenizer, content), max_tokens, f"structured:{rel}"))
    return items


def grammar_summary(records, arm: str) -> dict:
    """Grammar cost of one arm over its measured runs."""
    recs = [r for r in records if r.arm == arm]
    mask_s = sum(r.phase_s.get("grammar", 0.0) for r in recs)
    mask_steps = sum(r.phase_s.get("grammar_steps", 0) for r in recs)
    busy = sum(sum(r.phase_s.get(k, 0.0) for k in ("schedule", "prepare", "draft", "forward",
                                                    "sample", "update")) for r in recs)
    cut = sum((r.spec or {}).get("invalid_draft_tokens", {}).get("grammar", 0) for r in recs)
    parsed = total = 0
    for r in recs:
        for text in getattr(r, "texts", []):
            total += 1
            try:
                json.loads(text, strict=False)
                parsed += 1
            except ValueError:
                pass
    return {"mask_ms_per_step": 1e3 * mask_s / mask_steps if mask_steps else None,
            "mask_share_of_step": mask_s / busy if busy else None, "masked_steps": mask_steps,
            "grammar_invalid_drafts": cut, "outputs_parsed": parsed, "outputs": total}


def run_structured_cmd(args: argparse.Namespace) -> int:
    from dynaspec.bench.compare import EngineArm, RunRecord, make_params, run_pairs
    from dynaspec.bench.compare_report import build_report, markdown_report
    from dynaspec.engine_flags import parse_engine_args

    base = parse_engine_args(shlex.split(args.engine))
    base["enable_prefix_caching"] = False  # repeated prompts would be cached from run 2 on
    spec = parse_engine_args(shlex.split(args.engine + " " + args.spec))
    spec["enable_prefix_caching"] = False
    _say("loading arms")
    arms = {"a": EngineArm(args.engine, base), "b": EngineArm(f"{args.engine} {args.spec}", spec)}
    tok = arms["a"].tokenizer
    items = load_items(tok, args.num_prompts, args.max_tokens)
    so = StructuredOutputParams(json=schema_text(SCHEMA))
    params = [replace(p, structured_output=so)
              for p in make_params(items, args.max_tokens, 0.0, args.seed)]
    for arm in arms.values():  # warm-up: kernels, and the grammar compiled once (cached)
        arm.run(items[:1], [replace(params[0], max_tokens=8)], 1, "warm")
    out: dict = {"schema": SCHEMA, "results": {}}
    for c in (int(x) for x in args.concurrency.split(",")):
        def said(r: RunRecord, c: int = c) -> None:
            _say(f"c={c} pair {r.pair} arm {r.arm}: {r.tokens_per_s:.2f} tok/s")

        records = run_pairs(arms, items, params, c, args.pairs, "alternate", said)
        for r in records:
            # This command's own field, read back by grammar_summary (getattr).
            r.texts = [tok.decode(o) for o in r.outputs]  # type: ignore[attr-defined]
        settings = {"workload": "structured_json", "num_prompts": len(items),
                    "max_tokens": args.max_tokens, "concurrency": c, "pairs": args.pairs,
                    "order": "alternate", "temperature": 0.0, "seed": args.seed,
                    "command": "dynaspec " + shlex.join(sys.argv[1:])}
        report = build_report(arms, records, settings, None)
        report["grammar"] = {name: grammar_summary(records, name) for name in arms}
        out["results"][str(c)] = report
        if not args.json:
            print(markdown_report(report, list(arms)) + "\n")
            print(_grammar_table(report["grammar"]) + "\n")
    if args.json:
        print(json.dumps(out))
    return 0


def _grammar_table(g: dict) -> str:
    def num(x, fmt):
        return "-" if x is None else format(x, fmt)

    lines = ["| arm | grammar mask ms/step | share of step time | drafts cut by grammar | "
             "outputs that parse |", "|---|---|---|---|---|"]
    for name, s in g.items():
        lines.append(f"| {name} | {num(s['mask_ms_per_step'], '.3f')} | "
                     f"{num(s['mask_share_of_step'], '.1%')} | {s['grammar_invalid_drafts']} | "
                     f"{s['outputs_parsed']}/{s['outputs']} |")
    return "\n".join(lines)
