"""The EAGLE-3 head's whole recipe in one time-boxed run (scripts/gpu_eagle.sh): the target
answers 10^5 prompts, the head trains on the answers, acceptance is measured on a held-out part.

  MODEL_GGUF=/root/m/model.gguf OUT=out/eagle python -m dynaspec.train.eagle_recipe
  DRY_RUN=1 OUT=/tmp/x python -m dynaspec.train.eagle_recipe    # tiny shapes on the CPU

Stages, each against a deadline measured from the start (TOTAL_S in all):
1. load: the GGUF through dynaspec's loader, dequantized, cast to bf16 on the device (DRY_RUN
   without MODEL_GGUF: a tiny random Llama with the default model's tokenizer);
2. prompts: prompt_mix.make_prompts, seeded, through the chat template;
3. generate: greedy answers in batches of GEN_BATCH, until the prompts or the generation
   deadline run out (what exists is kept), written at once as token files;
4. train: device_train.train on the answers minus a held-out part, until its deadline;
5. evaluate: per-position acceptance on the held-out part; the head written (EAGLE-3 layout,
   fp16, in shards under 16 MiB).
$OUT receives at most 8 files: report.json (rewritten after every stage), answers-*.npz (at
most 4), head/config.json and head/model-0000i-of-0000n.safetensors.
RESUME=DIR (a head folder from an earlier run) continues training that head.
"""

from __future__ import annotations

import json
import os
import platform
import random
import sys
import time

import numpy as np
import torch

ANSWER_FILES = 4
FILE_BYTES = 15 * 2**20  # raw token bytes per answers file (the transfer limit is 16 MiB)


class Skip(Exception):
    """A stage cannot run here (no model file): noted in the report, exit status 0."""


