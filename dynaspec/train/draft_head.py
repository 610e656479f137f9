"""Train an EAGLE-3 head for a target here: teacher forcing on the target's hidden states.

Each step runs the target (no grad) over a batch of corpus sequences, capturing its low/middle/
high hidden states and its greedy next-token choice at every position; the head then learns to
predict the target's choice two tokens ahead from (features at s, embedding of token s+1), over
`passes` chained passes (EAGLE-3's training-time test: pass k reads the head's own output of pass
k-1, so it learns to draft from its own earlier drafts). Losses are weighted 0.8^(k-1) as in
EAGLE-3. Labels are the target's greedy choices restricted to the draft vocabulary (the most
frequent ids of the corpus); the head's lm_head and norm start from the target's own rows.
Seeded; the state (head, optimizer, step, losses) is saved every `save_every` steps and a
rerun with the same --out resumes from it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dynaspec.attention.backend import AttentionBatch
from dynaspec.spec_decode.drafters.eagle_head import EagleHead, HeadConfig, default_aux_layers
from dynaspec.spec_decode.drafters.eagle_io import save_eagle3

log = logging.getLogger("dynaspec")
IGNORE = -100


@dataclass(frozen=True)
class TrainConfig:
    model: str = "default"
    out: str = "draft-head"
    seed: int = 0
    steps: int = 700
    seq_len: int = 512
    batch_seqs: int = 4  # sequences per step
    passes: int = 3  # training-time unrolling depth
    lr: float = 1e-3
    warmup: int = 30
    draft_vocab: int = 8192
    text_tokens: int = 40_000  # stdlib text for teacher forcing
    # Prompts the target answers (its own generations): what the head drafts is answers. Held-out
    # chat position-1 acceptance: 128 of them 0.13, 768 0.20, 2,400 with everyday questions 0.27
    # (31 minutes in all on 2 cores).
    chat_prompts: int = 2400
    answer_tokens: int = 256
    save_every: int = 20
    # Sequences trained on: the target's own answers first, then stdlib text, up to this many
    # tokens (the target pass over them is the costly part on a small CPU). 0: all.
    max_train_tokens: int = 0
    intermediate_size: int = 0  # 0: the target's


def target_pass(model, seqs: list[list[int]], dtype: torch.dtype = torch.float16
                ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per sequence: (features [n, A*H] fp16, the target's greedy next-token ids [n]) from one
    forward of the target over the sequences (each its own request)."""
    B, T, bs = len(seqs), max(len(s) for s in seqs), 16
    blocks = -(-T // bs)
    kv = model.allocate_kv(B * blocks * bs)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(B)]
    lens = [len(s) for s in seqs]
    md = model.attn.build_metadata(AttentionBatch(lens, lens, tables, bs, model.device))
    ids = torch.tensor([t for s in seqs for t in s])
    pos = torch.tensor([p for s in seqs for p in range(len(s))])
    with torch.inference_mode():
        greedy = model.forward(ids, pos, kv, md, torch.arange(len(ids))).argmax(-1)  # [N]
        aux = model.aux_hidden.to(dtype)  # [N, A*H]
    out, o = [], 0
    for n in lens:
        out.append((aux[o: o + n].clone(), greedy[o: o + n].clone()))
        o += n
    return out


def feature_cache(model, seqs: list[list[int]], aux: tuple[int, ...], path: str, progress=None,
                  chunk: int = 4) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The target's features and greedy choices for every sequence, computed once (the target
    pass is the costly part: each epoch reads them from here) and saved every 16 chunks."""
    done = torch.load(path) if os.path.exists(path) else []
    model.aux_layers = aux
    try:
        for i in range(len(done), len(seqs), chunk):
            done += target_pass(model, seqs[i: i + chunk])
            if progress is not None:
                progress(len(done))
            if (i // chunk) % 16 == 15 or len(done) == len(seqs):
                torch.save(done, path + ".tmp")
                os.replace(path + ".tmp", path)
    finally:
        model.aux_layers = ()
    return done


def select(seqs: list[list[int]], num_generated: int, max_tokens: int) -> list[list[int]]:
    """The training sequences: generated answers (stored last in the corpus) first, then text,
    until max_tokens (0: all). Deterministic, so a resumed run trains on the same ones."""
    ordered = seqs[len(seqs) - num_generated:] + seqs[: len(seqs) - num_generated]
    if max_tokens <= 0:
        return ordered
    out, total = [], 0
    for s in ordered:
        if total >= max_tokens:
            break
        out.append(s)
        total += len(s)
    return out


def draft_vocab(
    seqs: list[list[int]], size: int, vocab: int, always: tuple[int, ...]
) -> torch.Tensor:
    """The `size` most frequent ids of the corpus (plus `always`, e.g. EOS), sorted: [size]."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(torch.tensor(s), minlength=vocab)
    counts[list(always)] = counts.max() + 1
    return torch.sort(torch.topk(counts, min(size, vocab)).indices).values


