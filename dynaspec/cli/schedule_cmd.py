"""``dynaspec schedule explain``: show the SpecPlan a set of flags resolves to, before running it.

Prints the classification, the effective table after clamping, the verify widths and what was
clamped and why; ``--json`` prints ``SpecPlan.to_json()``. An invalid schedule exits 2 with the
message (naming the entry) on stderr, like argparse's own usage errors.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TextIO

from dynaspec.registry import K_POLICIES
from dynaspec.spec_decode.plan.plan import ScheduleError, SpecPlan, build_spec_plan, plan_for_policy
from dynaspec.spec_decode.policy.cost_model import cache_dir
from dynaspec.spec_decode.policy.policies import resolve_policy_name

EXIT_INVALID = 2


def register(subparsers) -> None:
    """Add ``schedule explain`` to the main CLI's subparsers; sets ``args.func``."""
    parser = subparsers.add_parser("schedule", help="inspect speculation schedules")
    sub = parser.add_subparsers(dest="schedule_command", metavar="{explain}")
    sub.required = True
    explain = sub.add_parser(
        "explain",
        help="print the speculation plan a schedule resolves to",
        description="Validate a K schedule, clamp it, classify it and print the resulting plan.",
    )
    explain.add_argument(
        "--num-spec-tokens",
        type=int,
        default=0,
        help="runtime maximum K; every entry is clamped to it (0 = the schedule's own maximum)",
    )
    explain.add_argument(
        "--k-schedule",
        default=None,
        help="JSON (constant, batch rows, grid rows, tuned table) or a path to a JSON file",
    )
    explain.add_argument(
        "--speculator", default="ngram", choices=("none", "ngram", "draft", "suffix")
    )
    explain.add_argument(
        "--drafter-max-k",
        type=int,
        default=None,
        help="the drafter's own K limit (e.g. a draft model's), if below --num-spec-tokens",
    )
    explain.add_argument("--k-policy", default="auto", choices=K_POLICIES.names,
                         help="the K policy to describe (auto = table when --k-schedule is given, "
                         "else goodput)")
    explain.add_argument("--draft-model", default=None,
                         help="a draft model: its position limit clamps K (as the engine does)")
    explain.add_argument(
        "--max-num-seqs", type=int, default=64, help="batch buckets are capped by it"
    )
    explain.add_argument("--execution", default="auto", choices=("eager", "compiled", "auto"))
    explain.add_argument("--admission", default=None,
                         help="admission JSON (default: next to a --k-schedule file)")
    explain.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                         help="fixed-shape path: torch.compile (cpu) or CUDA graphs (cuda)")
    explain.add_argument("--data-parallel-size", type=int, default=1,
                         help="engine ranks: describe how the plan applies across them")
    explain.add_argument("--draft-tree", action="store_true",
                         help="ngram/suffix draft token trees: how K becomes a node budget")
    explain.add_argument("--no-grammar-drafts", dest="grammar_drafts", action="store_false",
                         help="structured output: no forced drafts from the grammar")
    explain.add_argument("--json", action="store_true", help="print the plan as a JSON object")
    explain.set_defaults(func=run_explain)


def run_explain(args: argparse.Namespace) -> int:
    return explain(args, sys.stdout, sys.stderr)


