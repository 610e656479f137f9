"""int8 GEMM at two or more commits, on the default model's own packed matrices (eighth session).

    python scripts/experiments/gemm_commits_ab.py 1,5,9,16,64 76582c1 HEAD

Each commit's `dynaspec/csrc/int8_gemm.cpp` (and the headers it includes) is JIT-built under its
own name; the arms alternate over 7 rounds. Per row count M it prints:
- body: ms for all 121 matrices of the model in order (weights stream from memory, as in a step);
- gu: GMAC/s of the 3072x576 gate|up matrix called alone (its 1 MB stays in cache: compute only);
and first checks that every arm's outputs are bit-identical on the first five matrices.
"""

import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
from torch.utils.cpp_extension import load

from dynaspec import LLM
from dynaspec import cpu_kernels as ck
from dynaspec.models.int8_dot import Int8DotLinear

BIND = """#include <torch/extension.h>
#include <pybind11/stl.h>
#if __has_include("cpu_paths.h")  // since issue 47 Python tells the kernels their paths
#include "cpu_paths.h"
#define PATHS_FROM_PYTHON 1
#endif
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                        c10::optional<torch::Tensor> mn, int64_t N, int64_t G, int64_t bits,
                        int64_t isa);
// int8_gemm_silu composes with fused_ops.cpp's silu_mul where it does not fuse; not timed here.
torch::Tensor silu_mul(torch::Tensor) { TORCH_CHECK(false, "silu_mul is not in this A/B build"); }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm);
#ifdef PATHS_FROM_PYTHON
  m.def("set_cpu_paths", &set_cpu_paths);
#endif
}
"""


def build(commit: str):
    """The int8_gemm op of `commit`, JIT-built from its sources."""
    root = subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip()
    d = tempfile.mkdtemp(prefix=f"gemm_{commit}_")
    for name in ("int8_gemm.cpp", *ck.HEADERS):
        show = subprocess.run(["git", "show", f"{commit}:dynaspec/csrc/{name}"], cwd=root,
                              capture_output=True)
        if show.returncode == 0:  # a header the commit did not have yet is simply absent
            with open(os.path.join(d, name), "wb") as f:
                f.write(show.stdout)
    with open(os.path.join(d, "bind.cpp"), "w") as f:
        f.write(BIND)
    tag, _ = ck.isa_flags()
    safe = "".join(c if c.isalnum() else "_" for c in commit)
    mod = load(name=f"gemm_ab_{safe}", sources=[f"{d}/bind.cpp", f"{d}/int8_gemm.cpp"],
               extra_cflags=ck.compile_flags(tag), extra_ldflags=["-fopenmp"])
    if hasattr(mod, "set_cpu_paths"):  # else it would run the scalar reference
        sel = ck.selection()
        # the GEMM alone: attention paths newer than the commit would be names it does not know
        allowed = [a for a in sel.allowed() if not a.startswith("attention.")]
        mod.set_cpu_paths([*allowed, "attention.scalar"], sel.chosen["int8_gemm"])
    return mod.int8_gemm


def main() -> None:
    ms = [int(a) for a in sys.argv[1].split(",")]
    ops = {c: build(c) for c in sys.argv[2:]}
    llm = LLM(model="default")
    lins = [m for m in llm.engine.parts.model.modules() if isinstance(m, Int8DotLinear)]
    args = [(m.packed, m.scales, m.mins, m.out_features, m.group_size, m.bits, m.in_features)
            for m in lins]
    torch.manual_seed(0)
    for m in ms:
        for a in args[:5]:
            x = torch.randn(m, a[6]).bfloat16()
            outs = [op(x, *a[:6], -1) for op in ops.values()]
            assert all(torch.equal(outs[0], o) for o in outs), f"outputs differ at M={m}"
    print("bit-identical across arms", flush=True)
    gu = next(a for a in args if a[3] == 3072)
    for m in ms:
        xs = {k: torch.randn(m, k).bfloat16() for k in {a[6] for a in args}}
        body = {c: [] for c in ops}
        cached = {c: [] for c in ops}
        for _ in range(7):
            for c, op in ops.items():
                ts = []
                for _ in range(15):
                    t = time.perf_counter()
                    for a in args:
                        op(xs[a[6]], *a[:6], -1)
                    ts.append(time.perf_counter() - t)
                body[c].append(statistics.median(ts))
                ts = []
                for _ in range(100):
                    t = time.perf_counter()
                    op(xs[576], *gu[:6], -1)
                    ts.append(time.perf_counter() - t)
                cached[c].append(statistics.median(ts))
        cols = [f"{c}: body {statistics.median(body[c]) * 1e3:.3f} ms, gu "
                f"{m * 3072 * 576 / statistics.median(cached[c]) / 1e9:.0f} GMAC/s" for c in ops]
        print(f"M={m}: " + " | ".join(cols), flush=True)


if __name__ == "__main__":
    main()
