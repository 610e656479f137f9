"""Our Llama-family forward over paged KV matches transformers' logits on tiny random
checkpoints."""

from __future__ import annotations

import pytest
import torch

from dynaspec.attention.paged import build_metadata
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_model_files

CHECKPOINTS = ["tiny_llama_dir", "tiny_llama3_rope_dir", "tiny_llama_untied_dir", "tiny_qwen2_dir",
               "tiny_qwen3_dir", "tiny_llama_sharded_dir"]


def _ours(path: str) -> LlamaModel:
    loaded = load_model_files(path)
    return LlamaModel(loaded.arch, loaded.state_dict, torch.float32, torch.device("cpu"), 256)


def _hf_logits(path: str, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids[None]).logits[0]  # [T, vocab]


@pytest.mark.parametrize("fixture", CHECKPOINTS)
def test_logits_match_transformers_prefill_chunks_and_batched_decode(fixture, request):
    path = request.getfixturevalue(fixture)
    ours = _ours(path)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, ours.cfg.vocab_size, (2, 100), generator=g)
    kv = ours.allocate_kv(16 * 16)
    tables = [list(range(0, 8)), list(range(8, 16))]
    got = [[], []]
    # Request 0: chunks of 37 and 40 (long path); request 1: a 77-token prefill.
    for q0, q1, c0, c1 in [(37, 77, 37, 77), (40, 0, 77, 77)]:
        qs, cs, tb, toks, pos = [], [], [], [], []
        for r, (q, c) in enumerate([(q0, c0), (q1, c1)]):
            if q:
                qs.append(q), cs.append(c), tb.append(tables[r])
                toks.append(ids[r, c - q:c]), pos.append(torch.arange(c - q, c))
        md = build_metadata(qs, cs, tb, 16, torch.device("cpu"))
        t = torch.cat(toks)
        logits = ours.forward(t, torch.cat(pos), kv, md, torch.arange(len(t)))
        off = 0
        for r, q in enumerate([q0, q1]):
            if q:
                got[r].append(logits[off:off + q])
                off += q
    # Then a mixed short batch: request 0 verifies 5 tokens, request 1 decodes 1 (padded SDPA).
    md = build_metadata([5, 1], [82, 78], tables, 16, torch.device("cpu"))
    t = torch.cat([ids[0, 77:82], ids[1, 77:78]])
    pos = torch.cat([torch.arange(77, 82), torch.arange(77, 78)])
    logits = ours.forward(t, pos, kv, md, torch.arange(6))
    got[0].append(logits[:5])
    got[1].append(logits[5:])
    ref0 = _hf_logits(path, ids[0, :82])
    ref1 = _hf_logits(path, ids[1, :78])
    torch.testing.assert_close(torch.cat(got[0]), ref0, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(got[1]), ref1, atol=2e-5, rtol=1e-4)
