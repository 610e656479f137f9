"""Summarize a served request timeline (server/request_timeline.py): where TTFT and steps go.

    python -m dynaspec.bench.served_timeline PATH [--json]

Per request, the intervals between its marks (median, p90, mean, in ms): tokenize (accept ->
tokenized), to_engine (-> added: the add command waits for the step in progress), engine_ttft
(-> first token: waiting to be scheduled plus its prefill steps), handoff (-> its delta on the
event loop), write (-> its first SSE chunk written), server_ttft (accept -> first write), decode
(first write -> done). Per step: how many, the engine thread's busy share of the span, the
gap between steps (the loop's own work: commands, outputs, the GIL), and steps with prefill
chunks against pure decode steps.
"""

from __future__ import annotations

import argparse
import json
import sys

from dynaspec.bench.stats import percentile

INTERVALS = (("tokenize", "accept", "tokenized"), ("to_engine", "tokenized", "added"),
             ("engine_ttft", "added", "first_token"), ("handoff", "first_token", "first_delta"),
             ("write", "first_delta", "first_write"), ("server_ttft", "accept", "first_write"),
             ("decode", "first_write", "done"))


def _ms(values: list[float]) -> dict:
    v = [x * 1000 for x in values]
    return {"median": _r(percentile(v, 50)), "p90": _r(percentile(v, 90)),
            "mean": _r(sum(v) / len(v)) if v else None, "n": len(v)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def summarize(lines: list[dict]) -> dict:
    reqs = [r for r in lines if r.get("kind") == "request"]
    steps = sorted((s for s in lines if s.get("kind") == "step"), key=lambda s: s["start"])
    out: dict = {"requests": len(reqs), "steps": len(steps)}
    out["intervals_ms"] = {name: _ms([r[b] - r[a] for r in reqs if a in r and b in r])
                           for name, a, b in INTERVALS}
    if len(steps) >= 2:
        span = steps[-1]["end"] - steps[0]["start"]
        busy = sum(s["end"] - s["start"] for s in steps)
        prefill = [s for s in steps if s.get("prompt_tokens")]
        decode = [s for s in steps if not s.get("prompt_tokens")]
        out["engine"] = {
            "span_s": round(span, 2), "busy_share": round(busy / span, 3) if span else None,
            "gap_between_steps_ms": _ms([b["start"] - a["end"] for a, b in zip(steps, steps[1:])]),
            "prefill_steps": len(prefill),
            "prefill_step_ms": _ms([s["end"] - s["start"] for s in prefill]),
            "prompt_tokens_per_prefill_step": _r(
                sum(s["prompt_tokens"] for s in prefill) / len(prefill)) if prefill else None,
            "decode_steps": len(decode),
            "decode_step_ms": _ms([s["end"] - s["start"] for s in decode]),
            "requests_per_step": _r(sum(s.get("requests", 0) for s in steps) / len(steps)),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    with open(args.path, encoding="utf-8") as f:
        lines = [json.loads(line) for line in f if line.strip()]
    s = summarize(lines)
    if args.json:
        print(json.dumps(s, indent=1))
        return 0
    print(f"{s['requests']} requests, {s['steps']} steps")
    for name, v in s["intervals_ms"].items():
        print(f"  {name:>12}: median {v['median']} ms, p90 {v['p90']} ms, mean {v['mean']} ms")
    for k, v in s.get("engine", {}).items():
        print(f"  engine {k}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
