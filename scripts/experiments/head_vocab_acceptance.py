"""Position-1 acceptance of the shipped EAGLE-3 head with its small draft vocabulary, on held-out
bench prompts, against (issue 62 item 3):
- the share of the target's answer tokens the vocabulary holds (`in_draft_vocab`): no head with
  these rows can gain more than the rest by growing its vocabulary to the target's;
- the same head over the full target vocabulary, its other rows the target's tied embedding
  rows it would have started training from (an untrained extension: a lower bound on what a
  trained full-vocabulary head would give);
- the head cut to the N most frequent of its tokens (N < 8,192), frequencies counted in the
  target's greedy answers to training prompts (dynaspec/train/prompt_mix.py, which excludes every
  bench question and module), never the held-out ones: what shrinking the vocabulary costs.

Teacher-forced (`evaluate` in dynaspec/train/device_train.py: one chain per answer row, a
target token outside the draft vocabulary a miss). Token counts only: no timings.

  python scripts/experiments/head_vocab_acceptance.py [--n 12] [--max-tokens 128] [--seed 1234]
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
    """The head over every target id: its trained rows where it has them, the target's tied
    embedding row (the rows' initial values in training) elsewhere."""
    c = head.cfg
    rows = target.embed_w.float().clone()  # [V, H]
    assert head.lm_head is not None  # an eagle3 head
    rows[head.draft_to_target] = head.lm_head.weight.detach()
    return _with_rows(head, rows, torch.arange(c.vocab_size))


def cut_vocab(head: EagleHead, counts: torch.Tensor, n: int) -> EagleHead:
    """The head over the n most frequent of its draft tokens (by `counts` [V])."""
    d2t = head.draft_to_target
    keep = torch.sort(torch.topk(counts[d2t], n).indices).values  # draft ids kept
    assert head.lm_head is not None
    return _with_rows(head, head.lm_head.weight.detach()[keep], d2t[keep])


def _with_rows(head: EagleHead, rows: torch.Tensor, d2t: torch.Tensor) -> EagleHead:
    out = EagleHead(replace(head.cfg, draft_vocab_size=len(d2t)))
    sd = {k: v for k, v in head.state_dict().items() if k not in ("lm_head.weight",
                                                                  "draft_to_target")}
    out.load_state_dict({**sd, "lm_head.weight": rows, "draft_to_target": d2t})
    return out.requires_grad_(False).eval()


def answer_counts(target: BatchedLlama, tok, eos: tuple[int, ...], n: int, max_new: int
                  ) -> torch.Tensor:
    """Token frequencies [V] in the target's greedy answers to n training prompts (seed 0)."""
    from dynaspec.train.prompt_mix import chat_ids, make_prompts

    ids, _ = chat_ids(tok, make_prompts(n, 0), 512)
    counts = torch.zeros(target.cfg.vocab_size, dtype=torch.long)
    for i in range(0, len(ids), 16):
        for ans in target.generate(ids[i: i + 16], max_new, eos):
            counts += torch.bincount(torch.tensor(list(ans) or [0]),
                                     minlength=target.cfg.vocab_size)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=12)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--workloads", default="chat,code_edit")
    ap.add_argument("--head", default=DEFAULT_HEAD)
    ap.add_argument("--train-prompts", type=int, default=48)
    a = ap.parse_args()
    path, _ = resolve_model_path("default")
    lm = load_gguf_file(path)
    target = BatchedLlama(lm.arch, lm.state_dict, "cpu", torch.float32)
    head, _ = load_head(a.head, lm.arch)
    eos = tuple(lm.eos_token_ids)
    counts = answer_counts(target, lm.tokenizer, eos, a.train_prompts, a.max_tokens)
    heads = {"8192 (shipped)": head, "full (untrained rest)": full_vocab(head, target)}
    heads.update({str(n): cut_vocab(head, counts, n) for n in (4096, 2048)})
    for wl in a.workloads.split(","):
        items = load_workload(wl, lm.tokenizer, a.n, seed=a.seed)
        prompts = [list(it.prompt_ids) for it in items]
        answers = target.generate(prompts, a.max_tokens, eos)
        seqs = [Seq(p + list(ans), len(p), wl) for p, ans in zip(prompts, answers)]
        for name, h in heads.items():
            got = evaluate(target, h, seqs, passes=1)["all"]
            print(json.dumps({"workload": wl, "vocab": name, "seed": a.seed, "prompts": len(seqs),
                              "answer_tokens": sum(len(s.ids) - s.prompt_len for s in seqs),
                              "position_1": got["rate"][0],
                              "in_draft_vocab": got["in_draft_vocab"]}), flush=True)


if __name__ == "__main__":
    main()
