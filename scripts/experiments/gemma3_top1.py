"""Run: python scripts/experiments/gemma3_top1.py
(needs llama-cpp-python and the Gemma-3 chunk packages).

Top-1 agreement with the fp32 dequantized reference over 2,000 positions (4 x 500-token texts):
dynaspec's default quantized path vs llama.cpp on the same Gemma-3 GGUF."""
import gc
import os

import llama_cpp
import numpy as np
import torch

from dynaspec import LLM
from dynaspec.attention.backend import AttentionBatch
from dynaspec.models.default_model import gemma3_270m_path

P = gemma3_270m_path()  # assembled from the PyPI chunk packages
N = 500

HERE = os.path.dirname(os.path.abspath(__file__))
text = (
    open(os.path.join(HERE, "..", "README.md")).read()
    + open(os.path.join(HERE, "architecture.md")).read()
)
cpu = torch.device("cpu")

def argmaxes(mode):
    kw = dict(dtype="float32", quantization="none") if mode == "fp32" else {}
    llm = LLM(model=P, num_kv_blocks=64, **kw)
    m, tok = llm.engine.parts.model, llm.tokenizer
    ids = tok.encode(text)
    chunks = [[2] + ids[c * N + 1:(c + 1) * N] for c in range(4)]  # each starts with BOS
    out = []
    for seq in chunks:
        kv = m.allocate_kv(40 * 16)
        md = m.attn.build_metadata(AttentionBatch([N], [N], [list(range(32))], 16, cpu))
        out.append(
            m.forward(torch.tensor(seq), torch.arange(N), kv, md, torch.arange(N)).argmax(-1)
        )
    del llm, m
    gc.collect()
    return chunks, torch.cat(out)

chunks, ref = argmaxes("fp32")
_, auto = argmaxes("auto")
ll = llama_cpp.Llama(
    model_path=P, n_ctx=N + 8, n_batch=N, n_threads=2, verbose=False, logits_all=True
)
lc = []
for seq in chunks:
    ll.reset()
    ll.eval(seq)
    lc.append(torch.tensor(np.array(ll.scores[:N])).argmax(-1))
ll.close()
lc = torch.cat(lc)
print(
    f"top-1 vs fp32 reference over {len(ref)} positions: dynaspec auto "
    f"{float((auto == ref).float().mean()):.4f}, "
    f"llama.cpp {float((lc == ref).float().mean()):.4f}"
)
