"""Random sampling with speculation keeps the target's distribution (chi-square over many seeds)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from scipy.stats import chi2_contingency

from dynaspec import LLM, SamplingParams
from tests.cost_tables import FREE_VERIFY

VOCAB = 8
SEEDS = 600


def _tiny_vocab_model(path: str, seed: int) -> str:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=7)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # sharpen a little so the distribution is not uniform
        model.model.embed_tokens.weight.mul_(2.0)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(VOCAB)}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "t7"}, f)
    return path


@pytest.fixture(scope="module")
def tiny_vocab_models(tmp_path_factory):
    return (_tiny_vocab_model(str(tmp_path_factory.mktemp("tv_target")), 0),
            _tiny_vocab_model(str(tmp_path_factory.mktemp("tv_draft")), 1))


def _first_tokens(llm: LLM, n: int) -> list[tuple[int, ...]]:
    prompts = [[1, 2, 3, 4, 1, 2]] * SEEDS
    params = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=n, ignore_eos=True, seed=s)
              for s in range(SEEDS)]
    return [tuple(o.token_ids) for o in llm.generate(prompts, params)]


def _assert_same_distribution(a: list[int], b: list[int], label: str) -> None:
    cats = sorted(set(a) | set(b))
    table = [[a.count(c) for c in cats], [b.count(c) for c in cats]]
    keep = [i for i in range(len(cats)) if table[0][i] + table[1][i] >= 5]
    table = [[row[i] for i in keep] for row in table]
    p = chi2_contingency(table).pvalue
    print(f"{label}: chi-square p = {p:.3f}")
    assert p > 0.01, f"{label}: sampled distribution differs (p={p:.4f}): {table}"


@pytest.mark.parametrize("speculator", ["draft", "ngram"])
def test_sampled_distribution_matches_without_speculation(tiny_vocab_models, speculator):
    target, draft = tiny_vocab_models
    base = LLM(model=target, dtype="float32", num_kv_blocks=2048, max_num_seqs=256)
    kw = {"draft_model": draft} if speculator == "draft" else {"prompt_lookup_min": 1}
    spec = LLM(model=target, dtype="float32", num_kv_blocks=2048, max_num_seqs=256,
               speculator=speculator, num_spec_tokens=3, cost_table=FREE_VERIFY, **kw)  # drafts
    ref, got = _first_tokens(base, 4), _first_tokens(spec, 4)
    assert spec.engine.counters.num_draft_tokens > 0
    rate = spec.engine.counters.acceptance_rate
    assert 0.0 < rate < 1.0, f"need both accepted and rejected drafts, got rate {rate}"
    for pos in range(4):
        _assert_same_distribution(
            [r[pos] for r in ref], [g[pos] for g in got], f"{speculator} pos {pos}"
        )
