"""The HF transformers peer arm of `bench decode`: `generate` on the same checkpoint folder,
greedy, a fixed number of new tokens, per batch size, with the static cache without compile
(`static`) and with generate's own torch.compile (`static_compile`).

Each arm: one untimed call (compile, cuBLAS/cache warm-up), then the best of `repeats` timed
calls; tokens/s = batch x new tokens / seconds, as ours counts decode steps (the prompt's
prefill is inside HF's time, a few % at 64 prompt tokens)."""

from __future__ import annotations

import time
from collections.abc import Callable

ARMS = ("static", "static_compile")


def load_hf(model_dir: str, device: str):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    # transformers types the decorated .to() with the model as its first argument.
    return m.to(device).eval()  # type: ignore[arg-type]


def run_arm(model, arm: str, batch: int, prompt_len: int, new_tokens: int, repeats: int = 2,
            seed: int = 0) -> dict:
    import torch

    if arm not in ARMS:
        raise ValueError(f"unknown HF arm {arm!r}: choose {', '.join(ARMS)}")
    g = torch.Generator().manual_seed(seed + batch)
    vocab = model.config.vocab_size
    ids = torch.randint(100, vocab - 100, (batch, prompt_len), generator=g).to(model.device)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
              attention_mask=torch.ones_like(ids), pad_token_id=0,
              cache_implementation="static")
    if arm == "static":
        kw["disable_compile"] = True

    def once() -> float:
        t0 = time.perf_counter()
        model.generate(ids, **kw)  # as generate runs for its users (no_grad inside)
        if model.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    first = once()
    best = min(once() for _ in range(repeats))
    return {"arm": arm, "batch": batch, "tokens_per_s": batch * new_tokens / best,
            "step_ms": 1e3 * best / new_tokens, "first_call_s": first}


def run_peer(model_dir: str, device: str, batches: list[int], arms: tuple[str, ...],
             prompt_len: int, new_tokens: int,
             on_result: Callable[[dict], None] | None = None) -> list[dict]:
    model = load_hf(model_dir, device)
    out = []
    for arm in arms:
        for b in batches:
            try:
                r = run_arm(model, arm, b, prompt_len, new_tokens)
            except Exception as exc:  # noqa: BLE001 - a failed arm is a reported result
                r = {"arm": arm, "batch": b, "error": f"{type(exc).__name__}: {exc}"[:300]}
            out.append(r)
            if on_result is not None:
                on_result(r)
    return out


def side_by_side(ours: list[dict], peer: list[dict]) -> str:
    """Markdown: ours (tok/s, ms a step) beside each HF arm per batch, and ours / best HF."""
    batches = sorted({r["batch"] for r in ours})
    arms = [a for a in ARMS if any(p.get("arm") == a for p in peer)]
    head = "| batch | dynaspec tok/s (ms) | " + " | ".join(f"HF {a} tok/s (ms)" for a in arms) \
        + " | ours / best HF |"
    lines = [head, "|" + "---|" * (3 + len(arms))]
    for b in batches:
        o = next(r for r in ours if r["batch"] == b)
        cells, best = [], 0.0
        for a in arms:
            p = next((x for x in peer if x.get("arm") == a and x["batch"] == b), None)
            if p is None or "error" in p:
                cells.append("-" if p is None else "error")
                continue
            cells.append(f"{p['tokens_per_s']:.1f} ({p['step_ms']:.2f})")
            best = max(best, p["tokens_per_s"])
        ratio = f"{o['tokens_per_s'] / best:.2f}x" if best else "-"
        lines.append(f"| {b} | {o['tokens_per_s']:.1f} ({o['step_ms']:.2f}) | "
                     + " | ".join(cells) + f" | {ratio} |")
    return "\n".join(lines)
