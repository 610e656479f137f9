"""Triton kernels behind the GPU paged backend (`dynaspec.attention.gpu_paged`).

`paged_attention` attends every query row straight from the paged cache: one program per
(request, KV head, query tile) walks the request's block table for exactly its context (up to
the tile's last query position), never the table's full width and never a gathered copy. The G
query heads that share a KV head sit in one tile (rows = token x group), so decode (1 token),
verify (1+k, causal inside the span) and prefill chunks run through the same code.

Row invariance (greedy identical with and without speculation, whatever the batch): the tile
sizes are fixed constants, keys are visited in chunks at absolute multiples of BLOCK_N from
position 0 (or the window's first chunk), and a chunk a row cannot see contributes exactly
nothing (p = 0, rescale factor exactly 1). So a row's result does not depend on its tile-mates,
its width, or the other requests in the step. No split over keys: a split would change the
reduction order with the context length of the tile.

`write_kv` stores the step's new K and V at their slots in one launch per layer.

Under TRITON_INTERPRET=1 both run on CPU tensors (slowly): that is how the CPU tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M = 64  # query rows (token x group) per tile: fixed, for row invariance
BLOCK_N = 64  # keys per inner step: fixed, aligned at absolute positions


@triton.jit
def _paged_attn_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, ctx_ptr, qstart_ptr, qlen_ptr,
                       stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh,
                       stride_bt, scale, window,
                       G: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                       BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       PREC: tl.constexpr):
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    tile = tl.program_id(2)
    TOKS: tl.constexpr = BLOCK_M // G  # query tokens per tile
    qlen = tl.load(qlen_ptr + b)
    if tile * TOKS >= qlen:
        return
    ctx = tl.load(ctx_ptr + b)
    qstart = tl.load(qstart_ptr + b)
    m_idx = tl.arange(0, BLOCK_M)
    tok = tile * TOKS + m_idx // G  # token index inside the request's query
    grp = m_idx % G
    row_ok = (m_idx < TOKS * G) & (tok < qlen)
    q_pos = ctx - qlen + tok  # absolute position of each query row
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q_off = (qstart + tok)[:, None] * stride_qt + (hkv * G + grp)[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, BD]

    last = tl.minimum(ctx, ctx - qlen + tl.minimum(tile * TOKS + TOKS, qlen))  # keys seen < last
    # With a window, start at the chunk holding the tile's first visible key (branch-free: one
    # type for `first` whatever the window).
    lo = tl.maximum(ctx - qlen + tile * TOKS - window + 1, 0) // BLOCK_N * BLOCK_N
    first = tl.where(window > 0, lo, 0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    n_range = tl.arange(0, BLOCK_N)
    for n0 in range(first, last, BLOCK_N):
        k_pos = n0 + n_range
        k_ok = k_pos < last
        blk = tl.load(bt_ptr + b * stride_bt + k_pos // BS, mask=k_ok, other=0)
        slot = blk.to(tl.int64) * BS + k_pos % BS
        kv_off = slot[None, :] * stride_ks + hkv * stride_kh + d[:, None]  # [BD, N]
        kt = tl.load(k_ptr + kv_off, mask=k_ok[None, :] & d_ok[:, None], other=0.0)
        s = tl.dot(q, kt, input_precision=PREC) * scale  # [M, N] fp32
        see = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        see = see & ((k_pos[None, :] > q_pos[:, None] - window) | (window <= 0))
        s = tl.where(see, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = tl.load(v_ptr + tl.trans(kv_off), mask=k_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    o_off = (qstart + tok)[:, None] * stride_ot + (hkv * G + grp)[:, None] * stride_oh + d[None, :]
    tl.store(out_ptr + o_off, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_vt, stride_c0,
                     HD: tl.constexpr, BLOCK: tl.constexpr, HEAD_D: tl.constexpr,
                     stride_kh, stride_vh):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    ok = i < HD
    h, dd = i // HEAD_D, i % HEAD_D
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + dd, mask=ok)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + dd, mask=ok)
    tl.store(cache_ptr + slot * HD + i, k, mask=ok)
    tl.store(cache_ptr + stride_c0 + slot * HD + i, v, mask=ok)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, S, Hkv, D] contiguous; k, v: [T, Hkv, D] (last dim contiguous);
    slot_mapping: [T]. One launch writes both."""
    T, Hkv, D = k.shape
    if T == 0:
        return
    HD = Hkv * D
    _write_kv_kernel[(T,)](k, v, kv_cache, slot_mapping, k.stride(0), v.stride(0),
                           kv_cache.stride(0), HD, triton.next_power_of_2(HD), D,
                           k.stride(1), v.stride(1))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, out: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor,
                    query_start: torch.Tensor, query_lens: torch.Tensor, max_query_len: int,
                    block_size: int, scale: float, window: int | None = None) -> None:
    """q, out: [T, H, D] (last dim contiguous); kv_cache: [2, S, Hkv, D]; block_tables: [B, NB];
    context_lens, query_start, query_lens: [B] (tokens in KV after the write, first flat token,
    query tokens). max_query_len: a host int bounding query_lens (the grid's third axis)."""
    B = block_tables.shape[0]
    if B == 0:
        return
    H, D = q.shape[1], q.shape[2]
    Hkv = kv_cache.shape[2]
    G = H // Hkv
    if G > BLOCK_M:
        raise ValueError(f"{G} query heads per KV head: the kernel's tile holds {BLOCK_M}")
    toks = BLOCK_M // G
    tiles = max(1, -(-max_query_len // toks))
    prec = "ieee" if q.dtype == torch.float32 else "tf32"
    kc, vc = kv_cache[0], kv_cache[1]
    _paged_attn_kernel[(B, Hkv, tiles)](
        q, kc, vc, out, block_tables, context_lens, query_start, query_lens,
        q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0), scale, window or 0,
        G, D, max(16, triton.next_power_of_2(D)), block_size, BLOCK_M, BLOCK_N, prec,
    )
