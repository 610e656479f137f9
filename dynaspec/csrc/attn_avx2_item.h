// One work item of the attention.avx2 path (paged_decode.cpp), in the phases every item has
// (attn_item.h): the queries scaled to fp32, pass 1 (scores from the cached keys, converted as
// they are loaded), the softmax of each row, pass 2 (the value sums straight from the cache) and
// the output. The pieces are attn_avx2.h's, and the passes' lambdas carry their target too (an
// untargeted lambda could not inline them); every row runs the same operations whatever the
// item's other rows.
#pragma once

#include <torch/extension.h>

#include "attn_avx2.h"
#include "attn_call.h"
#include "attn_item.h"
#include "attn_rows.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

// Pass 1: every row's scores for keys 0..Ct, 16 keys at a time (keys past a row's position get
// probability 0 in its softmax).
template <typename T>
AVX2_TARGET void avx2_scores(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s,
                             ItemBlocks<T>& blocks) {
  static_assert(AVX2_KEYS == KEY_LANES, "every path scores 16 keys at a time");
  const int64_t rs = c.Hkv * c.D;
  blocks.template key_groups<AVX2_KEYS>([&](int64_t k0, const T* keys, int64_t n) AVX2_TARGET {
    keys_to_lanes(keys, rs, n, c.D, s.kt.data());
    scores_rows_avx2(s.qf.data(), it.R, c.D, s.kt.data(), s.sf.data() + k0, it.Ct, n);
  });
}

// Each row's softmax over its visible keys (a tree row: the prompt's and its ancestors').
template <typename T>
AVX2_TARGET void avx2_softmax(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s) {
  softmax_rows(c, it, s, softmax_row_avx2, softmax_row_tree_avx2);
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
AVX2_TARGET void avx2_values(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s,
                             ItemBlocks<T>& blocks) {
  const int64_t D = c.D, rs = c.Hkv * D;
  auto sum = [&](int64_t blk, int64_t k0, int64_t n) AVX2_TARGET {
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
  };
  blocks.value_spans(std::integral_constant<int64_t, 1>{}, [](int64_t, int64_t) {}, sum);
}

// One item: its rows' queries, scores, softmax, value sums and outputs. ahead: the request whose KV
// to bring into L2 meanwhile (-1: none).
struct Avx2Item {
  template <typename T>
  static void run(const AttnCall<T>& c, const AttnItem& it, int64_t ahead, AttnScratch& s) {
    begin_item(c, it, s);
    s.kt.resize(AVX2_KEYS * c.D);
    scale_queries(c, it, s);
    ItemBlocks<T> blocks(c, it, ahead);
    avx2_scores(c, it, s, blocks);
    avx2_softmax(c, it, s);
    avx2_values(c, it, s, blocks);
    store_rows(c, it, s);
  }
};

}  // namespace
