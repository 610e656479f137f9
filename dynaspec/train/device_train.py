"""Training the EAGLE-3 head on an accelerator from the target's own answers, time-boxed.

Each step recomputes the target's features for its batch (teacher forcing over prompt + answer
with BatchedLlama: 10^5 answers' features would be ~70 GB kept, and the target pass costs about
what the head's step does), then runs the head's `passes` chained passes (EAGLE-3's training-time
test, EagleHead.unrolled) under bf16 autocast. The loss is on answer rows only (what the head
drafts at run time) against the target's greedy choices in the draft vocabulary, pass k weighted
0.8^(k-1). A seeded part of the sequences is held out; `evaluate` measures per-position
acceptance there as chained drafting would see it: position j of a chain started after row p is
accepted when passes 1..j are all right at rows p..p+j-1.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dynaspec.spec_decode.drafters.eagle_head import EagleHead

IGNORE = -100


@dataclass(frozen=True)
class Seq:
    ids: list[int]  # prompt + answer token ids
    prompt_len: int
    kind: str


@dataclass(frozen=True)
class DeviceTrainConfig:
    seconds: float = 170.0  # wall-clock budget of the training loop
    tokens_per_step: int = 65536  # padded tokens per batch
    passes: int = 4
    lr: float = 6e-4
    warmup: int = 40
    seed: int = 0
    log_every: int = 25
    max_steps: int = 0  # 0: as many as the time allows


def draft_vocab(seqs: list[Seq], size: int, vocab: int, always: tuple[int, ...]
                ) -> torch.Tensor:
    """The `size` most frequent answer tokens (plus `always`, e.g. EOS), sorted: [size]."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s.ids[s.prompt_len:] or [0]), minlength=vocab)
    counts[list(always)] = counts.max() + 1
    return torch.sort(torch.topk(counts, min(size, vocab)).indices).values


def batches(seqs: list[Seq], tokens: int, seed: int, epoch: int) -> list[list[int]]:
    """Index batches of about `tokens` padded tokens: a seeded shuffle, sorted by length inside
    runs of 1,024 so padding stays small, the batches shuffled again."""
    rng = random.Random(seed * 1000 + epoch)
    order = list(range(len(seqs)))
    rng.shuffle(order)
    out = []
    for r in range(0, len(order), 1024):
        run = sorted(order[r: r + 1024], key=lambda i: len(seqs[i].ids))
        cur: list[int] = []
        for i in run:
            if cur and (len(cur) + 1) * len(seqs[i].ids) > tokens:
                out.append(cur)
                cur = []
            cur.append(i)
        if cur:
            out.append(cur)
    rng.shuffle(out)
    return out


def _inputs(target, seqs: list[Seq], aux: tuple[int, ...], t2d: torch.Tensor):
    """(features [B, T, F], embeddings of token s+1 [B, T, H], labels [B, T]: the draft id of
    the target's greedy choice for token s+2 on answer rows, IGNORE elsewhere and where that
    choice is outside the draft vocabulary, answer rows [B, T] bool)."""
    dev = target.device
    B, T = len(seqs), max(len(s.ids) for s in seqs)
    ids = torch.zeros(B, T, dtype=torch.long)
    for b, s in enumerate(seqs):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
    ids = ids.to(dev)
    f = target.features(ids, aux)
    nxt = torch.zeros_like(ids)
    nxt[:, :-1] = ids[:, 1:]  # row s carries token s+1
    emb = target.embed(nxt)
    lab = torch.full((B, T), IGNORE, dtype=torch.long, device=dev)
    lab[:, :-1] = t2d[f.greedy[:, 1:]]
    col = torch.arange(T, device=dev)[None, :]  # row s
    lens = torch.tensor([len(x.ids) for x in seqs], device=dev)[:, None]
    plen = torch.tensor([x.prompt_len for x in seqs], device=dev)[:, None]
    rows = (col + 2 >= plen) & (col + 2 < lens)  # answer tokens only, inside the sequence
    lab[~rows] = IGNORE
    return f.aux, emb, lab, rows


def pass_outputs(head: EagleHead, feats, emb, lab, passes: int):
    """Per pass: (labels [B, T] with rows the pass cannot serve ignored, logits of the labelled
    rows [M, Vd] fp32)."""
    outs = head.unrolled(feats, emb, passes)
    res = []
    for k, out in enumerate(outs):
        lk = lab.clone()
        lk[:, :k] = IGNORE  # pass k+1 row s reads pass k's output at s-1
        m = lk != IGNORE
        res.append((lk, m, head.logits(out[m]).float()))
    return res


