"""The default model (SmolLM2-135M-Instruct GGUF) end to end against transformers, and with
speculation."""

from __future__ import annotations

import os

import pytest
import torch

from dynaspec import LLM, SamplingParams
from tests.cost_tables import FREE_VERIFY
from tests.e2e.conftest import assert_greedy_equal

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
]
N = 20


@pytest.fixture(scope="module")
def ours_fp32():
    return LLM(model="default", dtype="float32", num_kv_blocks=256)


def test_greedy_tokens_match_transformers_on_the_same_gguf(default_gguf_path, ours_fp32):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(default_gguf_path),
                                              gguf_file=os.path.basename(default_gguf_path),
                                              dtype=torch.float32).eval()
    tok = ours_fp32.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(prompt)
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=N, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
        got = ours_fp32.generate([ids], SamplingParams(temperature=0, max_tokens=N,
                                                       ignore_eos=True))[0].token_ids
        assert_greedy_equal("default", ids, ref, got, f"transformers vs ours: {prompt[:20]!r}")


CODE = (
    "Repeat this function exactly:\n\ndef merge(a, b):\n    out = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i])\n"
    "            i += 1\n        else:\n            out.append(b[j])\n            j += 1\n"
    "    out.extend(a[i:])\n    out.extend(b[j:])\n    return out\n"
)


def test_ngram_speculation_is_lossless_on_the_default_model_fp32(ours_fp32):
    prompts = [CODE, PROMPTS[2]]
    params = SamplingParams(temperature=0, max_tokens=48)
    ref = [o.token_ids for o in ours_fp32.generate(prompts, params)]
    spec = LLM(model="default", dtype="float32", num_kv_blocks=256, speculator="ngram",
               num_spec_tokens=5, cost_table=FREE_VERIFY)  # the default policy, deterministic
    got = spec.generate(prompts, params)
    for p, r, o in zip(prompts, ref, got):
        assert_greedy_equal("default", spec.tokenizer.encode(p), r, o.token_ids, "ngram fp32")
    c = spec.engine.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_tokens > 0, (
        "drafts must be verified and accepted"
    )
    assert c.check_identities() == []
