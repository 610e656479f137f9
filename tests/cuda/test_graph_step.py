"""The CUDA-graph step's body (positions and slots from the context lengths, in-place paged
attention, head, argmax) against the eager forward; uncaptured on the CPU under the Triton
interpreter, captured on a GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="triton is not installed (the GPU image has it)")

from dynaspec import LLM  # noqa: E402
from dynaspec.attention.backend import AttentionBatch  # noqa: E402
from dynaspec.sample.rejection_sampler import greedy_from_argmax  # noqa: E402
from dynaspec.worker.compiled import CudaGraphDecode  # noqa: E402

pytestmark = pytest.mark.cuda
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def test_greedy_from_argmax_rule():
    # request 0: 2 drafts, both accepted -> bonus; request 1: pad -1 never accepted;
    # request 2: first draft rejected -> the argmax there
    argmax = [5, 6, 7, 9, 4, 1, 8, 3]
    assert greedy_from_argmax(argmax, [[5, 6], [-1], [2, 8]]) == [[5, 6, 7], [9], [1]]


@pytest.mark.parametrize("width", [1, 3])
def test_graph_step_matches_eager_forward(tiny_llama_dir, width):
    llm = LLM(model=tiny_llama_dir, device=DEV, dtype="float32", num_kv_blocks=64,
              attention_backend="eager")
    runner = llm.engine.runner
    model, kv, bs = runner.model, runner.kv_caches, runner.block_size
    ex = CudaGraphDecode(model, kv, 60.0, capture=DEV == "cuda")
    ctx = [11, 6]  # contexts after this step's write; every row of a request shares width
    tables = [[3, 4, 5], [9, 2]]
    g = torch.Generator().manual_seed(width)
    ids = torch.randint(3, 200, (2 * width,), generator=g).tolist()
    # Fill the prefix KV of both requests through the eager path first.
    for t, c in zip(tables, ctx):
        pre = c - width
        batch = AttentionBatch([pre], [pre], [t], bs, model.device)
        md = model.attn.build_metadata(batch)
        model.forward(torch.randint(3, 200, (pre,), generator=g).to(model.device),
                      torch.arange(pre, device=model.device), kv, md, None)
    saved = [c.clone() for c in kv]
    eager_batch = AttentionBatch([width] * 2, ctx, tables, bs, model.device)
    pos = [p for c in ctx for p in range(c - width, c)]
    ref = model.forward(torch.tensor(ids, device=model.device),
                        torch.tensor(pos, device=model.device), kv,
                        model.attn.build_metadata(eager_batch),
                        torch.arange(2 * width, device=model.device))
    for c, s in zip(kv, saved):
        c.copy_(s)
    B = 4  # padded bucket: two pad rows on the scratch block
    fixed = AttentionBatch([width] * 2, ctx, tables, bs, model.device, B, width,
                           runner.buffers.attn)
    md = ex.backend.build_metadata(fixed)
    buf = runner.buffers.input_ids[: B * width]
    buf[: 2 * width].copy_(torch.tensor(ids))
    logits, top = ex.run(buf, None, md)
    torch.testing.assert_close(logits[: 2 * width], ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(top[: 2 * width], ref.argmax(-1))
    assert torch.isfinite(logits).all()
