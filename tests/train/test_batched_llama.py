"""The batched generator the head's data is made with equals the engine's model: greedy answers
token for token and the captured streams, in float32 on a tiny random Llama."""

from __future__ import annotations

import torch

from dynaspec import LLM
from dynaspec.models.loader import load_model_files
from dynaspec.train.batched_llama import BatchedLlama
from dynaspec.train.draft_head import target_pass
from tests.e2e.conftest import greedy, random_prompts


def _model(path: str) -> BatchedLlama:
    loaded = load_model_files(path)
    return BatchedLlama(loaded.arch, loaded.state_dict, "cpu", torch.float32)


def test_batched_greedy_equals_the_engine(tiny_llama_dir):
    prompts = random_prompts(5, 280, seed=11, lo=3, hi=30)  # mixed lengths: left padding
    ref = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128).generate(
        prompts, greedy(12, ignore_eos=True))
    got = _model(tiny_llama_dir).generate(prompts, 12, eos_ids=())
    assert got == [list(o.token_ids) for o in ref]


def test_generation_stops_each_row_at_its_first_eos(tiny_llama_dir):
    m = _model(tiny_llama_dir)
    prompts = random_prompts(4, 280, seed=12, lo=4, hi=20)
    free = m.generate(prompts, 10, eos_ids=())
    eos = free[0][3]  # a token row 0 emits at its 4th step
    got = m.generate(prompts, 10, eos_ids=(eos,))
    for g, f in zip(got, free):
        cut = f.index(eos) + 1 if eos in f else len(f)
        assert g == f[:cut]
    assert got[0] == free[0][: free[0].index(eos) + 1] and len(got[0]) <= 4


def test_teacher_forced_features_equal_the_engines_capture(tiny_llama_dir):
    seqs = random_prompts(3, 280, seed=13, lo=5, hi=25)
    llm = LLM(model=tiny_llama_dir, dtype="float32", num_kv_blocks=128)
    model = llm.engine.parts.model
    aux = (0, 1, 1)
    model.aux_layers = aux
    ref = target_pass(model, seqs, dtype=torch.float32)
    model.aux_layers = ()
    T = max(len(s) for s in seqs)
    ids = torch.tensor([s + [0] * (T - len(s)) for s in seqs])  # right padding
    f = _model(tiny_llama_dir).features(ids, aux)
    for b, (s, (a, g)) in enumerate(zip(seqs, ref)):
        n = len(s)
        torch.testing.assert_close(f.aux[b, :n], a, rtol=1e-4, atol=1e-4)
        assert torch.equal(f.greedy[b, :n], g)
