"""The paired comparison's report (bench/compare.py runs the arms): each arm's speed, latency,
speculation and step census summed over its runs, the paired ratios against arm A, whether
outputs matched, and the Markdown tables `dynaspec bench compare` prints."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

from dynaspec.bench.compare import Arm, RunRecord
from dynaspec.bench.stats import latency_summary, paired_ratio


def _sum_maps(maps: list[dict]) -> dict:
    out: dict = {}
    for m in maps:
        for k, v in m.items():
            out[k] = out.get(k, 0) + v
    return dict(sorted(out.items()))


def _spec_total(recs: list[RunRecord]) -> dict | None:
    """Sum the runs' counters and re-derive the rates (per-run rates cannot be averaged)."""
    specs = [r.spec for r in recs if r.spec is not None]
    if not specs or not any(s["num_steps"] for s in specs):
        return None  # a peer arm: no counters
    keys = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_emitted_tokens",
            "num_spec_request_steps", "draft_seconds", "verify_seconds", "scheduler_seconds")
    tot = {k: sum(s[k] for s in specs) for k in keys}
    width = max(len(s["drafted_per_pos"]) for s in specs)
    for name in ("accepted_per_pos", "drafted_per_pos"):
        tot[name] = [sum(s[name][i] for s in specs if i < len(s[name])) for i in range(width)]
    dt, nd = tot["num_draft_tokens"], tot["num_drafts"]
    tot["acceptance_rate"] = tot["num_accepted_tokens"] / dt if dt else None
    tot["mean_acceptance_length"] = 1 + tot["num_accepted_tokens"] / nd if nd else None
    tot["acceptance_rate_per_pos"] = [
        a / d if d else None for a, d in zip(tot["accepted_per_pos"], tot["drafted_per_pos"])
    ]
    busy = tot["draft_seconds"] + tot["verify_seconds"]
    tot["draft_share"] = tot["draft_seconds"] / busy if busy else None
    for name in ("num_tree_drafts", "num_tree_nodes", "num_tree_accepted_tokens"):
        tot[name] = sum(s.get(name, 0) for s in specs)
    for name in ("draft_tokens_by_source", "accepted_tokens_by_source"):
        tot[name] = {}
        for s in specs:
            for src, n in (s.get(name) or {}).items():
                tot[name][src] = tot[name].get(src, 0) + n
    return tot


def summarize_arm(recs: list[RunRecord], describe: dict) -> dict:
    tps = [r.tokens_per_s for r in recs]
    census = {"steps": sum(r.census.get("steps", 0) for r in recs),
              "steps_by_k": _sum_maps([r.census.get("steps_by_k", {}) for r in recs]),
              "draft_skips": _sum_maps([r.census.get("draft_skips", {}) for r in recs]),
              "preemptions": sum(r.census.get("preemptions", 0) for r in recs),
              "execution": _sum_maps([r.census.get("execution", {}) for r in recs])}
    phases = _sum_maps([r.phase_s for r in recs]) if recs[0].phase_s else {}
    return {**describe, "tokens_per_s": tps,
            "tokens_per_s_mean": sum(tps) / len(tps),
            "tokens": [r.tokens for r in recs], "elapsed_s": [r.elapsed_s for r in recs],
            "ttft_s": latency_summary(x for r in recs for x in r.ttft_s),
            "inter_token_s": latency_summary(x for r in recs for x in r.inter_token_s),
            "tpot_s": latency_summary(x for r in recs for x in r.tpot_s),
            "census": census, "phase_s": phases, "spec": _spec_total(recs)}


def same_outputs(recs: list[RunRecord], base: list[RunRecord]) -> dict:
    """How many work items produced the same tokens as the base arm in the same pair."""
    same = total = 0
    for r, b in zip(recs, base):
        for x, y in zip(r.outputs, b.outputs):
            same, total = same + (x == y), total + 1
    return {"identical": same, "total": total}


