"""The time-boxed trainer on a tiny target (on the CPU): the loss falls on the target's own
answers, held-out acceptance is what chained drafting scores, and a head written in shards
loads again."""

from __future__ import annotations

import os

import torch

from dynaspec.models.loader import load_model_files
from dynaspec.spec_decode.drafters.eagle_io import load_head, save_eagle3, shard_safetensors
from dynaspec.train import device_train as D
from dynaspec.train.batched_llama import BatchedLlama
from dynaspec.train.draft_head import TrainConfig, new_head
from dynaspec.train.install_head import install
from tests.e2e.conftest import random_prompts


def _setup(path):
    lm = load_model_files(path)
    target = BatchedLlama(lm.arch, lm.state_dict, "cpu", torch.float32)
    prompts = random_prompts(8, 280, seed=21, lo=4, hi=12)
    answers = target.generate(prompts, 16, eos_ids=())
    seqs = [D.Seq(p + a, len(p), "chat" if i % 2 else "code_edit")
            for i, (p, a) in enumerate(zip(prompts, answers))]
    d2t = D.draft_vocab(seqs, 96, lm.arch.vocab_size, (2,))
    return target, seqs, new_head(target, TrainConfig(intermediate_size=64), d2t)


def test_training_lowers_the_loss_and_acceptance_is_chained(tiny_llama_dir):
    target, seqs, head = _setup(tiny_llama_dir)
    assert head.cfg.draft_vocab_size == 96 and 2 in head.draft_to_target.tolist()
    before = D.evaluate(target, head, seqs, passes=3, tokens=400)
    cfg = D.DeviceTrainConfig(seconds=1e9, max_steps=16, tokens_per_step=160, passes=3,
                              lr=3e-3, warmup=3, log_every=1)
    hist = D.train(target, head, seqs, cfg, log=lambda m: None, probe=lambda: {"x": 1},
                   probe_every=0.0)
    assert hist["steps"] == 16 and hist["epochs"] > 1
    assert [p["step"] for p in hist["probes"]] == list(range(1, 17))
    assert hist["probes"][-1]["tokens"] == hist["tokens"] and hist["probes"][0]["x"] == 1
    assert sum(hist["loss"][-5:]) < sum(hist["loss"][:5])
    after = D.evaluate(target, head, seqs, passes=3, tokens=400)
    assert after["all"]["rate"][0] > before["all"]["rate"][0]
    for res in after.values():
        r = res["rate"]
        assert 1 >= r[0] >= r[1] >= r[2] >= 0 and res["mean_accepted"] == round(sum(r), 4)
    assert after["all"]["chains"] == after["chat"]["chains"] + after["code_edit"]["chains"]
    # position 1 is pass 1's top-1 on answer rows, counted directly
    t2d = torch.full((288,), D.IGNORE)
    t2d[head.draft_to_target] = torch.arange(96)
    right = total = 0
    for s in seqs:
        f = target.features(torch.tensor([s.ids]), head.cfg.aux_layers)
        ids = torch.tensor(s.ids)
        emb = target.embed(torch.cat([ids[1:], ids[:1]]))[None]
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            out = head.unrolled(f.aux, emb, 1)[0]
            pred = head.logits(out).float().argmax(-1)[0]
        for r in range(s.prompt_len - 2, len(s.ids) - 2):
            lab = int(t2d[f.greedy[0, r + 1]])
            total += 1
            right += lab != D.IGNORE and int(pred[r]) == lab
    assert after["all"]["chains"] == total
    assert abs(after["all"]["rate"][0] - right / total) < 0.03  # bf16 batch vs one by one


def test_a_sharded_head_loads_as_the_whole_one(tiny_llama_dir, tmp_path):
    target, _, head = _setup(tiny_llama_dir)
    save_eagle3(head, str(tmp_path / "h"))
    whole, _ = load_head(str(tmp_path / "h"), target.cfg)
    files = shard_safetensors(str(tmp_path / "h" / "model.safetensors"), 20_000)
    assert len(files) >= 2 and all(f.endswith(f"-of-{len(files):05d}.safetensors") for f in files)
    again, _ = load_head(str(tmp_path / "h"), target.cfg)
    for k, v in whole.state_dict().items():
        assert torch.equal(v, again.state_dict()[k]), k
    dest = install(str(tmp_path / "h"), str(tmp_path / "pkg" / "head"), tiny_llama_dir)
    assert sorted(os.listdir(dest)) == ["config.json", "model.safetensors"]
    installed, _ = load_head(dest, target.cfg)
    assert all(torch.equal(v, installed.state_dict()[k]) for k, v in whole.state_dict().items())
