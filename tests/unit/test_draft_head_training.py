"""train-draft-head's core on a tiny target: the loss falls, a resumed run equals an uninterrupted
one (same seed, same batches, same optimizer state), and the saved head loads for the target."""

from __future__ import annotations

import os

import pytest
import torch

from dynaspec import LLM
from dynaspec.spec_decode.drafters.eagle_head import default_aux_layers
from dynaspec.spec_decode.drafters.eagle_io import load_head
from dynaspec.train.draft_head import TrainConfig, draft_vocab, feature_cache, select, train


def _setup(tiny_llama_dir, tmp_path):
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=64)
    model = llm.engine.parts.model
    g = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(3, 288, (int(n),), generator=g).tolist() for n in (40, 33, 48, 25, 37, 44)
    ]
    cached = feature_cache(model, seqs, default_aux_layers(2), str(tmp_path / "features.pt"))
    return model, seqs, cached, draft_vocab(seqs, 128, 288, (2,))


def test_training_lowers_the_loss_and_resumes_exactly(tiny_llama_dir, tmp_path):
    model, seqs, cached, d2t = _setup(tiny_llama_dir, tmp_path)
    assert len(d2t) == 128 and 2 in d2t.tolist()
    base = dict(
        steps=12, batch_seqs=2, lr=3e-3, warmup=2, passes=2, intermediate_size=64, save_every=6
    )
    whole = train(model, seqs, cached, d2t, TrainConfig(out=str(tmp_path / "a"), **base))
    assert whole["loss"][-1] < whole["loss"][0]
    # The same run killed during step 7 (the state was saved after step 6), then rerun.
    def kill(step, loss, accs):
        if step == 7:
            raise KeyboardInterrupt

    cfg = TrainConfig(out=str(tmp_path / "b"), **base)
    with pytest.raises(KeyboardInterrupt):
        train(model, seqs, cached, d2t, cfg, kill)
    assert not os.path.exists(tmp_path / "b" / "head")
    resumed = train(model, seqs, cached, d2t, cfg)
    assert resumed["loss"] == whole["loss"]
    a = torch.load(tmp_path / "a" / "train_state.pt", weights_only=False)["head"]
    b = torch.load(tmp_path / "b" / "train_state.pt", weights_only=False)["head"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    head, _ = load_head(str(tmp_path / "a" / "head"), model.cfg)
    assert head.cfg.draft_vocab_size == 128 and torch.equal(head.draft_to_target, d2t)


def test_select_puts_generated_answers_first_and_caps_tokens():
    seqs = [[1] * 10, [2] * 10, [3] * 5, [4] * 5]  # the last 2 are generated answers
    assert select(seqs, 2, 0) == [[3] * 5, [4] * 5, [1] * 10, [2] * 10]
    assert select(seqs, 2, 12) == [[3] * 5, [4] * 5, [1] * 10]