def build_report(arms: Mapping[str, Arm], records: list[RunRecord], settings: dict,
                 bandwidth: float | None) -> dict:
    """The JSON object: a, b (and peers), ratio and ci95 of B/A, ratios of every arm vs A."""
    by_arm = {name: [r for r in records if r.arm == name] for name in arms}
    summary = {
        name: summarize_arm(recs, arms[name].describe()) for name, recs in by_arm.items() if recs
    }
    base = by_arm["a"]
    ratios = {}
    for name, recs in by_arm.items():
        if name != "a" and recs:
            est = paired_ratio([r.tokens_per_s for r in base], [r.tokens_per_s for r in recs])
            ratios[name] = {**est.to_dict(), "ci95": [est.lo, est.hi], "text": est.fmt(),
                            "outputs_vs_a": same_outputs(recs, base)}
    for name, oracle in settings.get("oracles", {}).items():  # arm -> its oracle arm
        if name in ratios and oracle in ratios:
            ratios[name]["oracle"] = oracle
            ratios[name]["gain_capture"] = gain_capture(ratios[name]["ratio"],
                                                        ratios[oracle]["ratio"])
    for s in summary.values():
        wb = s.get("weight_bytes_per_step")
        if bandwidth and wb:
            # A step that reads every weight once emits at most C tokens without speculation.
            s["bandwidth_limit_tokens_per_s"] = settings["concurrency"] * bandwidth / wb
            s["bandwidth_limit_step_s"] = wb / bandwidth
    head = ratios.get("b", {})
    return {
        "settings": settings,
        "bandwidth_bytes_per_s": bandwidth,
        **summary,
        "ratio": head.get("ratio"),
        "ci95": head.get("ci95"),
        "ratios": ratios,
        "runs": [
            {
                "arm": r.arm,
                "pair": r.pair,
                "tokens": r.tokens,
                "elapsed_s": r.elapsed_s,
                "tokens_per_s": r.tokens_per_s,
                "load_avg_1m": list(r.load_avg),
                "cpu_s": r.cpu_s,
            }
            for r in records
        ],
    }


def gain_capture(speedup: float | None, oracle: float | None) -> float | None:
    """(speedup - 1) / (oracle - 1), both against own plain (docs/design.md §8): the share of
    what the replay oracle gains that an arm captures. None where the oracle gains nothing (the
    share is then undefined) or a ratio is missing."""
    if speedup is None or oracle is None or oracle <= 1.0:
        return None
    return (speedup - 1.0) / (oracle - 1.0)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _num(x: float | None, fmt: str = ".3f") -> str:
    return "-" if x is None else format(x, fmt)


def _prefix_caching(setting) -> str:
    # True / False: reports written before the cold mode existed
    if setting in ("warm", True):
        return "on (warm pass first)"
    return "on (emptied before each pass)" if setting == "cold" else "off"


