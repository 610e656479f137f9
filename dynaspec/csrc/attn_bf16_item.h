// Work items of the attention.avx512_bf16 path for bf16 KV (paged_decode.cpp), in the phases every
// item has (attn_item.h). Pass 1 scores the bf16 queries against the cached bf16 keys as they are
// (attn_rows.h: exact products, fp32 sums; the reference's bits with its vdpbf16ps emulation).
// Then either the fp32 rows' softmax and value sums (Bf16Item: attn_fp32_item.h's pass 2), or,
// at D = 64 / 128 with an even block size in an AVX-512 build, bf16 probabilities (PairsItem:
// attn_pairs.h, FlashAttention's numerics, within a stated bound of the reference): each row's
// exps rounded to bf16 meet the cached values two keys at a time, and the row is scaled by 1 / its
// sum at the end. A pair of keys never straddles a block. A token tree's rows take bf16
// probabilities too, laid out as their root paths verified as chains: a chain and a tree in the
// same step, or a path verified as a tree and as a chain, give the same bits.
#pragma once

#include <torch/extension.h>

#include "attn_call.h"
#include "attn_fp32_item.h"
#include "attn_item.h"
#include "attn_pairs.h"
#include "attn_rows.h"
#include "cpu_paths.h"

#include <algorithm>
#include <cstdint>

