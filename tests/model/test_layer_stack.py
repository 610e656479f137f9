"""The C++ layer stack runs the same kernels in the same order as the Python layer loop."""

from __future__ import annotations

import gguf
import pytest
import torch

from dynaspec import LLM
from dynaspec.models import int8_dot

from ..e2e.conftest import greedy

pytestmark = pytest.mark.skipif(
    int8_dot.kernel_isa() == "unavailable", reason="the C++ kernels are not built"
)


@pytest.fixture(scope="module")
def q41_gguf(tiny_llama_dir, make_tiny_gguf, tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("stack") / "tiny-q4_1.gguf"
    return make_tiny_gguf(tiny_llama_dir, str(out), tensor_type=gguf.GGMLQuantizationType.Q4_1)


def _generate(llm: LLM, prompts) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts, greedy(16, ignore_eos=True))]


def test_stack_is_bit_identical_to_the_python_loop(q41_gguf):
    llm = LLM(
        model=q41_gguf,
        num_kv_blocks=128,
        speculator="ngram",
        num_spec_tokens=3,
        k_policy="table",
        prompt_lookup_min=1,
    )
    model = llm.engine.parts.model
    assert model._stack is not None
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 9], list(range(3, 40)), [11, 12]]
    fast = _generate(llm, prompts)
    # Logits of one mixed step (prefill rows beside decode rows) through both paths.
    from dynaspec.attention.backend import AttentionBatch

    kv = model.allocate_kv(64 * 16)
    md = model.attn.build_metadata(
        AttentionBatch([5, 1], [5, 9], [[0], [1]], 16, torch.device("cpu"))
    )
    ids, pos = torch.tensor([3, 4, 5, 6, 7, 8]), torch.tensor([0, 1, 2, 3, 4, 8])
    rows = torch.arange(6)
    a = model.forward(ids, pos, [k.clone() for k in kv], md, rows)
    stack, model._stack = model._stack, None
    try:
        b = model.forward(ids, pos, [k.clone() for k in kv], md, rows)
        slow = _generate(llm, prompts)
    finally:
        model._stack = stack
    assert torch.equal(a, b)
    assert fast == slow


def test_tree_steps_run_on_the_stack_with_the_loops_bits(q41_gguf):
    # A draft tree's rows (an ancestor mask, positions by depth) beside a causal request: the
    # stack passes the mask to the same attention kernel, so the logits are the loop's bits.
    from dynaspec.attention.backend import AttentionBatch

    llm = LLM(model=q41_gguf, num_kv_blocks=64)
    model = llm.engine.parts.model
    assert model._stack is not None
    kv = model.allocate_kv(64 * 16)
    tree = torch.tensor([[1, 0, 0, 0, 0],  # root, two children, a grandchild of each
                         [1, 1, 0, 0, 0],
                         [1, 0, 1, 0, 0],
                         [1, 1, 0, 1, 0],
                         [1, 0, 1, 0, 1]], dtype=torch.bool)
    md = model.attn.build_metadata(AttentionBatch(
        [5, 1], [12, 9], [[0], [1]], 16, torch.device("cpu"), tree_masks=[tree, None]))
    assert md.tree_mask is not None
    ids = torch.tensor([3, 4, 5, 6, 7, 8])
    pos = torch.tensor([7, 8, 8, 9, 9, 8])  # [T]: the tree's nodes at their depth
    rows = torch.arange(6)
    caches = [k.clone() for k in kv]
    calls = []
    stack = model._stack

    class Counting:  # the stack, counted: the tree step must not fall back to the loop
        def forward(self, *args):
            calls.append(args[-1] is not None)
            return stack.forward(*args)

    model._stack = Counting()
    try:
        a = model.forward(ids, pos, [k.clone() for k in caches], md, rows)
        model._stack = None
        b = model.forward(ids, pos, [k.clone() for k in caches], md, rows)
    finally:
        model._stack = stack
    assert calls == [True]
    assert torch.equal(a, b)
    # The mask matters: causal rows over the same tokens give other logits for the branches.
    md_causal = model.attn.build_metadata(
        AttentionBatch([5, 1], [12, 9], [[0], [1]], 16, torch.device("cpu")))
    c = model.forward(ids, pos, [k.clone() for k in caches], md_causal, rows)
    assert not torch.equal(a[2:5], c[2:5]) and torch.equal(a[:2], c[:2])


def test_models_with_qk_norm_or_bias_keep_the_python_loop(tiny_qwen2_dir):
    llm = LLM(model=tiny_qwen2_dir, num_kv_blocks=64, quantization="int8")
    assert llm.engine.parts.model._stack is None  # qkv bias: not on the stack's path


@pytest.mark.parametrize("rows", [5, 700])  # one thread's rows; a prefill chunk's, both threads
def test_write_kv_puts_each_row_in_its_slot(rows):
    from dynaspec import cpu_kernels

    g = torch.Generator().manual_seed(rows)
    kv = torch.zeros(2, 1024, 3, 8, dtype=torch.bfloat16)
    qkv = torch.randn(rows, 9 * 8, generator=g).bfloat16()  # q | k | v heads, strided rows
    k = qkv[:, 3 * 8: 6 * 8].view(rows, 3, 8)
    v = qkv[:, 6 * 8:].view(rows, 3, 8)
    slots = torch.randperm(1024, generator=g)[:rows]
    cpu_kernels.extension().write_kv(kv, k, v, slots)
    ref = torch.zeros_like(kv)
    ref[0, slots], ref[1, slots] = k, v
    assert torch.equal(kv, ref)
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_kernels.extension().write_kv(kv, k, v, slots + 1024)