def markdown_report(report: dict, arm_names: Sequence[str]) -> str:
    """Markdown tables: per-arm speed and latency, speculation, census, and the paired ratios."""
    st = report["settings"]
    lines = [
        f"workload `{st['workload']}`{' (long)' if st.get('long') else ''}, {st['num_prompts']} "
        f"prompts, "
        f"max_tokens {st['max_tokens']}, concurrency {st['concurrency']}, {st['pairs']} pairs "
        f"({st['order']}), temperature {st['temperature']}, prefix caching "
        f"{_prefix_caching(st.get('prefix_caching'))}",
        "",
    ]
    bw = report.get("bandwidth_bytes_per_s")
    if bw:
        lines += [
            f"read bandwidth {bw / 1e9:.1f} GB/s; the bandwidth limit is the no-speculation decode "
            "ceiling at this concurrency: C tokens per step that reads every weight once",
            "",
        ]
    lines += [
        "| arm | config | tok/s (mean) | limit tok/s | TTFT p50/p99 ms | ITL p50/p99 ms | TPOT "
        "mean ms | KV pool tokens (target / drafter) | preemptions |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for n in arm_names:
        s = report.get(n)
        if s is None:
            continue
        pool = s.get("pool") or {}
        pool_txt = (
            f"{pool.get('num_tokens', '-')} / {pool.get('drafter_num_tokens', '-')}"
            if pool
            else "-"
        )
        lim = s.get("bandwidth_limit_tokens_per_s")
        lines.append(
            f"| {n} | `{s['label']}` | {s['tokens_per_s_mean']:.2f} | {_num(lim, '.1f')} | "
            f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} | "
            f"{_ms(s['inter_token_s']['p50'])} / {_ms(s['inter_token_s']['p99'])} | "
            f"{_ms(s['tpot_s']['mean'])} | {pool_txt} | {s['census']['preemptions']} |"
        )
    lines += [
        "",
        "| arm | acceptance rate | mean acceptance length | per-position rate | draft s / verify s "
        "(draft share) | steps by K | draft skips |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in arm_names:
        s = report.get(n)
        if s is None:
            continue
        sp, c = s.get("spec"), s["census"]
        if sp is None:
            lines.append(f"| {n} | - | - | - | - | - | - |")
            continue
        pos = ", ".join(_num(x, ".2f") for x in sp["acceptance_rate_per_pos"]) or "-"
        by_k = c["steps_by_k"] or f"{c['steps']} steps, spec off"
        lines.append(
            f"| {n} | {_num(sp['acceptance_rate'])} | {_num(sp['mean_acceptance_length'])} | "
            f"{pos} | {sp['draft_seconds']:.2f} / {sp['verify_seconds']:.2f} "
            f"({_num(sp['draft_share'], '.1%')}) | {by_k} | "
            f"{c['draft_skips'] or '-'} |"
        )
    for n in arm_names:  # drafters that label drafts by source (--speculator hybrid), trees
        sp = (report.get(n) or {}).get("spec") or {}
        acc, dra = sp.get("accepted_tokens_by_source") or {}, sp.get("draft_tokens_by_source")
        if dra and set(dra) != {"drafter"}:
            lines.append(f"\narm {n}: accepted / drafted tokens by source: " + ", ".join(
                f"{src} {acc.get(src, 0)} / {d}" for src, d in sorted(dra.items())))
        if sp.get("num_tree_drafts"):
            lines.append(f"\narm {n}: {sp['num_tree_drafts']} drafts verified as trees "
                         f"({sp['num_tree_nodes']} nodes, {sp['num_tree_accepted_tokens']} "
                         "accepted)")
    lines += [
        "",
        "| arm | steps by execution path/width | compile/capture s per shape |",
        "|---|---|---|",
    ]
    for n in arm_names:
        s = report.get(n)
        if s is not None and "census" in s:
            lines.append(
                f"| {n} | {s['census'].get('execution') or '-'} | {s.get('build_seconds') or '-'} |"
            )
    lines += [
        "",
        "| ratio (tok/s) | paired geometric mean | 95% CI | outputs identical to A | gain "
        "capture (vs its oracle) |",
        "|---|---|---|---|---|",
    ]
    for n, r in report["ratios"].items():
        o = r["outputs_vs_a"]
        ci = "-" if r["lo"] is None else f"[{r['lo']:.3f}, {r['hi']:.3f}]"
        gc = f"{_num(r.get('gain_capture'), '.1%')} ({r['oracle']})" if "oracle" in r else "-"
        lines.append(f"| {n}/a | {r['ratio']:.3f}x | {ci} | {o['identical']}/{o['total']} | "
                     f"{gc} |")
    lines += [
        "",
        f"runs (load = 1-minute load average before / after, on {os.cpu_count()} CPUs; "
        "CPU/wall = this process's CPU seconds per wall second; a run slowed by another "
        "process shows a high load and a low CPU/wall):",
        "",
        "| run | arm | pair | tokens | seconds | tok/s | load | CPU/wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(report["runs"]):
        la = r.get("load_avg_1m") or [0.0, 0.0]
        share = r.get("cpu_s", 0.0) / r["elapsed_s"] if r["elapsed_s"] else 0.0
        lines.append(f"| {i} | {r['arm']} | {r['pair']} | {r['tokens']} | {r['elapsed_s']:.2f} | "
                     f"{r['tokens_per_s']:.2f} | {la[0]:.1f} / {la[1]:.1f} | {share:.2f} |")
    return "\n".join(lines)