def lr_at(step: int, frac: float, cfg: DeviceTrainConfig) -> float:
    """Linear warm-up over steps, then cosine to 10% over the fraction of the time budget used."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def train(target, head: EagleHead, seqs: list[Seq], cfg: DeviceTrainConfig,
          log=print, probe=None, probe_every: float = 30.0) -> dict:
    """Train until cfg.seconds pass (epochs over `seqs` as time allows); the loss curve and
    per-pass top-1 accuracy every log_every steps. The head is trained in place (fp32 weights).
    probe(): a dict recorded with the step and tokens seen every probe_every seconds (held-out
    acceptance against the data seen: the data-size curve)."""
    dev = target.device
    head.to(dev).train()
    head.rope.cos, head.rope.sin = head.rope.cos.to(dev), head.rope.sin.to(dev)
    aux = head.cfg.aux_layers
    t2d = torch.full((head.cfg.vocab_size,), IGNORE, dtype=torch.long, device=dev)
    t2d[head.draft_to_target] = torch.arange(head.cfg.draft_vocab_size, device=dev)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0, betas=(0.9, 0.95))
    hist: dict[str, Any] = {"step": [], "seconds": [], "loss": [], "acc": [], "tokens": 0,
                            "epochs": 0.0, "probes": []}
    t0, step, epoch = time.perf_counter(), 0, 0
    last_probe = t0
    amp = torch.autocast(dev.type, dtype=torch.bfloat16)
    while cfg.max_steps or time.perf_counter() - t0 < cfg.seconds:
        order = batches(seqs, cfg.tokens_per_step, cfg.seed, epoch)
        for n, idx in enumerate(order):
            frac = (time.perf_counter() - t0) / cfg.seconds
            if cfg.max_steps:
                frac = step / cfg.max_steps
            if frac >= 1.0:
                hist["epochs"] = epoch + n / len(order)
                break
            for g in opt.param_groups:
                g["lr"] = lr_at(step, frac, cfg)
            batch = [seqs[i] for i in idx]
            feats, emb, lab, _ = _inputs(target, batch, aux, t2d)
            with amp:
                res = pass_outputs(head, feats, emb, lab, cfg.passes)
                loss = sum(0.8**k * F.cross_entropy(lg, lk[m]) for k, (lk, m, lg) in
                           enumerate(res) if lg.shape[0])
            assert isinstance(loss, torch.Tensor)  # some pass has a labelled row
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            step += 1
            hist["tokens"] += int(sum(len(s.ids) for s in batch))
            if probe is not None and time.perf_counter() - last_probe >= probe_every:
                hist["probes"].append({"step": step, "tokens": hist["tokens"], **probe()})
                last_probe = time.perf_counter()
            if step % cfg.log_every == 0 or step == 1:
                accs = [float((lg.argmax(-1) == lk[m]).float().mean()) if lg.shape[0] else 0.0
                        for lk, m, lg in res]
                hist["step"].append(step)
                hist["seconds"].append(round(time.perf_counter() - t0, 2))
                hist["loss"].append(round(float(loss.detach()), 4))
                hist["acc"].append([round(a, 4) for a in accs])
                log(f"step {step} {hist['seconds'][-1]:.0f}s loss {hist['loss'][-1]:.3f} top-1 "
                    + "/".join(f"{a:.2f}" for a in accs))
        else:
            epoch += 1
            hist["epochs"] = float(epoch)
            continue
        break
    hist["steps"] = step
    head.eval()
    return hist


@torch.no_grad()
def evaluate(target, head: EagleHead, seqs: list[Seq], passes: int, tokens: int = 65536
             ) -> dict:
    """Per-position acceptance of chained drafting on `seqs`, overall and per prompt kind:
    rate[j] = chains whose first j+1 drafts are all right / chains (one chain per answer row; a
    target token outside the draft vocabulary counts as a miss), cond[j] = rate[j] / rate[j-1],
    the mean accepted drafts per chain of `passes`, and the share of answer tokens the draft
    vocabulary holds."""
    dev = target.device
    aux = head.cfg.aux_layers
    t2d = torch.full((head.cfg.vocab_size,), IGNORE, dtype=torch.long, device=dev)
    t2d[head.draft_to_target] = torch.arange(head.cfg.draft_vocab_size, device=dev)
    kinds: dict[str, list] = {}
    for idx in batches(seqs, tokens, 0, 0):
        batch = [seqs[i] for i in idx]
        feats, emb, lab, rows = _inputs(target, batch, aux, t2d)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            res = pass_outputs(head, feats, emb, lab, passes)
        B, T = lab.shape
        ok = []  # per pass [B, T]: right at that row (False where unlabelled)
        for lk, m, lg in res:
            r = torch.zeros(B, T, dtype=torch.bool, device=dev)
            r[m] = lg.argmax(-1) == lk[m]
            ok.append(r)
        # A chain starts at every answer row; a token outside the draft vocabulary is a miss.
        start = rows
        chain = start.clone()
        per_pos = []
        for j in range(passes):
            shifted = torch.zeros_like(chain)
            shifted[:, : T - j] = ok[j][:, j:]
            chain &= shifted
            per_pos.append(chain.sum(1))  # [B]
        covered = (lab != IGNORE).sum(1)
        for b, s in enumerate(batch):
            kinds.setdefault(s.kind, []).append(
                [int(start[b].sum()), int(covered[b])] + [int(x[b]) for x in per_pos])
    out = {}
    for kind, rows in sorted(kinds.items()) + [("all", [r for v in kinds.values() for r in v])]:
        tot = torch.tensor(rows).sum(0).tolist()
        n = max(tot[0], 1)
        rate = [tot[j + 2] / n for j in range(passes)]
        out[kind] = {
            "chains": tot[0],
            "in_draft_vocab": round(tot[1] / n, 4),
            "rate": [round(r, 4) for r in rate],
            "cond": [round(rate[j] / rate[j - 1], 4) if j and rate[j - 1] else round(rate[j], 4)
                     for j in range(passes)],
            "mean_accepted": round(sum(rate), 4),
        }
    return out