def new_head(model, cfg: TrainConfig, d2t: torch.Tensor) -> EagleHead:
    a = model.cfg
    scaling = tuple(sorted(a.rope_scaling.items())) if a.rope_scaling else None
    hc = HeadConfig(
        kind="eagle3",
        hidden_size=a.hidden_size,
        target_hidden_size=a.hidden_size,
        num_attention_heads=a.num_attention_heads,
        num_key_value_heads=a.num_key_value_heads,
        head_dim=a.head_dim,
        intermediate_size=cfg.intermediate_size or a.intermediate_size,
        vocab_size=a.vocab_size,
        draft_vocab_size=len(d2t),
        aux_layers=default_aux_layers(a.num_hidden_layers),
        rms_norm_eps=a.rms_norm_eps,
        rope_theta=a.rope_theta,
        rope_scaling=scaling,
        max_positions=a.max_position_embeddings,
    )
    torch.manual_seed(cfg.seed)
    head = EagleHead(hc)
    head.draft_to_target.copy_(d2t)
    with torch.no_grad():  # start from the target's own output rows and final norm
        # (the target may sit on an accelerator: its rows come back to the CPU head)
        ids = d2t.to(model.norm.device)
        rows = model.embed(ids).float().cpu() if a.tie_word_embeddings else None
        assert head.lm_head is not None and head.norm is not None  # an eagle3 head
        if rows is not None:
            head.lm_head.weight.copy_(rows)
        head.norm.copy_(model.norm.float().cpu())
    return head


def labels_for(nxt: torch.Tensor, t2d: torch.Tensor) -> torch.Tensor:
    """Row s predicts token s+2 = the target's greedy choice at s+1, as a draft id: [B, T]."""
    lab = torch.full_like(nxt, IGNORE)
    tgt = nxt[:, 1:]
    ok = tgt >= 0
    lab[:, :-1] = torch.where(ok, t2d[tgt.clamp(min=0)], IGNORE)
    return lab


def collate(
    model, seqs, cached
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(features [B, T, A*H] fp32, embeddings of token s+1 [B, T, H], next tokens [B, T] (-1
    past the end), lengths [B]) padded to T."""
    B, T = len(seqs), max(len(s) for s in seqs)
    feats = torch.zeros(B, T, cached[0][0].shape[-1])
    nxt = torch.full((B, T), -1, dtype=torch.long)
    tokens = torch.zeros(B, T, dtype=torch.long)
    for b, (s, (f, g)) in enumerate(zip(seqs, cached)):
        feats[b, : len(s)], nxt[b, : len(s)] = f.float(), g
        tokens[b, : len(s) - 1] = torch.tensor(s[1:])  # row s carries token s+1
    with torch.no_grad():
        emb = model.embed(tokens.flatten()).float().view(B, T, -1)
    lens = torch.tensor([len(s) for s in seqs])
    return feats, emb, nxt, lens


def step_loss(
    head: EagleHead, model, seqs, cached, t2d, passes: int
) -> tuple[torch.Tensor, list[float]]:
    """Weighted loss over the passes and each pass's top-1 accuracy (bf16 autocast: measured
    here ~4x faster than fp32 for the head's step; the weights and the optimizer stay fp32)."""
    feats, emb, nxt, lens = collate(model, seqs, cached)
    T = nxt.shape[1]
    lab = labels_for(nxt, t2d)
    lab[torch.arange(T)[None, :] >= (lens - 1)[:, None]] = IGNORE  # no token s+1 there
    loss: torch.Tensor | float = 0.0
    accs: list[float] = []
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = head.unrolled(feats, emb, passes)
        for k, out in enumerate(outs):
            lk = lab.clone()
            lk[:, :k] = IGNORE  # pass k+1 rows s < k have no previous output to read
            logits = head.logits(out).float()  # [B, T, Vd]
            loss = loss + 0.8**k * F.cross_entropy(
                logits.flatten(0, 1), lk.flatten(), ignore_index=IGNORE
            )
            m = lk != IGNORE
            accs.append(float((logits.argmax(-1)[m] == lk[m]).float().mean()) if m.any() else 0.0)
    assert isinstance(loss, torch.Tensor)  # passes >= 1
    return loss, accs


def lr_at(step: int, cfg: TrainConfig) -> float:
    import math

    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))


