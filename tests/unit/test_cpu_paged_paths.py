"""Every attention path this CPU has against the kernel's plain-loop reference (path "scalar"
reproducing that path's numerics: `numerics_of`), and the reference against PyTorch SDPA on the
paged cache (the eager backend) as the semantic check.

Bit for bit: fp32 (the reference's own numerics), avx2 and avx512 (fused value sums) and the bf16
dot-product scores of avx512_bf16. Within a stated bound: avx512_bf16's bf16 probabilities (bf16
KV at D = 64 / 128, even block size, trees included), whose polynomial exp, bf16 rounding, pair
order and lane tree the reference does not reproduce (PAIRS_BOUND). A path this CPU or build
lacks runs emulated (tests/kernel_modes.py); forcing it natively is PathUnavailable."""

from __future__ import annotations

import contextlib

import pytest
import torch

from dynaspec import cpu_features as cf
from dynaspec import cpu_kernels
from dynaspec.attention import cpu_paged
from dynaspec.attention.backend import AttentionBatch, get_backend
from dynaspec.draft_tree import DraftTree
from dynaspec.worker.tree_step import visibility

from .. import kernel_modes
from .test_cpu_paged_attention import _case

ok, why = cpu_paged.available()
pytestmark = pytest.mark.skipif(not ok, reason=f"no C++ toolchain for the kernel: {why}")

VECTOR_PATHS = [p for p in cpu_paged.PATHS if p != "scalar"]
# Each natively where this CPU has its flags, emulated wherever it needs any (tests/kernel_modes.py)
PATH_MODES = kernel_modes.cases("attention", VECTOR_PATHS)
TREE = DraftTree((40, 41, 42, 43, 50, 51, 60), (-1, 0, 0, 2, -1, 4, -1))

# (query_lens, ctx, hkv, g_heads, d, block size, window, tree rows)
CASES = {
    "decodes": ([1, 1, 1], [5, 17, 33], 2, 3, 64, 16, None, False),
    "verifies_d128": ([3, 9, 1], [3, 40, 21], 2, 3, 128, 16, None, False),
    "prefill_tiles": ([40, 2], [61, 7], 2, 3, 64, 16, None, False),  # 40 rows: two tiles
    "prefill_d32": ([20, 2], [29, 7], 2, 3, 32, 16, None, False),  # no value pairs
    "odd_blocks": ([5, 1], [23, 9], 1, 4, 64, 5, None, False),  # odd block size: no pairs
    "d80": ([4, 1], [30, 11], 2, 2, 80, 16, None, False),  # D with no vector value sums
    "d256": ([2, 1], [19, 40], 1, 2, 256, 16, None, False),  # value sums in 16 registers
    "window": ([12, 1], [30, 25], 2, 2, 64, 16, 8, False),  # (the SDPA check: test_cpu_paged)
    "tree": ([8, 1], [30, 17], 2, 3, 64, 16, None, True),
    "tree_window": ([8, 1], [30, 17], 2, 3, 64, 16, 4, True),  # windows in chain positions
}


def _missing(path: str) -> list[str]:
    sel = cpu_kernels.selection()
    return cf.missing(cf.path("attention", path), sel.flags, sel.build.flags)


def _attend(case: str, dtype, backend=None, **kw):
    q_lens, ctx, hkv, g, d, bs, window, tree = CASES[case]
    tables, q, k, v, cache = _case(q_lens, ctx, hkv, g, d, dtype, seed=len(case) + d, bs=bs)
    masks = [visibility(1, TREE), None] if tree else None
    batch = AttentionBatch(q_lens, ctx, tables, bs, torch.device("cpu"), tree_masks=masks)
    backend = backend or get_backend("cpu_paged")
    out = backend.forward(q, k, v, cache, backend.build_metadata(batch), d ** -0.5, window, **kw)
    return out, cache


def _bf16_probabilities(path: str, case: str, dtype) -> bool:
    """Whether `path` takes avx512_bf16's bf16-probability value sums here (attn_pairs.h)."""
    _, _, _, _, d, bs, _, _ = CASES[case]
    return path == "avx512_bf16" and dtype == torch.bfloat16 and d in (64, 128) and bs % 2 == 0


# |got - ref| <= 2^-8 (max |V| + |ref|): each probability is off by at most its bf16 rounding
# (2^-9 relative) plus the exp polynomial's 2.5e-6, so the sum by 2^-9 max |V|; the two outputs
# then round to bf16 apart by at most one bf16 step of |ref| (2^-8 relative).
PAIRS_BOUND = 2.0 ** -8