class Recipe:
    def __init__(self, env: dict) -> None:
        self.t0 = time.perf_counter()
        self.dry = env.get("DRY_RUN", "") not in ("", "0")
        self.out = env.get("OUT") or "out/eagle"
        self.total = float(env.get("TOTAL_S", 150 if self.dry else 375))
        self.gen_end = float(env.get("GEN_END_S", 0.42 * self.total))
        self.train_end = float(env.get("TRAIN_END_S", 0.90 * self.total))
        self.n_prompts = int(env.get("N_PROMPTS", 96 if self.dry else 110_000))
        self.answer_tokens = int(env.get("ANSWER_TOKENS", 12 if self.dry else 112))
        self.prompt_tokens = int(env.get("PROMPT_TOKENS", 320))
        self.gen_batch = int(env.get("GEN_BATCH", 16 if self.dry else 4096))
        self.tokens_per_step = int(env.get("TRAIN_TOKENS", 2048 if self.dry else 65536))
        self.passes = int(env.get("PASSES", 4))
        self.draft_vocab = int(env.get("DRAFT_VOCAB", 8192))
        self.seed = int(env.get("SEED", 0))
        self.model_path = env.get("MODEL_GGUF", "")
        self.resume = env.get("RESUME", "")
        self.device = torch.device(env.get("DEVICE") or
                                   ("cuda" if torch.cuda.is_available() else "cpu"))
        os.makedirs(self.out, exist_ok=True)
        self.report: dict = {"config": {k: v for k, v in vars(self).items()
                                        if isinstance(v, (int, float, str, bool))},
                             "python": platform.python_version(), "torch": torch.__version__,
                             "device": str(self.device), "stages": {}, "notes": []}

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def log(self, msg: str) -> None:
        print(f"[{self.now():6.1f}s] {msg}", flush=True)

    def save_report(self) -> None:
        path = os.path.join(self.out, "report.json")
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            json.dump(self.report, f, indent=1)
        os.replace(path + ".tmp", path)

    def stage(self, name: str, **facts) -> None:
        self.report["stages"][name] = {"done_at_s": round(self.now(), 1), **facts}
        self.save_report()
        self.log(f"{name}: {facts}")

    # -- 1. load ---------------------------------------------------------------------------------

    def load(self):
        from dynaspec.train.batched_llama import BatchedLlama

        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        if self.model_path and os.path.exists(self.model_path):
            from dynaspec.models.gguf_loader import load_gguf_file

            lm = load_gguf_file(self.model_path)
            model = BatchedLlama(lm.arch, lm.state_dict, self.device, dtype)
            tok, eos, source = lm.tokenizer, lm.eos_token_ids, self.model_path
        elif self.dry:
            model, tok, eos = tiny_random_target(self.device, dtype, self.seed)
            source = "tiny random llama (DRY_RUN)"
        else:
            raise Skip(f"MODEL_GGUF={self.model_path!r} does not exist: the real-model stages "
                       "are skipped")
        self.stage("load", model=source, layers=model.cfg.num_hidden_layers,
                   hidden=model.cfg.hidden_size, eos=list(eos))
        return model, tok, tuple(eos)

    # -- 2. prompts ------------------------------------------------------------------------------

    def prompts(self, tok):
        from dynaspec.train import prompt_mix

        prompts = prompt_mix.make_prompts(self.n_prompts, self.seed)
        ids, keep = prompt_mix.chat_ids(tok, prompts, self.prompt_tokens)
        kinds = [prompts[i].kind for i in keep]
        counts = {k: kinds.count(k) for k in sorted(set(kinds))}
        self.stage("prompts", made=len(prompts), kept=len(ids), by_kind=counts,
                   digest=prompt_mix.digest(prompts),
                   prompt_tokens=int(sum(len(x) for x in ids)))
        return ids, kinds

    # -- 3. generate -----------------------------------------------------------------------------

    def generate(self, model, ids: list[list[int]], eos: tuple[int, ...]) -> list[int]:
        """Answers for prompts in a seeded order, sorted by length within runs of 8 batches;
        stops before a batch that would pass the deadline (the first batch always runs).
        Returns the answered indices."""
        order = list(range(len(ids)))
        random.Random(self.seed).shuffle(order)
        run = 8 * self.gen_batch
        self.answers: dict[int, list[int]] = {}
        last = 0.0
        for r in range(0, len(order), run):
            chunk = sorted(order[r: r + run], key=lambda i: len(ids[i]))
            for b in range(0, len(chunk), self.gen_batch):
                if self.answers and self.now() + 1.2 * last > self.gen_end:
                    self.report["notes"].append(
                        f"generation stopped at its deadline after {len(self.answers)} answers")
                    return sorted(self.answers)
                t = time.perf_counter()
                part = chunk[b: b + self.gen_batch]
                self.answers.update(zip(part, self._answer([ids[i] for i in part], model, eos)))
                last = time.perf_counter() - t
                self.log(f"generated {len(self.answers)}/{len(ids)} ({last:.1f}s a batch)")
        return sorted(self.answers)

    def _answer(self, prompts, model, eos) -> list[list[int]]:
        """model.generate, in halves while the device runs out of memory."""
        try:
            return model.generate(prompts, self.answer_tokens, eos)
        except torch.cuda.OutOfMemoryError:
            if len(prompts) < 64:
                raise
            torch.cuda.empty_cache()
            self.gen_batch = max(64, len(prompts) // 2)
            self.report["notes"].append(f"out of memory: generation batch now {self.gen_batch}")
            half = len(prompts) // 2
            return self._answer(prompts[:half], model, eos) + self._answer(prompts[half:], model,
                                                                          eos)

    def write_answers(self, ids, kinds, done: list[int], eos) -> int:
        """answers-i.npz: tokens (uint16, prompt + answer, flat), offsets, prompt_lens, kinds;
        as many sequences as fit ANSWER_FILES files of FILE_BYTES raw bytes."""
        names = sorted(set(kinds))
        written = f = 0
        cur: list[int] = []
        size = 0
        for i in done + [None]:
            full = i is None or size + 2 * (len(ids[i]) + len(self.answers[i])) > FILE_BYTES
            if full and cur:
                toks = [ids[j] + self.answers[j] for j in cur]
                np.savez_compressed(
                    os.path.join(self.out, f"answers-{f}.npz"),
                    tokens=np.array([t for s in toks for t in s], dtype=np.uint16),
                    offsets=np.cumsum([0] + [len(s) for s in toks]).astype(np.int64),
                    prompt_lens=np.array([len(ids[j]) for j in cur], dtype=np.int32),
                    kinds=np.array([names.index(kinds[j]) for j in cur], dtype=np.int8),
                    kind_names=np.array(names), eos=np.array(eos, dtype=np.int64))
                written, f, cur, size = written + len(cur), f + 1, [], 0
            if i is None or f == ANSWER_FILES:
                break
            cur.append(i)
            size += 2 * (len(ids[i]) + len(self.answers[i]))
        return written

    # -- 4 and 5. train, evaluate, write the head ------------------------------------------------

    def head(self, model, seqs, eos):
        from dynaspec.spec_decode.drafters.eagle_head import default_aux_layers
        from dynaspec.spec_decode.drafters.eagle_io import load_head
        from dynaspec.train.device_train import draft_vocab
        from dynaspec.train.draft_head import TrainConfig, new_head

        if self.resume:
            head, _ = load_head(self.resume, model.cfg)
            head.requires_grad_(True)
            self.report["notes"].append(f"resumed from {self.resume} (fresh optimizer moments)")
            return head
        d2t = draft_vocab(seqs, self.draft_vocab, model.cfg.vocab_size, eos)
        head = new_head(model, TrainConfig(seed=self.seed), d2t.cpu())
        assert head.cfg.aux_layers == default_aux_layers(model.cfg.num_hidden_layers)
        return head

    def train_and_evaluate(self, model, seqs, eos) -> None:
        from dynaspec.train import device_train as D

        rng = random.Random(self.seed + 1)
        held = set(rng.sample(range(len(seqs)), max(1, len(seqs) // 50)))
        train = [s for i, s in enumerate(seqs) if i not in held]
        test = [s for i, s in enumerate(seqs) if i in held]
        head = self.head(model, train, eos)
        eval_s = 8.0 if not self.dry else 2.0
        cfg = D.DeviceTrainConfig(seconds=max(1.0, self.train_end - self.now() - eval_s),
                                  tokens_per_step=self.tokens_per_step, passes=self.passes,
                                  seed=self.seed)
        def probe() -> dict:
            a = D.evaluate(model, head, test[:256], self.passes, self.tokens_per_step)["all"]
            self.log(f"held-out probe: rate {a['rate']}")
            return {"rate": a["rate"], "mean_accepted": a["mean_accepted"]}

        hist = D.train(model, head, train, cfg, log=self.log, probe=probe,
                       probe_every=2.0 if self.dry else 25.0)
        self.stage("train", sequences=len(train), held_out=len(test), steps=hist["steps"],
                   epochs=round(hist["epochs"], 3), tokens=hist["tokens"],
                   draft_vocab=head.cfg.draft_vocab_size, passes=self.passes,
                   history={k: hist[k] for k in ("step", "seconds", "loss", "acc", "probes")})
        self.write_head(head)
        acc = D.evaluate(model, head, test, self.passes, self.tokens_per_step)
        self.stage("evaluate", acceptance=acc)

    def write_head(self, head) -> None:
        from dynaspec.spec_decode.drafters.eagle_io import save_eagle3, shard_safetensors

        path = os.path.join(self.out, "head")
        save_eagle3(head.cpu(), path, extra={"dynaspec_training": self.report["config"]})
        shards = shard_safetensors(os.path.join(path, "model.safetensors"), FILE_BYTES)
        self.stage("head", files=[os.path.relpath(s, self.out) for s in shards])
        head.to(self.device)

    def run(self) -> None:
        from dynaspec.train.device_train import Seq

        model, tok, eos = self.load()
        ids, kinds = self.prompts(tok)
        done = self.generate(model, ids, eos)
        n_ans = sum(len(self.answers[i]) for i in done)
        written = self.write_answers(ids, kinds, done, eos)
        self.stage("generate", answers=len(done), answer_tokens=n_ans, files_hold=written,
                   ended_with_eos=sum(1 for i in done if self.answers[i][-1:] and
                                      self.answers[i][-1] in eos))
        seqs = [Seq(ids[i] + self.answers[i], len(ids[i]), kinds[i]) for i in done]
        self.train_and_evaluate(model, seqs, eos)
        self.stage("end", total_s=round(self.now(), 1))


def read_answers(folder: str) -> list:
    """The sequences of the answers-*.npz files a run wrote (device_train.Seq each)."""
    import glob

    from dynaspec.train.device_train import Seq

    seqs = []
    for path in sorted(glob.glob(os.path.join(folder, "answers-*.npz"))):
        z = np.load(path)
        toks, offs, names = z["tokens"].astype(np.int64), z["offsets"], z["kind_names"]
        for i, (p, k) in enumerate(zip(z["prompt_lens"], z["kinds"])):
            seqs.append(Seq(toks[offs[i]: offs[i + 1]].tolist(), int(p), str(names[k])))
    if not seqs:
        raise FileNotFoundError(f"no answers-*.npz files in {folder!r}")
    return seqs


def train_from_answers(answers: str, env: dict) -> int:
    """Train (or, with RESUME, continue) the head on answers an earlier run returned, with the
    same stages 4-5 (dynaspec train-draft-head --answers DIR --device cuda)."""
    r = Recipe(env)
    model, _, eos = r.load()
    seqs = read_answers(answers)
    r.stage("answers", sequences=len(seqs), folder=answers)
    r.train_end = r.now() + float(env.get("TRAIN_S", 170))
    r.train_and_evaluate(model, seqs, eos)
    r.stage("end", total_s=round(r.now(), 1))
    return 0


def tiny_random_target(device, dtype, seed: int):
    """A 4-layer random Llama over the default model's tokenizer (the dry run's target)."""
    from dynaspec.model_arch import ModelArchConfig
    from dynaspec.models.default_model import default_model_path
    from dynaspec.models.gguf_tokenizer import load_gguf_tokenizer
    from dynaspec.train.batched_llama import BatchedLlama

    tok, eos = load_gguf_tokenizer(default_model_path())
    arch = ModelArchConfig(architecture="llama", vocab_size=49152, hidden_size=64,
                           intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                           tie_word_embeddings=True)
    g = torch.Generator().manual_seed(seed)
    sd = {"model.embed_tokens.weight": torch.randn(49152, 64, generator=g),
          "model.norm.weight": torch.ones(64)}
    for i in range(4):
        p = f"model.layers.{i}."
        for name, shape in (("self_attn.q_proj", (64, 64)), ("self_attn.k_proj", (32, 64)),
                            ("self_attn.v_proj", (32, 64)), ("self_attn.o_proj", (64, 64)),
                            ("mlp.gate_proj", (128, 64)), ("mlp.up_proj", (128, 64)),
                            ("mlp.down_proj", (64, 128))):
            sd[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.1
        sd[p + "input_layernorm.weight"] = torch.ones(64)
        sd[p + "post_attention_layernorm.weight"] = torch.ones(64)
    return BatchedLlama(arch, sd, device, dtype), tok, eos


def main() -> int:
    r = Recipe(dict(os.environ))
    try:
        r.run()
    except Skip as why:
        r.report["notes"].append(str(why))
        r.save_report()
        r.log(str(why))
    except BaseException as exc:  # the report says how far it got, then the error propagates
        r.report["error"] = f"{type(exc).__name__}: {exc}"
        r.save_report()
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