def explain(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        limit = _drafter_limit(args)
        plan = build_spec_plan(args.speculator, args.num_spec_tokens, args.k_schedule, limit)
        policy = resolve_policy_name(getattr(args, "k_policy", "auto"), plan.speculating,
                                     args.k_schedule is not None)
        # Classified by the widths that can run under the policy, as the engine runs it.
        plan = plan_for_policy(plan, policy)
        ep = _execution_plan(args, plan)
    except ValueError as exc:  # ScheduleError included: a bad flag is as invalid as a bad entry
        kind = "invalid schedule" if isinstance(exc, ScheduleError) else "invalid arguments"
        print(f"dynaspec schedule explain: {kind}: {exc}", file=err)
        return EXIT_INVALID
    dp = getattr(args, "data_parallel_size", 1)
    if dp < 1:
        print(f"dynaspec schedule explain: invalid arguments: --data-parallel-size must be >= 1, "
              f"got {dp}", file=err)
        return EXIT_INVALID
    if args.json:
        print(
            json.dumps(
                {
                    **plan.to_json(),
                    "policy": policy,
                    "cost_cache": _cost_cache(policy),
                    "execution": execution_rows_json(plan, ep),
                    "data_parallel": {"size": dp, "text": format_dp(plan, policy, dp)},
                    "draft_tree": format_tree(args, plan).strip() or None,
                    "grammar_drafts": format_grammar(args, plan, policy).strip() or None,
                }
            ),
            file=out,
        )
    else:
        out.write(format_plan(plan))
        if ep is not None:
            out.write(format_execution(plan, ep))
        out.write(format_policy(policy) + format_dp(plan, policy, dp) + "\n")
        out.write(format_tree(args, plan))
        out.write(format_grammar(args, plan, policy))
    return 0


def format_grammar(args: argparse.Namespace, plan: SpecPlan, policy: str | None) -> str:
    """What grammar drafts do for structured-output requests (docs/design.md §4d)."""
    if not plan.speculating:
        return ""
    if not getattr(args, "grammar_drafts", True):
        return "grammar drafts: off (structured output drafts from the drafter alone)\n"
    text = ("grammar drafts: on. For a request with structured output (response_format, regex, "
            "grammar, a required or named tool call) the tokens its grammar forces from its "
            "state (the jump-forward text spelled by the longest tokens, or the one token "
            "allowed) are its first drafts, with no drafter call; the drafter continues after "
            "them in the same chain, or drafts alone where the grammar forces nothing. The "
            "verify logits stay masked by the grammar, so a forced draft the model would spell "
            "otherwise costs one row, never a wrong token.")
    if policy == "goodput":
        text += (" The goodput policy prices forced drafts apart: their own acceptance (prior "
                 "0.95, learned per request) and no drafting cost give them a cap of their own, "
                 "so K widens through forced spans while the drafter keeps its own cap.")
    return text + (" Counted in /metrics as spec_decode_num_draft_tokens_by_source"
                   "{source=\"grammar\"} and _num_accepted_tokens_by_source.\n")


def format_tree(args: argparse.Namespace, plan: SpecPlan) -> str:
    """What --draft-tree changes (docs/design.md §4c); '' without it."""
    if not getattr(args, "draft_tree", False):
        return ""
    if args.speculator not in ("ngram", "suffix"):
        return "draft trees: refused (--draft-tree needs --speculator ngram or suffix)\n"
    text = ("draft trees: on. A request's K is a node budget: its drafter proposes a tree of at "
            f"most K nodes (K <= {plan.max_k}), verified at width nodes + 1, each node at "
            "context + depth seeing only its ancestors; one branch of continuations is a chain "
            "and runs exactly as one. A tree runs as its first path on a fixed-shape (compiled) "
            "step and for requests with a grammar, logits processing or logprobs.")
    policy = resolve_policy_name(getattr(args, "k_policy", "auto"), plan.speculating,
                                 args.k_schedule is not None)
    if policy == "goodput":
        text += (" The goodput policy picks chain, tree or none per request per step: it prices "
                 "a chain of K drafts and a tree of K nodes, each at its width 1 + drafts from the "
                 "step cost table, the tree's expected accepted length from per-depth, "
                 "per-branch acceptance (the first child at depth d at the request's chain rate "
                 "for position d, the b-th child at the engine-wide rate that it is the accepted "
                 "one once the earlier ones were rejected, learned from every tree verified), and "
                 "drafts the shape that pays more, or nothing where neither beats plain decode.")
    else:
        text += (f" The {policy} policy does not price shapes: every request with a budget of "
                 "2 or more nodes drafts a tree where its drafter finds branches.")
    return (text + " Tree steps are counted in /metrics (spec_decode_tree_steps, "
            "_num_tree_drafts, _num_tree_nodes, _num_tree_accepted_tokens, "
            "_tree_acceptance_length). Composes with --async-scheduling and data parallelism.\n")


def format_dp(plan: SpecPlan, policy: str | None, dp: int) -> str:
    """How the plan applies under data parallelism (docs/design.md §7); vLLM drops the schedule
    there."""
    if dp == 1:
        return "data parallel: off (one rank)"
    if not plan.speculating:
        return (
            f"data parallel: {dp} ranks, no speculation: ranks step in lockstep, K is not decided"
        )
    head = (f"data parallel: {dp} ranks keep this plan (no fallback to the raw maximum): each step "
            "the ranks all-reduce their step view (requests, decoding requests, sum and max of "
            "contexts) and apply one K decision to the global view, so every rank runs the same K")
    if plan.kind == "constant" and policy != "goodput":
        return head + f"; constant({plan.max_k}) runs K={plan.max_k} on every rank"
    tail = ("; the batch key is the requests in the step on all ranks together, ctx the mean over "
            "every rank's decoding requests; per-request caps (max_tokens, max_model_len, drafter "
            "length) stay local")
    if policy == "goodput":
        tail += ("; goodput decides the step K from state every rank shares (rank 0's cost table, "
                 "refreshed by every rank's gathered step times, and the engine-wide acceptance "
                 "gathered from all ranks); each request's own history only lowers its own K")
    return head + tail


def _drafter_limit(args: argparse.Namespace) -> int | None:
    limits = [x for x in (getattr(args, "drafter_max_k", None),) if x is not None]
    if getattr(args, "draft_model", None):
        from dynaspec.spec_decode.drafters.draft_model import draft_k_limit
        limits.append(draft_k_limit(args.draft_model))
    return min(limits) if limits else None


def _execution_plan(args: argparse.Namespace, plan: SpecPlan):
    from dynaspec.spec_decode.plan.execution_plan import (
        AdmissionTable,
        ExecutionPlan,
        default_admission_path,
    )
    if not hasattr(args, "execution"):
        return None  # called by code that predates the execution plan
    path = args.admission or default_admission_path(args.k_schedule)
    admission = None
    if args.execution == "auto" and path is not None and (args.admission or os.path.isfile(path)):
        admission = AdmissionTable.load(path)
    return ExecutionPlan.build(plan, args.max_num_seqs, args.execution, args.device, admission)


def execution_rows(plan: SpecPlan, ep) -> list[dict]:
    """Per batch bucket and width: the requests it covers, K, width, path and why."""
    from dynaspec.spec_decode.plan.execution_plan import bucket_ks
    rows = []
    for b, covers, k_table in bucket_ks(plan, ep.buckets):
        # Width 1 in a plan with K>0 buckets is the policy's K=0 (goodput): a row of its own.
        for k in sorted({k_table} | ({0} if 1 in plan.widths else set())):
            path, why = ep.path_for(b, 1 + k)
            rows.append({"requests": covers, "bucket": b, "k": k, "width": 1 + k, "path": path,
                         "why": why})
    return rows


def execution_rows_json(plan: SpecPlan, ep) -> dict | None:
    if ep is None:
        return None
    return {**ep.to_json(), "rows": [{**r, "requests": list(r["requests"])}
                                     for r in execution_rows(plan, ep)]}


def format_execution(plan: SpecPlan, ep) -> str:
    src = ep.admission.source if ep.admission else "none"
    lines = [f"execution plan (--execution {ep.mode}; fixed-shape path {ep.graph_path}; "
             f"admission {src}):",
             f"  {'requests':>9}  {'bucket':>6}  {'K':>3}  {'width':>5}  {'path':<10}  why"]
    for r in execution_rows(plan, ep):
        lo, hi = r["requests"]
        lines.append(f"  {_bound(lo, hi):>9}  {r['bucket']:>6}  {r['k']:>3}  {r['width']:>5}  "
                     f"{r['path']:<10}  {r['why']}")
    lines.append(
        f"  mixed prefill+decode steps and batches above {max(ep.buckets)} requests: eager"
    )
    return "\n".join(lines) + "\n"


_POLICY_TEXT = {
    None: "none (no drafter runs)",
    "table": "table: every step runs the effective table's K (auto's choice under an explicit "
             "--k-schedule: the schedule is an instruction)",
    "adaptive": "adaptive: the table's K, lowered per request from its acceptance history",
    "goodput": "goodput: each step picks the K in 0..table K (the ceiling) that maximises "
               "expected tokens per second, from a step-cost table measured on this machine and "
               "refreshed while serving, and each request's observed acceptance; K=0 where "
               "speculation does not pay; requests that stop paying are re-probed every 16 tokens, "
               "and a K>0 step is re-probed when modelled and observed goodput stay apart",
}


def _cost_cache(policy: str | None) -> dict | None:
    if policy != "goodput":
        return None
    where = cache_dir() / "cost"
    files = sorted(where.glob("*.json"), key=lambda p: p.stat().st_mtime, reverse=True)
    return {"dir": str(where), "files": [str(p) for p in files],
            "curves": {str(p): _curves(p.stem) for p in files[:3]}}


def _curves(key: str) -> dict[str, dict[int, float]]:
    """Step ms by verify width at batch 1, per cached context: the curve the policy prices."""
    from dynaspec.spec_decode.policy.cost_cache import load_cells

    out: dict[str, dict[int, float]] = {}
    for (b, c, w), cell in sorted(load_cells(key).items()):
        if b == 1:
            out.setdefault(f"batch 1 ctx {c}", {})[w] = round(cell.seconds * 1e3, 3)
    return out


def format_policy(policy: str | None) -> str:
    lines = [f"policy: {_POLICY_TEXT[policy]}"]
    cache = _cost_cache(policy)
    if cache is not None:
        n, where = len(cache["files"]), cache["dir"]
        lines.append(f"  cost tables cached in {where}: {n} (checked by a short re-probe at "
                     "start-up; a stale or inconsistent one is re-measured)" if n else
                     f"  no cost table cached yet in {where}: the engine profiles a few seconds "
                     "at start-up")
        for path, curves in cache["curves"].items():
            for shape, by_width in curves.items():
                base = by_width.get(1)
                cells = ", ".join(f"w{w} {ms:.2f} ms" + (f" ({ms / base:.2f}x)" if base else "")
                                  for w, ms in sorted(by_width.items()))
                lines.append(f"    {path.rsplit('/', 1)[-1][:12]} {shape}: {cells}")
    return "\n".join(lines) + "\n"


def _bound(lo: int, hi: int | None) -> str:
    return f"{lo}+" if hi is None else (str(lo) if lo == hi else f"{lo}-{hi}")


_KIND_TEXT = {
    "off": "no speculator: the drafter is not loaded",
    "always_zero": "every entry is K=0: the drafter is not loaded, no drafter KV, no-speculation "
    "path",
    "constant": "one K everywhere: uniform verify width, full-width graphs/compiled decode allowed",
    "variable": "the verify width varies (by bucket, or by the policy's per-step K): "
    "width-specific optimisations are decided per width",
}


def format_plan(plan: SpecPlan) -> str:
    head = f"constant({plan.max_k})" if plan.kind == "constant" else plan.kind
    lines = [
        f"plan: {head}",
        f"  {_KIND_TEXT[plan.kind]}",
        f"max_k: {plan.max_k} (KV lookahead and per-position metrics size)",
        f"verify widths (1+k): {', '.join(map(str, plan.widths))}",
        "effective table (batch = requests in the step; ctx = mean context of decoding requests, "
        "rounded up; '+' = open-ended):",
        f"  {'batch':>12}  {'ctx':>14}  {'K':>3}  {'width':>5}",
    ]
    for b_lo, b_hi, c_lo, c_hi, k in plan.table:
        lines.append(f"  {_bound(b_lo, b_hi):>12}  {_bound(c_lo, c_hi):>14}  {k:>3}  {1 + k:>5}")
    lines.append("clamped:" if plan.clamped else "clamped: nothing")
    lines.extend(f"  {note}" for note in plan.clamped)
    if plan.notes:
        lines.append("notes:")
        lines.extend(f"  {note}" for note in plan.notes)
    return "\n".join(lines) + "\n"
