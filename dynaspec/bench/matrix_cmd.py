"""`dynaspec bench matrix`: the never-below-plain support matrix (bench/matrix.py), written to
docs/results/support-matrix.md."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from dynaspec.bench.matrix import CONCURRENCIES, DRAFTER_FLAGS, MATRIX_WORKLOADS, MatrixSettings

_EPILOG = """\
Cells. Every concurrency x workload x drafter is one cell: the drafter's engine against the plain
engine (both with --engine's flags) in alternating passes over the same prompts and seeds, the
replay oracle with the drafter's flags and K as a third arm (--no-oracle drops it and the gain
capture). Pairs are added until the 95% CI is within --half-width of its point, from --min-pairs
up to --max-pairs. A cell passes at a point >= 0.98x with its lower bound >= 0.95x and greedy
outputs identical to plain. A workload not written yet, default flags that do not speculate or a
drafter that cannot be built here is an n/a cell with its reason.

Small runs: --concurrency 1 --workloads code_edit --drafters ngram --max-pairs 5.

Parts. A matrix too long for one quiet hold runs as parts, each with its own axes, prompts and
budgets and --json PART.json (written after every cell, so a part cut short keeps what it
measured); --merge A.json B.json ... then writes the page from the parts without running anything.
"""


def register(bsub) -> None:
    p = bsub.add_parser("matrix", help="concurrency x workload x drafter, each paired against "
                        "own plain; writes docs/results/support-matrix.md",
                        description=__doc__, epilog=_EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", default=",".join(map(str, CONCURRENCIES)),
                   help="comma-separated concurrencies")
    p.add_argument("--workloads", default=",".join(MATRIX_WORKLOADS),
                   help="comma-separated workloads (creative samples at temperature 1)")
    p.add_argument("--drafters", default=",".join(DRAFTER_FLAGS),
                   help="comma-separated drafters: " + "; ".join(
                       f"{k} = {v or '(no flags)'}" for k, v in DRAFTER_FLAGS.items()))
    p.add_argument("--drafter-flags", action="append", default=[], metavar="NAME=FLAGS",
                   help="a drafter's engine flags instead of the built-in ones, or a new drafter "
                   "(repeatable)")
    p.add_argument("--engine", default="", help="engine flags of every arm, in quotes "
                   "(--model, --dtype, ...)")
    p.add_argument("--num-prompts", type=int, default=8,
                   help="prompts per cell, at least the cell's concurrency")
    p.add_argument("--max-tokens", type=int, default=None, help="cap on each request's max_tokens")
    p.add_argument("--seed", type=int, default=0, help="workload choice and per-request seeds")
    p.add_argument("--min-pairs", type=int, default=5, help="pairs before the stopping rule")
    p.add_argument("--max-pairs", type=int, default=20, help="the most pairs of one cell")
    p.add_argument("--half-width", type=float, default=0.03,
                   help="stop a cell once its 95%% CI is within this share of its point")
    p.add_argument("--no-oracle", action="store_true", help="no oracle arm and no gain capture")
    p.add_argument("--out", default=os.path.join("docs", "results", "support-matrix.md"),
                   help="the Markdown file written")
    p.add_argument("--json", default=None, metavar="PATH", help="also write this part (settings, "
                   "provenance, cells) as JSON, after every cell")
    p.add_argument("--merge", nargs="+", default=None, metavar="PART.json",
                   help="run nothing: write the page from parts written with --json")
    p.set_defaults(func=run_matrix_cmd)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _names(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def settings_of(args: argparse.Namespace) -> MatrixSettings:
    flags = dict(DRAFTER_FLAGS)
    for entry in args.drafter_flags:
        name, sep, value = entry.partition("=")
        if not sep or not name.strip():
            raise ValueError(f"--drafter-flags takes NAME=FLAGS, got {entry!r}")
        flags[name.strip()] = value.strip()
    try:
        conc = tuple(int(c) for c in _names(args.concurrency))
    except ValueError:
        raise ValueError(f"--concurrency takes comma-separated integers, got "
                         f"{args.concurrency!r}") from None
    return MatrixSettings(conc, _names(args.workloads), _names(args.drafters), args.engine,
                          flags, args.num_prompts, args.max_tokens, args.seed, args.min_pairs,
                          args.max_pairs, args.half_width, not args.no_oracle)


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)


def run_matrix_cmd(args: argparse.Namespace) -> int:
    from dynaspec.bench.compare import IdentityViolation
    from dynaspec.bench.matrix_report import MatrixPart, markdown_parts, provenance
    from dynaspec.bench.matrix_run import MatrixRun

    if args.merge:
        parts = []
        for path in args.merge:
            with open(path, encoding="utf-8") as fh:
                parts.append(MatrixPart.from_json(json.load(fh)))
    else:
        settings = settings_of(args)
        prov = provenance("dynaspec " + shlex.join(sys.argv[1:]))
        done: list = []

        def keep(cell) -> None:
            done.append(cell)
            if args.json:
                _write(args.json, json.dumps(MatrixPart(settings, prov, tuple(done)).to_json(),
                                             indent=1))

        try:
            cells = MatrixRun(settings, say=_say, on_cell=keep).run()
        except IdentityViolation as exc:  # the plain arm's own books: no cell can be measured
            _say(f"dynaspec: METRIC IDENTITY FAILURE: {exc}")
            return 3
        parts = [MatrixPart(settings, prov, tuple(cells))]
        if args.json:
            _write(args.json, json.dumps(parts[0].to_json(), indent=1))
    md = markdown_parts(parts)
    _write(args.out, md)
    _say(f"wrote {args.out}")
    print(md)
    return 0