def batch_at(step: int, n: int, cfg: TrainConfig) -> list[int]:
    """Sequence indices for a step: a seeded permutation per epoch (resume-stable)."""
    per_epoch = max(1, n // cfg.batch_seqs)
    epoch, i = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
    return perm[i * cfg.batch_seqs: (i + 1) * cfg.batch_seqs].tolist()


def train(model, seqs: list[list[int]], cached: list, d2t: torch.Tensor, cfg: TrainConfig,
          progress=None) -> dict:
    """Run (or resume) training; writes the head and the state into cfg.out. Returns the history."""
    os.makedirs(cfg.out, exist_ok=True)
    state_path = os.path.join(cfg.out, "train_state.pt")
    head = new_head(model, cfg, d2t)
    opt = torch.optim.AdamW(
        [p for p in head.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=0.0
    )
    hist: dict[str, Any] = {"step": [], "loss": [], "acc": [], "seconds": 0.0}
    start = 0
    if os.path.exists(state_path):
        st = torch.load(state_path, weights_only=False)
        head.load_state_dict(st["head"])
        opt.load_state_dict(st["opt"])
        hist, start = st["hist"], st["step"]
        log.info("resuming draft-head training at step %d of %d", start, cfg.steps)
    t2d = torch.full((model.cfg.vocab_size,), IGNORE, dtype=torch.long)
    t2d[d2t] = torch.arange(len(d2t))
    t0 = time.perf_counter()
    for step in range(start, cfg.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg)
        idx = batch_at(step, len(seqs), cfg)
        loss, accs = step_loss(
            head, model, [seqs[i] for i in idx], [cached[i] for i in idx], t2d, cfg.passes
        )
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        hist["step"].append(step + 1)
        hist["loss"].append(float(loss.detach()))
        hist["acc"].append(accs)
        if progress is not None:
            progress(step + 1, float(loss.detach()), accs)
        if (step + 1) % cfg.save_every == 0 or step + 1 == cfg.steps:
            hist["seconds"] += time.perf_counter() - t0
            t0 = time.perf_counter()
            torch.save(
                {
                    "head": head.state_dict(),
                    "opt": opt.state_dict(),
                    "hist": hist,
                    "step": step + 1,
                },
                state_path + ".tmp",
            )
            os.replace(state_path + ".tmp", state_path)
    save_eagle3(head, os.path.join(cfg.out, "head"), extra={"dynaspec_training": asdict(cfg)})
    with open(os.path.join(cfg.out, "history.json"), "w", encoding="utf-8") as f:
        json.dump(hist, f)
    return hist


def plot_loss(hist: dict, path: str) -> str:
    """Loss and per-pass top-1 accuracy by step, as a PNG (matplotlib: the `train` extra)."""
    from dynaspec.extras import require

    matplotlib = require("matplotlib", "train", "the draft-head loss plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(hist["step"], hist["loss"], lw=0.8)
    a.set(xlabel="step", ylabel="loss (passes weighted 0.8^k)", title="draft-head training loss")
    for k in range(len(hist["acc"][0]) if hist["acc"] else 0):
        b.plot(hist["step"], [x[k] for x in hist["acc"]], lw=0.8, label=f"draft position {k + 1}")
    b.set(xlabel="step", ylabel="top-1 = target's greedy token", title="training accuracy")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
