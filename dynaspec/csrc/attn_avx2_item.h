// One work item of the attention.avx2 path (paged_decode.cpp), in phases: the queries scaled to
// fp32, pass 1 (scores from the cached keys, converted as they are loaded), the softmax of each
// row, pass 2 (the value sums straight from the cache) and the output. The pieces are
// attn_avx2.h's; every row runs the same operations whatever the item's other rows.
#pragma once

#include <torch/extension.h>

#include "attn_avx2.h"
#include "attn_call.h"
#include "attn_prefetch.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

namespace {

struct Avx2Scratch {          // one thread's buffers, reused by its items
  std::vector<float> qf;      // [R, D] scaled queries
  std::vector<float> sf;      // [R, Ct] scores, then probabilities
  std::vector<float> accf;    // [R, D] value sums
  std::vector<float> kt;      // [D, 16] a key group in lanes
  std::vector<float> packed;  // a tree row's visible scores
};

// Block blk's rows of the item's request and head in a cache into L2 (a block's work is shorter
// than a memory round trip, so they are asked for AHEAD blocks early).
template <typename T>
inline void prefetch_block(const AttnCall<T>& c, const AttnItem& it, const T* cache, int64_t blk) {
  prefetch_rows(c.head_rows(cache, it.b, it.h, blk), c.Hkv * c.D, it.keys_in(blk, c.block_size),
                c.D);
}

// Pass 1: every row's scores for keys 0..Ct, 16 keys at a time (keys past a row's position get
// probability 0 in its softmax). While the last blocks' keys are scored, pass 2's first values
// are prefetched.
template <typename T>
AVX2_TARGET void avx2_scores(const AttnCall<T>& c, const AttnItem& it, Avx2Scratch& s,
                             NextRequest& pre) {
  const int64_t rs = c.Hkv * c.D;
  for (int64_t blk = 0; blk <= it.last; ++blk) {
    pre.step();
    const int64_t want = blk + AHEAD;
    if (want <= it.last) prefetch_block(c, it, c.kp, want);
    else if (want - it.last - 1 <= it.last) prefetch_block(c, it, c.vp, want - it.last - 1);
    const T* keys = c.head_rows(c.kp, it.b, it.h, blk);
    const int64_t n_blk = it.keys_in(blk, c.block_size);
    for (int64_t t0 = 0; t0 < n_blk; t0 += AVX2_KEYS) {
      const int64_t n = std::min(AVX2_KEYS, n_blk - t0);
      keys_to_lanes(keys + t0 * rs, rs, n, c.D, s.kt.data());
      scores_rows_avx2(s.qf.data(), it.R, c.D, s.kt.data(), s.sf.data() + blk * c.block_size + t0,
                       it.Ct, n);
    }
  }
}

// Each row's softmax over its visible keys (a tree row: the prompt's and its ancestors').
template <typename T>
AVX2_TARGET void avx2_softmax(const AttnCall<T>& c, const AttnItem& it, Avx2Scratch& s) {
  const int64_t step0 = c.cl[it.b] - c.ql[it.b];
  for (int64_t r = 0; r < it.R; ++r) {
    const int64_t pos = it.first + r / c.G;
    float* srow = s.sf.data() + r * it.Ct;
    if (c.tree[it.b])
      softmax_row_tree_avx2(srow, it.Ct, pos, step0, c.tm + (c.qs[it.b] + it.j0 + r / c.G) * c.tmw,
                            c.window, s.packed);
    else softmax_row_avx2(srow, it.Ct, c.first_key(pos), pos);
  }
}

// RB = k rows' value sums over the m keys they all see (pv_rows_avx2 with RB known).
template <typename T>
AVX2_TARGET inline void pv_rows_k(int64_t k, float* acc, int64_t D, const float* p, int64_t ld,
                                  const T* v, int64_t vs, int64_t m) {
  switch (k) {
    case 4: return pv_rows_avx2<4>(acc, D, p, ld, v, vs, m);
    case 3: return pv_rows_avx2<3>(acc, D, p, ld, v, vs, m);
    case 2: return pv_rows_avx2<2>(acc, D, p, ld, v, vs, m);
    default: return pv_rows_avx2<1>(acc, D, p, ld, v, vs, m);
  }
}

// Pass 2: acc(r) += p(r)[t] * v[t] by fma over the keys row r sees, in key order, block by block
// straight from the cache. Four rows at a time share each value load over the keys they all
// see; a row that sees more of the block adds the rest alone after them (still in key order).
template <typename T>
AVX2_TARGET void avx2_values(const AttnCall<T>& c, const AttnItem& it, Avx2Scratch& s,
                             NextRequest& pre) {
  const int64_t D = c.D, rs = c.Hkv * D;
  for (int64_t blk = 0; blk <= it.last; ++blk) {
    pre.step();
    if (blk + AHEAD <= it.last) prefetch_block(c, it, c.vp, blk + AHEAD);
    const int64_t k0 = blk * c.block_size, n = it.keys_in(blk, c.block_size);
    const T* v = c.head_rows(c.vp, it.b, it.h, blk);
    for (int64_t r0 = 0; r0 < it.R; r0 += 4) {
      const int64_t k = std::min<int64_t>(4, it.R - r0);
      int64_t m = n;
      for (int64_t r = r0; r < r0 + k; ++r) m = std::min(m, it.seen(c.G, r, k0, n));
      const float* p = s.sf.data() + r0 * it.Ct + k0;
      if (m > 0) pv_rows_k(k, s.accf.data() + r0 * D, D, p, it.Ct, v, rs, m);
      for (int64_t r = r0; r < r0 + k; ++r) {
        const int64_t seen = it.seen(c.G, r, k0, n);
        if (seen > m)
          pv_rows_avx2<1>(s.accf.data() + r * D, D, s.sf.data() + r * it.Ct + k0 + m, it.Ct,
                          v + m * rs, rs, seen - m);
      }
    }
  }
}

// One item: its rows' queries, scores, softmax, value sums and outputs. ahead: the request whose
// KV to bring into L2 meanwhile (-1: none).
template <typename T>
void run_item_avx2(const AttnCall<T>& c, const AttnItem& it, int64_t ahead, Avx2Scratch& s) {
  const int64_t D = c.D;
  if (static_cast<int64_t>(s.sf.size()) < it.R * it.Ct) s.sf.resize(it.R * it.Ct);
  s.qf.resize(it.R * D);
  s.accf.assign(it.R * D, 0.f);
  s.kt.resize(AVX2_KEYS * D);
  for (int64_t r = 0; r < it.R; ++r) {  // row r: token j0 + r / G, head h * G + r % G
    const T* q = c.qp + (c.qs[it.b] + it.j0 + r / c.G) * c.qstride + (it.h * c.G + r % c.G) * D;
    for (int64_t d = 0; d < D; ++d) s.qf[r * D + d] = static_cast<float>(q[d]) * c.sc;
  }
  // One step() per block of each pass.
  NextRequest pre(c.kp, c.vp, c.tb, c.NB, c.block_size * c.Hkv * D, ahead, c.cl, it.h, c.Hkv,
                  c.block_size, 2 * (it.last + 1));
  avx2_scores(c, it, s, pre);
  avx2_softmax(c, it, s);
  avx2_values(c, it, s, pre);
  for (int64_t r = 0; r < it.R; ++r) {
    T* dst = c.op + ((c.qs[it.b] + it.j0 + r / c.G) * c.H + it.h * c.G + r % c.G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(s.accf[r * D + d]);
  }
}

// One thread's share of the items (attn_schedule.h's next and ahead); tiles: (request, first
// query token, end token), item i is tile i / Hkv with KV head i % Hkv.
template <typename T, typename Next, typename Ahead>
void run_items_avx2(const AttnCall<T>& c, const std::vector<std::array<int64_t, 3>>& tiles,
                    Next&& next, Ahead&& ahead) {
  Avx2Scratch s;
  for (int64_t item = next(); item >= 0; item = next()) {
    const auto [b, j0, j1] = tiles[item / c.Hkv];
    run_item_avx2(c, AttnItem::of(c, b, item % c.Hkv, j0, j1), ahead(item), s);
  }
}

}  // namespace
