"""`dynaspec train-draft-head`: train an EAGLE-3 head for a target on this machine.

  dynaspec train-draft-head --model default --out heads/smollm2 --seed 0

(the defaults are the run that trained the head shipped for the default model).

The folder receives corpus.pt (the token sequences, built once), train_state.pt (resume point),
history.json, loss.png and head/ (config.json + model.safetensors in the EAGLE-3 layout, fp16),
which `--speculator eagle --draft-head OUT/head` runs. Rerunning the same command resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

log = logging.getLogger("dynaspec")


_HELP = {
    "steps": "optimizer steps (the LR schedule's length)",
    "seq_len": "tokens per training sequence",
    "batch_seqs": "sequences per step",
    "passes": "training-time unrolling depth (EAGLE-3's test steps)",
    "lr": "peak AdamW learning rate",
    "warmup": "linear warm-up steps",
    "draft_vocab": "draft vocabulary size",
    "text_tokens": "stdlib text collected for the corpus",
    "chat_prompts": "prompts the target answers",
    "answer_tokens": "longest answer generated",
    "save_every": "steps between resumable states",
    "max_train_tokens": "tokens trained on (answers first, then text); 0 = the whole corpus",
    "intermediate_size": "the head's MLP width (0: the target's)",
    "seed": "seed of data order and init",
}


def register(sub) -> None:
    from dynaspec.train.draft_head import TrainConfig

    p = sub.add_parser(
        "train-draft-head",
        help="train an EAGLE-3 draft head for a target (teacher forcing)",
        description=__doc__,
    )
    d = TrainConfig()
    p.add_argument("--model", default=d.model, help="the target (path, .gguf or default)")
    p.add_argument(
        "--out", required=True, help="output folder (resumes if it holds a training state)"
    )
    for f in dataclasses.fields(TrainConfig):
        if f.name not in ("model", "out"):
            p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                           help=_HELP.get(f.name, f.name.replace("_", " ")))
    g = p.add_argument_group(
        "from a device run's answers (scripts/gpu_eagle.sh): the batched target, time-boxed")
    g.add_argument("--answers", default="", help="folder of answers-*.npz files; trains on them "
                   "with the device trainer instead of building a corpus here")
    g.add_argument("--device", default="", help="cuda or cpu (default: cuda when present)")
    g.add_argument("--seconds", type=float, default=170.0, help="training time budget")
    g.add_argument("--resume", default="", help="a head folder to continue training")
    p.set_defaults(func=run)


def run_from_answers(args) -> int:
    from dynaspec.models.loader import resolve_model_path
    from dynaspec.train.eagle_recipe import train_from_answers

    env = {"OUT": args.out, "MODEL_GGUF": resolve_model_path(args.model)[0],
           "DEVICE": args.device, "TRAIN_S": str(args.seconds), "RESUME": args.resume,
           "SEED": str(args.seed), "PASSES": str(args.passes),
           "DRAFT_VOCAB": str(args.draft_vocab), "TOTAL_S": str(args.seconds + 60)}
    return train_from_answers(args.answers, env)


def run(args) -> int:
    if args.answers:
        return run_from_answers(args)
    import torch
    from tqdm import tqdm

    from dynaspec import LLM
    from dynaspec.spec_decode.drafters.eagle_head import default_aux_layers
    from dynaspec.train import corpus as C
    from dynaspec.train.draft_head import (
        TrainConfig,
        draft_vocab,
        feature_cache,
        plot_loss,
        select,
        train,
    )

    cfg = TrainConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainConfig)})
    torch.manual_seed(cfg.seed)
    os.makedirs(cfg.out, exist_ok=True)
    llm = LLM(model=cfg.model, seed=cfg.seed)
    model = llm.engine.parts.model
    cpath = os.path.join(cfg.out, "corpus.pt")
    if os.path.exists(cpath):
        data = torch.load(cpath)
    else:
        t0 = time.perf_counter()
        files = C.stdlib_files(cfg.seed)
        text = C.text_windows(llm.tokenizer, files, cfg.seq_len, cfg.text_tokens)
        gen = (
            C.generate_answers(
                llm,
                C.chat_prompts(files, cfg.chat_prompts, cfg.seed),
                cfg.answer_tokens,
                cfg.seq_len,
            )
            if cfg.chat_prompts
            else []
        )
        seqs = [
            s for s in text if len(s) > 8
        ] + gen  # the generated answers last (select() relies on it)
        eos = tuple(llm.engine.parts.eos_token_ids)
        data = {"seqs": seqs, "d2t": draft_vocab(seqs, cfg.draft_vocab, model.cfg.vocab_size, eos),
                "num_generated": len(gen), "seconds": time.perf_counter() - t0}
        torch.save(data, cpath)
    seqs = select(data["seqs"], data["num_generated"], cfg.max_train_tokens)
    print(
        f"corpus: {len(data['seqs'])} sequences, {sum(len(s) for s in data['seqs'])} tokens "
        f"({data['num_generated']} generated answers, built in {data['seconds']:.0f} s); training "
        f"on "
        f"{len(seqs)} sequences, {sum(len(s) for s in seqs)} tokens; draft vocabulary "
        f"{len(data['d2t'])}"
    )
    t0 = time.perf_counter()
    fbar = tqdm(total=len(seqs), desc="target features", unit="seq")
    cached = feature_cache(model, seqs, default_aux_layers(model.cfg.num_hidden_layers),
                           os.path.join(cfg.out, "features.pt"), lambda n: fbar.update(n - fbar.n))
    fbar.close()
    print(f"target features ready in {time.perf_counter() - t0:.0f} s")
    bar = tqdm(total=cfg.steps, desc="draft head", unit="step")

    def progress(step: int, loss: float, accs: list[float]) -> None:
        bar.n = step
        bar.set_postfix(loss=f"{loss:.3f}", acc="/".join(f"{a:.2f}" for a in accs))
        bar.refresh()

    hist = train(model, seqs, cached, data["d2t"], cfg, progress)
    bar.close()
    print(
        f"trained {hist['step'][-1]} steps in {hist['seconds']:.0f} s; head in "
        f"{os.path.join(cfg.out, 'head')}"
    )
    try:
        print(f"loss plot: {plot_loss(hist, os.path.join(cfg.out, 'loss.png'))}")
    except ImportError as exc:
        print(f"no loss plot: {exc}")
    return 0
