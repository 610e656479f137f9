"""The device run's report.json as a figure and a summary (made on the CPU afterwards).

  python -m dynaspec.train.eagle_report OUT/report.json OUT/loss.png

Left: the training loss by step; middle: training top-1 per draft position; right: held-out
acceptance per position (the share of chains whose first j drafts were all right) by prompt
kind. Prints the stage timings and data counts.
"""

from __future__ import annotations

import json
import sys


def summary(rep: dict) -> str:
    st = rep.get("stages", {})
    lines = [f"device {rep.get('device')}, python {rep.get('python')}, torch {rep.get('torch')}"]
    prev = 0.0
    for name, s in st.items():
        lines.append(f"  {name:9s} done at {s['done_at_s']:6.1f} s (+{s['done_at_s'] - prev:.1f})")
        prev = s["done_at_s"]
    if "generate" in st:
        g = st["generate"]
        lines.append(f"answers {g['answers']} ({g['answer_tokens']} tokens, {g['files_hold']} in "
                     f"files, {g['ended_with_eos']} ended with EOS)")
    if "train" in st:
        t = st["train"]
        lines.append(f"trained {t['steps']} steps, {t['epochs']} epochs, {t['tokens']} tokens; "
                     f"held out {t['held_out']} sequences")
        for pr in t["history"].get("probes", []):
            lines.append(f"  probe at step {pr['step']} ({pr['tokens']} tokens seen): held-out "
                         f"rate {pr['rate']}")
    for kind, a in st.get("evaluate", {}).get("acceptance", {}).items():
        lines.append(f"  {kind:10s} chains {a['chains']:7d} rate {a['rate']} cond {a['cond']} "
                     f"mean accepted {a['mean_accepted']}")
    lines += [f"note: {n}" for n in rep.get("notes", [])]
    if "error" in rep:
        lines.append(f"error: {rep['error']}")
    return "\n".join(lines)


def plot(rep: dict, path: str) -> str:
    from dynaspec.extras import require

    matplotlib = require("matplotlib", "train", "the draft-head training plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    st = rep["stages"]
    h = st["train"]["history"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4))
    a.plot(h["step"], h["loss"], lw=0.9)
    a.set(xlabel="step", ylabel="loss (passes weighted 0.8^k)", title="EAGLE-3 head, training")
    for k in range(len(h["acc"][0]) if h["acc"] else 0):
        b.plot(h["step"], [x[k] for x in h["acc"]], lw=0.9, label=f"position {k + 1}")
    b.set(xlabel="step", ylabel="top-1 = target's greedy", title="training batch top-1")
    b.legend()
    acc = st.get("evaluate", {}).get("acceptance", {})
    for kind, r in acc.items():
        c.plot(range(1, len(r["rate"]) + 1), r["rate"], marker="o", label=kind,
               lw=2 if kind == "all" else 0.9)
    c.set(xlabel="draft position j", ylabel="chains with drafts 1..j right",
          title="held-out acceptance", ylim=(0, 1))
    c.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    with open(argv[0], encoding="utf-8") as f:
        rep = json.load(f)
    print(summary(rep))
    if len(argv) > 1 and "train" in rep.get("stages", {}):
        print(f"plot: {plot(rep, argv[1])}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
