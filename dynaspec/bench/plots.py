"""PNG plots for `bench compare` and `tune` (the only module that imports matplotlib).

matplotlib is imported inside the functions, with the Agg backend, so the engine and the tests
that do not plot never pay for it, and a machine without a display can still write files.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def _pyplot():
    from dynaspec.extras import require

    matplotlib = require("matplotlib", "bench", "plots")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def plot_compare(report: dict, arm_names: Sequence[str], out_dir: str) -> list[str]:
    """Writes throughput per pair, the per-pair ratios with the CI band, and latency CDFs."""
    plt = _pyplot()
    os.makedirs(out_dir, exist_ok=True)
    paths = [_throughput(plt, report, arm_names, out_dir), _ratios(plt, report, out_dir)]
    lat = _latency(plt, report, arm_names, out_dir)
    return [p for p in paths + [lat] if p]


def _throughput(plt, report: dict, arm_names: Sequence[str], out_dir: str) -> str:
    fig, ax = plt.subplots(figsize=(7, 4))
    for name in arm_names:
        if name in report:
            tps = report[name]["tokens_per_s"]
            ax.plot(range(len(tps)), tps, marker="o", label=f"{name}: {report[name]['label']}")
    ax.set_xlabel("pair")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("tokens/s")
    st = report["settings"]
    ax.set_title(f"{st['workload']}, concurrency {st['concurrency']}")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path = os.path.join(out_dir, "throughput_per_pair.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ratios(plt, report: dict, out_dir: str) -> str | None:
    if not report["ratios"]:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    runs = report["runs"]
    base = {r["pair"]: r["tokens_per_s"] for r in runs if r["arm"] == "a"}
    for name, est in report["ratios"].items():
        per = [(r["pair"], r["tokens_per_s"] / base[r["pair"]]) for r in runs
               if r["arm"] == name and base.get(r["pair"])]
        line = ax.plot(
            [p for p, _ in per], [v for _, v in per], marker="o", label=f"{name}/a per pair"
        )[0]
        ax.axhline(est["ratio"], color=line.get_color(), ls="--", label=f"{name}/a {est['text']}")
        if est["lo"] is not None:
            ax.axhspan(est["lo"], est["hi"], color=line.get_color(), alpha=0.12)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("pair")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("throughput ratio vs a")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    path = os.path.join(out_dir, "ratio.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _latency(plt, report: dict, arm_names: Sequence[str], out_dir: str) -> str | None:
    """TTFT and TPOT summaries side by side (bars: p50, whiskers up to p99)."""
    names = [n for n in arm_names if n in report]
    if not names:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
    for ax, key, title in (
        (axes[0], "ttft_s", "TTFT"),
        (axes[1], "tpot_s", "time per output token"),
    ):
        p50 = [(report[n][key]["p50"] or 0) * 1e3 for n in names]
        p99 = [(report[n][key]["p99"] or 0) * 1e3 for n in names]
        ax.bar(
            names,
            p50,
            yerr=[[0] * len(names), [max(0.0, b - a) for a, b in zip(p50, p99)]],
            capsize=4,
        )
        ax.set_title(f"{title} (p50, whisker to p99)")
        ax.set_ylabel("ms")
    path = os.path.join(out_dir, "latency.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_heatmap(choices: list[dict], path: str, title: str = "") -> str:
    """Tuned K per (batch bucket, context bucket), annotated with the goodput gain over K=0."""
    plt = _pyplot()
    batches = sorted({(c["batch"][0], c["batch"][1]) for c in choices}, key=lambda r: r[0])
    ctxs = sorted({(c["ctx"][0], c["ctx"][1]) for c in choices}, key=lambda r: r[0])
    grid = [[0] * len(ctxs) for _ in batches]
    notes = [[""] * len(ctxs) for _ in batches]
    for c in choices:
        i, j = batches.index(tuple(c["batch"])), ctxs.index(tuple(c["ctx"]))
        grid[i][j] = c["k"]
        notes[i][j] = f"K={c['k']}\n{c['gain']:.2f}x"
    fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(ctxs), 1.2 + 0.8 * len(batches)))
    im = ax.imshow(grid, cmap="viridis", aspect="auto", origin="lower")
    for i in range(len(batches)):
        for j in range(len(ctxs)):
            ax.text(j, i, notes[i][j], ha="center", va="center", color="white", fontsize=8)
    fmt = lambda r: f"{r[0]}-{'inf' if r[1] is None else r[1]}"  # noqa: E731
    ax.set_xticks(range(len(ctxs)), [fmt(r) for r in ctxs])
    ax.set_yticks(range(len(batches)), [fmt(r) for r in batches])
    ax.set_xlabel("context bucket (tokens)")
    ax.set_ylabel("batch bucket (requests)")
    ax.set_title(title or "tuned K (gain = goodput(K) / goodput(0))", fontsize=9)
    fig.colorbar(im, ax=ax, label="K")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
