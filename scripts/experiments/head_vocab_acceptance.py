"""Position-1 acceptance of the shipped EAGLE-3 head with its small draft vocabulary against the
same head over the full target vocabulary, on held-out bench prompts (issue 62 item 3).

The shipped head predicts over 8,192 draft ids mapped to target ids (d2t, FR-Spec style). Its
full-vocabulary counterpart keeps those 8,192 trained rows and gives every other target token the
row it would have started training from (the target's tied embedding row, scaled to the trained
rows' mean norm). Both are evaluated teacher-forced (dynaspec/train/device_train.evaluate: one
chain per answer row, a target token outside the draft vocabulary a miss) on the target's greedy
answers to the held-out chat and code-edit prompts. `in_draft_vocab` is the share of answer
tokens the small vocabulary holds: no head with these rows can gain more than the rest by
growing its vocabulary. Token counts only: no timings, safe on a shared machine.

  python scripts/experiments/head_vocab_acceptance.py [--n 16] [--max-tokens 128] [--seed 1234]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import torch

from dynaspec.bench.workloads import load_workload
from dynaspec.models.gguf_loader import load_gguf_file
from dynaspec.models.loader import resolve_model_path
from dynaspec.spec_decode.drafters.eagle import DEFAULT_HEAD
from dynaspec.spec_decode.drafters.eagle_head import EagleHead
from dynaspec.spec_decode.drafters.eagle_io import load_head
from dynaspec.train.batched_llama import BatchedLlama
from dynaspec.train.device_train import Seq, evaluate


def full_vocab(head: EagleHead, target: BatchedLlama) -> EagleHead:
    """The head over every target id: its trained rows where it has them, else the target's
    embedding row scaled to the trained rows' mean norm (the rows' initial values in training)."""
    c = head.cfg
    full = EagleHead(replace(c, draft_vocab_size=c.vocab_size))
    sd = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight",
                                                                  "draft_to_target")}
    rows = target.embed_w.float().clone()  # [V, H]
    d2t = head.draft_to_target
    assert head.lm_head is not None  # an eagle3 head
    trained = head.lm_head.weight.detach()
    scale = (trained.norm(dim=1) / rows[d2t].norm(dim=1).clamp_min(1e-6)).mean()
    rows *= scale
    rows[d2t] = trained
    sd["lm_head.weight"] = rows
    sd["draft_to_target"] = torch.arange(c.vocab_size)
    full.load_state_dict(sd)
    return full.requires_grad_(False).eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--workloads", default="chat,code_edit")
    ap.add_argument("--head", default=DEFAULT_HEAD)
    a = ap.parse_args()
    path, _ = resolve_model_path("default")
    lm = load_gguf_file(path)
    target = BatchedLlama(lm.arch, lm.state_dict, "cpu", torch.float32)
    head, _ = load_head(a.head, lm.arch)
    heads = {"small (8,192)": head, "full": full_vocab(head, target)}
    for wl in a.workloads.split(","):
        items = load_workload(wl, lm.tokenizer, a.n, seed=a.seed)
        prompts = [list(it.prompt_ids) for it in items]
        answers = target.generate(prompts, a.max_tokens, tuple(lm.eos_token_ids))
        seqs = [Seq(p + list(ans), len(p), wl) for p, ans in zip(prompts, answers)]
        for name, h in heads.items():
            got = evaluate(target, h, seqs, passes=3)["all"]
            print(json.dumps({"workload": wl, "vocab": name, "seed": a.seed, "prompts": len(seqs),
                              "answer_tokens": sum(len(s.ids) - s.prompt_len for s in seqs),
                              "position_1": got["rate"][0], **got}), flush=True)


if __name__ == "__main__":
    main()