@pytest.mark.parametrize("path,mode", PATH_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", list(CASES))
def test_every_path_equals_the_reference(path, mode, dtype, case):
    got, cache, ref = kernel_modes.run("attention", path, mode, lambda: (
        *_attend(case, dtype, path=path), _attend(case, dtype, path="scalar", numerics_of=path)[0]))
    if not _bf16_probabilities(path, case, dtype):
        assert torch.equal(got, ref), f"{path} differs from the reference's bits"
        return
    vmax = cache[1].float().abs().max()
    err = (got.float() - ref.float()).abs()
    assert (err <= PAIRS_BOUND * (vmax + ref.float().abs())).all(), err.max()


@pytest.mark.parametrize("numerics_of", cpu_paged.PATHS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("case", [c for c in CASES if "window" not in c])
def test_the_reference_matches_sdpa_on_the_paged_cache(numerics_of, dtype, tol, case):
    """The reference with any path's numerics (it needs none of that path's CPU flags, so every
    emulation runs on every CPU) against the eager backend's SDPA over the same paged cache."""
    want, _ = _attend(case, dtype, backend=get_backend("eager"))
    got, _ = _attend(case, dtype, path="scalar", numerics_of=numerics_of)
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_the_selected_path_is_the_default():
    chosen = cpu_kernels.selection().chosen["attention"]
    assert chosen != "scalar"  # the reference is never preferred
    default, _ = _attend("verifies_d128", torch.bfloat16)
    forced, _ = _attend("verifies_d128", torch.bfloat16, path=chosen)
    assert torch.equal(default, forced)
    assert f"attention.{chosen}" in cpu_kernels.extension().cpu_paths()


AVX2_ONLY = frozenset("avx avx2 fma f16c".split())


def test_a_forced_path_the_cpu_lacks_is_path_unavailable_naming_its_flags(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "selection", lambda: cf.select(AVX2_ONLY))
    with pytest.raises(cf.PathUnavailable, match="'avx512_bf16' needs CPU flags avx512_bf16, "):
        _attend("decodes", torch.bfloat16, path="avx512_bf16")
    with pytest.raises(cf.PathUnavailable, match="'avx512' needs CPU flags avx512bw"):
        _attend("decodes", torch.float32, path="avx512")
    monkeypatch.setattr(cpu_kernels, "selection", lambda: cf.select(frozenset()))  # no AVX2
    with pytest.raises(cf.PathUnavailable, match="'avx2' needs CPU flags avx2, f16c, fma"):
        _attend("decodes", torch.bfloat16, path="avx2")
    with pytest.raises(ValueError, match="attention has no path 'amx'"):
        _attend("decodes", torch.float32, path="amx")
    with pytest.raises(ValueError, match="numerics_of='fp32' is for the scalar reference"):
        _attend("decodes", torch.float32, path="fp32", numerics_of="fp32")


@pytest.mark.parametrize("path", VECTOR_PATHS)
def test_the_kernel_itself_refuses_a_path_it_was_not_allowed(path):
    """Past Python's check: a path this CPU has is withheld (as on a CPU without it); either way
    the kernel refuses it rather than running it."""
    name = f"attention.{path}"
    withheld = (cpu_kernels.paths_without(name) if not _missing(path)
                else contextlib.nullcontext())
    q_lens, ctx, hkv, g, d, bs, _, _ = CASES["decodes"]
    tables, q, _, _, cache = _case(q_lens, ctx, hkv, g, d, torch.float32, seed=1, bs=bs)
    nb = max(len(t) for t in tables)
    meta = (torch.tensor([t + [0] * (nb - len(t)) for t in tables]), torch.tensor(ctx),
            torch.tensor([0, 1, 2]), torch.tensor(q_lens))
    with withheld as mod, pytest.raises(RuntimeError, match=f"path {path} is not one this CPU"):
        (mod or cpu_kernels.extension()).paged_decode(
            q, cache, *meta, bs, 0.125, torch.empty_like(q), path=cpu_paged.PATHS.index(path))


@pytest.mark.parametrize("path,mode", PATH_MODES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_path_gives_a_row_the_same_bits_whatever_its_step(path, mode, dtype):
    """Row invariance per path: a token's row in a prefill chunk beside another request equals
    the same row verified in a step of 1, 5 or 9 rows (greedy speculation equals plain decoding
    only if it does). 40 keys: full and partial key groups, rows in fours and alone."""
    C, bs = 40, 16
    tables, q, k, v, cache = _case([C, 2], [C, 9], 3, 3, 64, dtype, seed=5, bs=bs)

    def run(rows, c, q_lens, ctx, tabs):
        backend = get_backend("cpu_paged")  # the serving module's kernel (native or emulated)
        batch = AttentionBatch(q_lens, ctx, tabs, bs, torch.device("cpu"))
        return backend.forward(q[rows], k[rows], v[rows], c, backend.build_metadata(batch),
                               0.125, path=path)

    def steps():  # the whole prefill's rows, then each (width, end) verify step's
        full = run(slice(0, C + 2), cache.clone(), [C, 2], [C, 9], tables)[:C]
        out = []
        for width in (1, 5, 9):
            for end in range(width, C + 1, 6):
                c = cache.clone()
                run(slice(0, C), c, [C], [C], tables[:1])  # the prompt's KV
                out.append(run(slice(end - width, end), c, [width], [end], tables[:1]))
        return full, out

    full, got = kernel_modes.run("attention", path, mode, steps)
    at = iter(got)
    for width in (1, 5, 9):
        for end in range(width, C + 1, 6):
            assert torch.equal(next(at), full[end - width: end]), (width, end)
