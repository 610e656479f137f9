// One work item of the attention.fp32 and attention.avx512 paths (paged_decode.cpp), in the
// phases every item has (attn_item.h): the queries scaled to fp32, pass 1 (the keys converted to
// fp32 and transposed, scores as one fma chain per key), each row's softmax, pass 2 (the value
// sums in key order) and the output. fp32: loops the compiler vectorises for the build's ISA, the
// reference's bits. avx512 (V512, an AVX-512 build): the same, but the value sums by fma in
// registers (the reference's bits with fused value sums). Pass 2 here also serves the
// avx512_bf16 path's rows without bf16 probabilities (attn_bf16_item.h).
#pragma once

#include <torch/extension.h>

#include "attn_call.h"
#include "attn_fp32.h"
#include "attn_item.h"
#include "attn_rows.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

// Pass 1: every row's scores for keys 0..Ct, 16 keys at a time (keys past a row's position get
// probability 0 in its softmax).
template <typename T>
void fp32_scores(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s, ItemBlocks<T>& blocks) {
  const int64_t D = c.D;
  blocks.template key_groups<KEY_LANES>([&](int64_t k0, const T* keys, int64_t n) {
    load_keys(keys, c.Hkv * D, n, s.kf.data(), s.kt.data(), D);
    for (int64_t r = 0; r < it.R; ++r)
      scores16(s.qf.data() + r * D, s.kt.data(), s.sf.data() + r * it.Ct + k0, n, D);
  });
}

// Each row's softmax over its visible keys (a tree row: the prompt's and its ancestors').
template <typename T>
void fp32_softmax(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s) {
  softmax_rows(c, it, s, softmax_row, softmax_row_tree);
}

// Pass 2: acc(r) += p(r)[t] * v[t] over the keys row r sees, in key order (a zero weight adds
// exactly nothing), a span of blocks at a time. Without V512, row by row as plain loops. With it,
// one group of query rows (a decode step's G heads) reads bf16 values straight from the cache,
// widened as they are loaded (the same fp32 values as converting first; the conversion's stores
// and reloads were a fifth of a decode item's instructions); more rows convert V_CHUNK blocks to
// fp32 once and run each group of rows over all of their keys with its sums in registers (per
// block, loading, storing and setting up the groups' sums cost ~a third of the multiply-adds).
// Each row adds its keys in order either way: the same bits.
template <bool V512, typename T>
void fp32_values(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s, ItemBlocks<T>& blocks) {
  const int64_t D = c.D, rs = c.Hkv * D, bs = c.block_size;
  const bool vec_rows = V512 && (D == 64 || D == 128);  // accumulate_v_rows' paths
  const bool direct = std::is_same_v<T, c10::BFloat16> && it.R <= 4 && vec_rows;
  const int64_t span = it.R > 4 && vec_rows ? V_CHUNK : 1;
  if (static_cast<int64_t>(s.vf.size()) < span * bs * D) s.vf.resize(span * bs * D);
  auto convert = [&](int64_t blk, int64_t i) {
    if (direct) return;
    const T* v = c.head_rows(c.vp, it.b, it.h, blk);
    float* dst = s.vf.data() + i * bs * D;
    for (int64_t t = 0; t < it.keys_in(blk, bs); ++t) row_to_float(v + t * rs, dst + t * D, D);
  };
  auto sum = [&](int64_t c0, int64_t k0, int64_t n) {
    auto acc = [&](int64_t r) { return s.accf.data() + r * D; };
    auto seen = [&](int64_t r) { return it.seen(c.G, r, k0, n); };
    auto prob = [&](int64_t r) { return s.sf.data() + r * it.Ct + k0; };
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (direct) {  // span 1: block c0's values in the cache
        accumulate_v_rows(it.R, acc, prob, seen, c.head_rows(c.vp, it.b, it.h, c0), rs, D);
        return;
      }
    }
    if (vec_rows && accumulate_v_rows(it.R, acc, prob, seen, s.vf.data(), D, D)) return;
    for (int64_t r = 0; r < it.R; ++r)
      if (seen(r) > 0) accumulate_v(acc(r), prob(r), s.vf.data(), seen(r), D, V512);
  };
  blocks.value_spans(span, convert, sum);
}

// One item of the fp32 (V512 false) or avx512 (V512 true) path. ahead: the request whose KV to
// bring into L2 meanwhile (-1: none).
template <bool V512>
struct Fp32Item {
  template <typename T>
  static void run(const AttnCall<T>& c, const AttnItem& it, int64_t ahead, AttnScratch& s) {
    begin_item(c, it, s);
    s.kf.resize(KEY_LANES * c.D);
    s.kt.resize(KEY_LANES * c.D);
    scale_queries(c, it, s);
    ItemBlocks<T> blocks(c, it, ahead);
    fp32_scores(c, it, s, blocks);
    fp32_softmax(c, it, s);
    fp32_values<V512>(c, it, s, blocks);
    store_rows(c, it, s);
  }
};

}  // namespace
