"""The default quantized path is row-invariant, so greedy output is token-exact with no near-tie
escape: with and without speculation, alone and batched, chunked or not, repeated.

The int8 dot-product linear kernel and the in-place attention kernel compute every row with a
fixed order of operations whatever the step's width or batch (tests/model/test_int8_dot.py,
tests/unit/test_cpu_paged_attention.py); this checks the whole engine keeps that property.
"""

from __future__ import annotations

import gguf
import pytest

from dynaspec import LLM
from dynaspec.models import int8_dot
from dynaspec.models.int8_dot import Int8DotLinear

from .conftest import greedy, random_prompts

pytestmark = pytest.mark.skipif(
    int8_dot.kernel_isa() == "unavailable", reason="the C++ kernels are not built"
)
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def q41_gguf(tiny_llama_dir, make_tiny_gguf, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("rowinv") / "tiny-q4_1.gguf"
    return make_tiny_gguf(tiny_llama_dir, str(out), tensor_type=gguf.GGMLQuantizationType.Q4_1)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(5, 280, seed=11, lo=4, hi=70, repetitive=True) + random_prompts(
        3, 280, seed=12
    )


def _generate(model: str, prompts, **kw) -> list[list[int]]:
    llm = LLM(model=model, num_kv_blocks=256, **kw)  # default dtype (bf16) and kernels
    m = llm.engine.parts.model
    assert isinstance(m.layers[0].qkv, Int8DotLinear) and m.attn.name == "cpu_paged"
    outs = llm.generate(prompts, greedy(MAX_TOKENS, ignore_eos=True))
    llm.engine.check_integrity()
    return [o.token_ids for o in outs]


def test_greedy_is_token_exact_alone_batched_chunked_and_speculated(q41_gguf, prompts):
    alone = [_generate(q41_gguf, [p])[0] for p in prompts]
    runs = {
        "batched": _generate(q41_gguf, prompts),
        "chunked prefill (16-token budget)": _generate(
            q41_gguf, prompts, max_num_batched_tokens=16
        ),
        "ngram k=4": _generate(
            q41_gguf,
            prompts,
            speculator="ngram",
            num_spec_tokens=4,
            k_policy="table",
            prompt_lookup_min=1,
        ),
        "suffix k=6": _generate(
            q41_gguf, prompts, speculator="suffix", num_spec_tokens=6, k_policy="table"
        ),
        "repeated": _generate(q41_gguf, prompts),
    }
    for label, got in runs.items():
        assert got == alone, label  # exact: no near-tie escape on this path


def test_default_model_greedy_is_token_exact_with_ngram_and_batching(default_gguf_path):
    prompts = [
        "Name two planets with rings.",
        "def fib(n):\n    if n < 2:\n        return n\n    return",
        "List the days of the week: Monday, Tuesday,",
    ]
    llm = LLM(model=default_gguf_path, num_kv_blocks=128)
    ids = [llm.engine.parts.tokenizer.encode(p) for p in prompts]
    alone = [o.token_ids for p in ids for o in llm.generate([p], greedy(24, ignore_eos=True))]
    batched = [o.token_ids for o in llm.generate(ids, greedy(24, ignore_eos=True))]
    spec = LLM(model=default_gguf_path, num_kv_blocks=128, speculator="ngram", num_spec_tokens=4,
               k_policy="table", prompt_lookup_min=1)
    speculated = [o.token_ids for o in spec.generate(ids, greedy(24, ignore_eos=True))]
    assert spec.engine.counters.num_draft_tokens > 0
    assert batched == alone and speculated == alone