namespace {

using Bf16 = c10::BFloat16;

// Rows from which an item's key groups are transposed once for all its rows (scores_rows_bf16)
// rather than each row reducing its own 16 lanes per key group. A prefill tile has 96; a batch-1
// verify item of 9 rows measured 1.03-1.06x slower transposed, one of 27 0.94x.
constexpr int64_t MANY_ROWS = 16;

// The item's buffers, and its query rows' addresses once per item (the divisions cost as much as
// a row's scores for a key group).
inline void begin_bf16_item(const AttnCall<Bf16>& c, const AttnItem& it, AttnScratch& s) {
  begin_item(c, it, s);
  s.kt.resize(KEY_LANES * c.D);
  s.qrows.resize(it.R);
  for (int64_t r = 0; r < it.R; ++r) s.qrows[r] = c.q_row(it, r);
}

// Pass 1: every row's scores for keys 0..Ct, 16 keys at a time, bf16 dot products (keys past a
// row's position get probability 0 in its softmax).
inline void bf16_scores(const AttnCall<Bf16>& c, const AttnItem& it, AttnScratch& s,
                        ItemBlocks<Bf16>& blocks) {
  const int64_t D = c.D, rs = c.Hkv * D;
  auto qrow = [&](int64_t r) { return s.qrows[r]; };
  const bool many = it.R >= MANY_ROWS && (D == 64 || D == 128);
  if (many && static_cast<int64_t>(s.part.size()) < 4 * it.R * KEY_LANES)
    s.part.resize(4 * it.R * KEY_LANES);
  blocks.key_groups<KEY_LANES>([&](int64_t k0, const Bf16* keys, int64_t n) {
    float* s0 = s.sf.data() + k0;
    if (many) {
      transpose_key_pairs(keys, rs, n, s.kt.data(), D);
      if (D == 64) scores_rows_bf16<2>(s.kt.data(), it.R, qrow, s0, it.Ct, n, c.sc, s.part.data());
      else scores_rows_bf16<4>(s.kt.data(), it.R, qrow, s0, it.Ct, n, c.sc, s.part.data());
      return;
    }
    for (int64_t r = 0; r < it.R; ++r) scores_bf16(qrow(r), keys, rs, n, D, c.sc, s0 + r * it.Ct);
  });
}

// One item with bf16 scores and the fp32 rows' softmax and value sums (fused where the build is
// AVX-512's). ahead: the request whose KV to bring into L2 meanwhile (-1: none).
struct Bf16Item {
  static void run(const AttnCall<Bf16>& c, const AttnItem& it, int64_t ahead, AttnScratch& s) {
    begin_bf16_item(c, it, s);
    ItemBlocks<Bf16> blocks(c, it, ahead);
    bf16_scores(c, it, s, blocks);
    fp32_softmax(c, it, s);
    fp32_values<kAvx512Build>(c, it, s, blocks);
    store_rows(c, it, s);
  }
};

#if defined(DYNASPEC_AVX512)
// Pass 2 and the output with bf16 probabilities, for NV = D / 16: each row's exps (pb) and
// 1 / their sum (inv), then the value sums. A decode's few rows take the value pairs straight
// from the cache, more rows from V_CHUNK blocks interleaved once for them all. Every row gets the
// same operations either way.
template <int NV>
void pair_values(const AttnCall<Bf16>& c, const AttnItem& it, AttnScratch& s,
                 ItemBlocks<Bf16>& blocks) {
  const int64_t ne = it.Ct + (it.Ct & 1), rs = c.Hkv * c.D, bs = c.block_size;
  if (static_cast<int64_t>(s.pb.size()) < it.R * ne) s.pb.resize(it.R * ne);
  s.inv.resize(it.R);
  for (int64_t r = 0; r < it.R; ++r) {
    const int64_t pos = it.first + r / c.G;
    s.inv[r] =
        exp_row_bf16(s.sf.data() + r * it.Ct, c.first_key(pos), pos, ne, s.pb.data() + r * ne);
  }
  auto acc = [&](int64_t r) { return s.accf.data() + r * c.D; };
  const bool direct = it.R <= 4;
  const int64_t span = direct ? 1 : V_CHUNK;
  if (!direct && static_cast<int64_t>(s.vpairs.size()) < span * bs / 2 * NV * 16)
    s.vpairs.resize(span * bs / 2 * NV * 16);
  auto interleave = [&](int64_t blk, int64_t nth) {  // block blk, the span's nth
    if (direct) return;
    const Bf16* v = c.head_rows(c.vp, it.b, it.h, blk);
    const int64_t rows = it.keys_in(blk, bs);
    int32_t* dst = s.vpairs.data() + nth * bs / 2 * NV * 16;
    for (int64_t t = 0; t < rows; t += 2) {
      __m512i x[NV];
      value_pairs<NV>(v + t * rs, t + 1 < rows ? v + (t + 1) * rs : nullptr, x);
      for (int i = 0; i < NV; ++i) _mm512_storeu_si512(dst + (t / 2 * NV + i) * 16, x[i]);
    }
  };
  auto sum = [&](int64_t c0, int64_t k0, int64_t n) {
    auto prob = [&](int64_t r) { return s.pb.data() + r * ne + k0; };
    auto pairs = [&](int64_t r) { return (it.seen(c.G, r, k0, n) + 1) / 2; };
    if (direct) {
      const Bf16* v = c.head_rows(c.vp, it.b, it.h, c0);
      accumulate_pairs<NV>(it.R, acc, prob, pairs, [&](int64_t j, __m512i* x) {
        value_pairs<NV>(v + 2 * j * rs, 2 * j + 1 < n ? v + (2 * j + 1) * rs : nullptr, x);
      });
    } else {
      accumulate_pairs<NV>(it.R, acc, prob, pairs, [&](int64_t j, __m512i* x) {
        for (int i = 0; i < NV; ++i) x[i] = _mm512_loadu_si512(s.vpairs.data() + (j * NV + i) * 16);
      });
    }
  };
  blocks.value_spans(span, interleave, sum);
  for (int64_t r = 0; r < it.R; ++r) store_pairs_row<NV>(acc(r), s.inv[r], c.out_row(it, r));
}

// pair_values for the rows of a token tree, one row at a time: a row's keys are the context and
// then its root path, laid out as that path verified as a chain lays them out (the path's node of
// depth d at C - W + d), so its exps, sums and value pairs, which pair keys by their position, are
// the chain row's operations on the chain row's operands: the same bits. (Scores do not depend on
// a key's position, so they are read where pass 1 wrote them.)
template <int NV>
void tree_pair_values(const AttnCall<Bf16>& c, const AttnItem& it, AttnScratch& s) {
  const int64_t step0 = c.cl[it.b] - c.ql[it.b], rs = c.Hkv * c.D, ne = it.Ct + (it.Ct & 1);
  if (static_cast<int64_t>(s.pb.size()) < ne) s.pb.resize(ne);
  s.vs.resize(it.Ct);
  s.keys.resize(it.Ct);
  for (int64_t r = 0; r < it.R; ++r) {
    const int64_t j = it.j0 + r / c.G;
    const uint8_t* visible = c.tm + (c.qs[it.b] + j) * c.tmw;
    int64_t n = step0;
    for (int64_t k = 0; k < step0; ++k) s.keys[k] = k;
    for (int64_t k = 0; k <= j; ++k)
      if (visible[k]) s.keys[n++] = step0 + k;
    for (int64_t t = 0; t < n; ++t) s.vs[t] = s.sf[r * it.Ct + s.keys[t]];
    // n - 1: the row's chain position (its window counts in those)
    const float row_inv =
        exp_row_bf16(s.vs.data(), c.first_key(n - 1), n - 1, n + (n & 1), s.pb.data());
    auto value = [&](int64_t t) {
      const int64_t k = s.keys[t];
      return c.head_rows(c.vp, it.b, it.h, k / c.block_size) + (k % c.block_size) * rs;
    };
    float* a = s.accf.data() + r * c.D;
    accumulate_pairs<NV>(
        1, [&](int64_t) { return a; }, [&](int64_t) { return s.pb.data(); },
        [&](int64_t) { return (n + 1) / 2; },
        [&](int64_t p, __m512i* x) {
          value_pairs<NV>(value(2 * p), 2 * p + 1 < n ? value(2 * p + 1) : nullptr, x);
        });
    store_pairs_row<NV>(a, row_inv, c.out_row(it, r));
  }
}

// One item with bf16 scores and bf16 probabilities (a tree's rows as their chains').
struct PairsItem {
  template <int NV>
  static void values(const AttnCall<Bf16>& c, const AttnItem& it, AttnScratch& s,
                     ItemBlocks<Bf16>& blocks) {
    if (c.tree[it.b]) tree_pair_values<NV>(c, it, s);
    else pair_values<NV>(c, it, s, blocks);
  }
  static void run(const AttnCall<Bf16>& c, const AttnItem& it, int64_t ahead, AttnScratch& s) {
    begin_bf16_item(c, it, s);
    ItemBlocks<Bf16> blocks(c, it, ahead);
    bf16_scores(c, it, s, blocks);
    if (c.D == 64) values<4>(c, it, s, blocks);
    else values<8>(c, it, s, blocks);
  }
};
#else
struct PairsItem {  // bf16 probabilities exist in an AVX-512 build only, and run never picks them
  static void run(const AttnCall<Bf16>&, const AttnItem&, int64_t, AttnScratch&) {
    TORCH_CHECK(false, "paged_decode: bf16 probabilities are not compiled into this build");
  }
};
#endif

}  // namespace
