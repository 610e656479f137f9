"""Top-1 agreement with the fp32 dequantized reference over ~2,000 teacher-forced positions.

Arms: dynaspec int8dot (default; all logits, and with every row flagged argmax-only as greedy
serving flags it), dynaspec torch int4 (wave 2), llama-cpp-python on the same GGUF (where
installed). Text: the code_edit and chat workloads' prompts, concatenated, cut into 512-token
windows.
Run: python scripts/experiments/accuracy_check.py [positions]
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from dynaspec.attention.backend import AttentionBatch
from dynaspec.bench.workloads import load_workload
from dynaspec.models.default_model import default_model_path
from dynaspec.models.llama import LlamaModel
from dynaspec.models.loader import load_model_files
from dynaspec.models.quant_linear import WeightPlan

CPU, WIN = torch.device("cpu"), 512


def logits(model: LlamaModel, ids: list[int], argmax_only: bool = False) -> torch.Tensor:
    """argmax_only: every row flagged as greedy serving flags it (only its argmax is read)."""
    T = len(ids)
    kv = model.allocate_kv(T + 16)
    md = model.attn.build_metadata(AttentionBatch([T], [T], [list(range((T + 15) // 16))], 16, CPU))
    flags = torch.ones(T, dtype=torch.bool) if argmax_only else None
    return model.forward(torch.tensor(ids), torch.arange(T), kv, md, torch.arange(T),
                         argmax_rows=flags).float()


def main() -> None:
    positions = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    torch.set_num_threads(2)
    path = default_model_path()
    loaded = load_model_files(path, keep_quantized=True)
    tok = loaded.tokenizer
    ids: list[int] = []
    for wl in ("code_edit", "chat", "summarize", "agentic"):
        for item in load_workload(wl, tok, 64, 0):
            ids.extend(item.prompt_ids)
    windows = [ids[i: i + WIN] for i in range(0, min(len(ids), positions + WIN), WIN)]
    windows = [w for w in windows if len(w) > 8]
    from dynaspec.attention.cpu_paged import CpuPagedBackend

    a = loaded.arch
    ref = LlamaModel(
        a, loaded.state_dict, torch.float32, CPU, 1024, WeightPlan("none", 0, torch.float32, CPU)
    )
    arms = {
        k: LlamaModel(
            a,
            loaded.state_dict,
            torch.bfloat16,
            CPU,
            1024,
            WeightPlan("auto", 0, torch.bfloat16, CPU, kernel=k),
        )
        for k in ("int8dot", "torch")
    }
    for m in arms.values():
        m.attn = CpuPagedBackend()
    try:
        import llama_cpp

        llm = llama_cpp.Llama(
            model_path=path, n_ctx=WIN + 16, n_threads=2, logits_all=True, verbose=False
        )
    except ImportError:  # the peer arm needs llama-cpp-python; the others still run
        llm = None
    agree = {k: 0 for k in (*arms, "int8dot greedy rows", *(("llama.cpp",) if llm else ()))}
    total = 0
    for w in windows:
        if total >= positions:
            break
        r = logits(ref, w).argmax(-1)
        for k, m in arms.items():
            agree[k] += int((logits(m, w).argmax(-1) == r).sum())
        greedy = logits(arms["int8dot"], w, True).argmax(-1)
        agree["int8dot greedy rows"] += int((greedy == r).sum())
        total += len(w)
        if llm is None:
            continue
        llm.reset()
        llm.eval(w)
        theirs = torch.tensor(np.array(llm.scores[: len(w)]), dtype=torch.float32)
        agree["llama.cpp"] += int((theirs.argmax(-1) == r).sum())
    print(f"top-1 agreement with the fp32 dequantized reference over {total} positions:")
    for k, v in agree.items():
        print(f"  {k}: {v / total:.4f}")


if __name__ == "__main__":
    main()
