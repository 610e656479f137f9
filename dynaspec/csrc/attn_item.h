// The shape every attention path's work item takes (paged_decode.cpp; the items themselves are
// attn_fp32_item.h, attn_avx2_item.h and attn_bf16_item.h): one thread's buffers, the walk over an
// item's blocks that both passes share (prefetches included), the query rows scaled to fp32, each
// row's softmax and the rows' outputs, and the loop that runs one thread's share of the items.
// None of it changes a row's arithmetic: a row gets the same operations whatever item, tile or
// thread it lands in.
#pragma once

#include <torch/extension.h>

#include "attn_call.h"
#include "attn_prefetch.h"

#include <algorithm>
#include <array>
#include <cstdint>
#include <vector>

// Forced inline: the passes' block walks take the paths' bodies as lambdas, and an AVX2 item's
// (target-attributed) bodies could not be inlined into an out-of-line walk.
#define ATTN_INLINE __attribute__((always_inline)) inline

namespace {

// Blocks of values a many-row item converts (fp32 rows) or interleaves (bf16 pairs) at a time:
// 8 of 16 slots at D = 64, 32 KB, in L1.
constexpr int64_t V_CHUNK = 8;

struct AttnScratch {          // one thread's buffers, reused by its items; each path uses a few
  std::vector<float> qf;      // [R, D] scaled queries
  std::vector<float> sf;      // [R, Ct] scores, then probabilities (exps with bf16 pairs)
  std::vector<float> accf;    // [R, D] value sums
  std::vector<float> kt;      // [D, 16] a key group in lanes ([D / 2, 16] bf16 key pairs)
  std::vector<float> kf;      // [16, D] a key group converted, before its plain transpose
  std::vector<float> vf;      // [span blocks x block_size, D] values converted to fp32
  std::vector<float> part;    // [4, R, 16] scores_rows_bf16's block sums
  std::vector<float> packed;  // a tree row's visible scores
  std::vector<const c10::BFloat16*> qrows;  // [R] bf16 query rows, scored as they are
  std::vector<c10::BFloat16> pb;            // bf16 probabilities: [R][Ct rounded up to a pair]
  std::vector<float> inv;                   // [R]: 1 / each row's sum of exps
  std::vector<int32_t> vpairs;              // V_CHUNK blocks of value pairs: [pairs][D / 16][16]
  std::vector<float> vs;                    // a tree row's scores in chain order
  std::vector<int64_t> keys;                // a tree row's chain position -> its key
};

// An item's blocks as both passes walk them. Each block of each pass is one step of the next
// request's prefetch (NextRequest: its KV into L2 while this item runs), and asks for the rows
// AHEAD blocks on (blocks sit at random places in the pool, so the hardware prefetcher cannot
// see the next one coming, and a block's work is shorter than a memory round trip).
template <typename T>
class ItemBlocks {
 public:
  ItemBlocks(const AttnCall<T>& c, const AttnItem& it, int64_t ahead)
      : c_(c),
        it_(it),
        pre_(c.kp, c.vp, c.tb, c.NB, c.block_size * c.Hkv * c.D, ahead, c.cl, it.h, c.Hkv,
             c.block_size, 2 * (it.last + 1)) {}

  // Pass 1: body(k0, keys, n) for each group of n <= LANES keys from key k0 (key t's row at
  // keys + t * Hkv * D), block by block; while the last blocks' keys are read, pass 2's first
  // values are prefetched.
  template <int64_t LANES, typename Body>
  ATTN_INLINE void key_groups(Body&& body) {
    for (int64_t blk = 0; blk <= it_.last; ++blk) {
      pre_.step();
      const int64_t want = blk + AHEAD;
      if (want <= it_.last) prefetch(c_.kp, want);
      else if (want - it_.last - 1 <= it_.last) prefetch(c_.vp, want - it_.last - 1);
      const T* keys = c_.head_rows(c_.kp, it_.b, it_.h, blk);
      const int64_t n_blk = it_.keys_in(blk, c_.block_size);
      for (int64_t t0 = 0; t0 < n_blk; t0 += LANES)
        body(blk * c_.block_size + t0, keys + t0 * c_.Hkv * c_.D, std::min(LANES, n_blk - t0));
    }
  }

  // Pass 2: the blocks in spans of `span`: block(blk, i) for each block (the i-th of its span)
  // once its prefetches are asked for, then sum(c0, k0, n) for the span (its first block, its
  // first key and its keys).
  template <typename Span, typename Block, typename Sum>
  ATTN_INLINE void value_spans(Span span, Block&& block, Sum&& sum) {
    for (int64_t c0 = 0; c0 <= it_.last; c0 += span) {
      const int64_t c1 = std::min<int64_t>(it_.last + 1, c0 + span);
      for (int64_t blk = c0; blk < c1; ++blk) {
        pre_.step();
        if (blk + AHEAD <= it_.last) prefetch(c_.vp, blk + AHEAD);
        block(blk, blk - c0);
      }
      const int64_t k0 = c0 * c_.block_size;
      sum(c0, k0, std::min(it_.Ct, c1 * c_.block_size) - k0);
    }
  }

 private:
  // Block blk's rows of the item's request and head in a cache.
  ATTN_INLINE void prefetch(const T* cache, int64_t blk) {
    prefetch_rows(c_.head_rows(cache, it_.b, it_.h, blk), c_.Hkv * c_.D,
                  it_.keys_in(blk, c_.block_size), c_.D);
  }

  const AttnCall<T>& c_;
  const AttnItem& it_;
  NextRequest pre_;
};

// An item's buffers sized: scores for every row and key (not zeroed: pass 1 writes every key of
// every row, and the softmax then every probability), value sums zeroed.
template <typename T>
ATTN_INLINE void begin_item(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s) {
  if (static_cast<int64_t>(s.sf.size()) < it.R * it.Ct) s.sf.resize(it.R * it.Ct);
  s.accf.assign(it.R * c.D, 0.f);
}

// qf: the item's query rows in fp32, times the softmax scale.
template <typename T>
ATTN_INLINE void scale_queries(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s) {
  const int64_t D = c.D;
  s.qf.resize(it.R * D);
  for (int64_t r = 0; r < it.R; ++r) {
    const T* q = c.q_row(it, r);
    for (int64_t d = 0; d < D; ++d) s.qf[r * D + d] = static_cast<float>(q[d]) * c.sc;
  }
}

// Each row's softmax over its visible keys: plain(srow, Ct, lo, pos) over keys [lo, pos], or
// for a token tree's row tree(srow, Ct, pos, step0, visible, window, packed) over the keys its
// root path sees (attn_tree.h). Every other key gets probability 0.
template <typename T, typename Plain, typename Tree>
ATTN_INLINE void softmax_rows(const AttnCall<T>& c, const AttnItem& it, AttnScratch& s,
                              Plain&& plain, Tree&& tree) {
  const int64_t step0 = c.cl[it.b] - c.ql[it.b];
  for (int64_t r = 0; r < it.R; ++r) {
    const int64_t pos = it.first + r / c.G;
    float* srow = s.sf.data() + r * it.Ct;
    if (c.tree[it.b])
      tree(srow, it.Ct, pos, step0, c.tm + (c.qs[it.b] + it.j0 + r / c.G) * c.tmw, c.window,
           s.packed);
    else plain(srow, it.Ct, c.first_key(pos), pos);
  }
}

// The rows' value sums to the output, rounded to T.
template <typename T>
ATTN_INLINE void store_rows(const AttnCall<T>& c, const AttnItem& it, const AttnScratch& s) {
  for (int64_t r = 0; r < it.R; ++r) {
    T* dst = c.out_row(it, r);
    for (int64_t d = 0; d < c.D; ++d) dst[d] = static_cast<T>(s.accf[r * c.D + d]);
  }
}

// One thread's share of the items (attn_schedule.h's next and ahead) through Item::run(c, item,
// ahead, scratch); tiles: (request, first query token, end token), item i is tile i / Hkv with KV
// head i % Hkv.
template <typename Item, typename T, typename Next, typename Ahead>
void run_items(const AttnCall<T>& c, const std::vector<std::array<int64_t, 3>>& tiles, Next&& next,
               Ahead&& ahead) {
  AttnScratch s;
  for (int64_t item = next(); item >= 0; item = next()) {
    const auto [b, j0, j1] = tiles[item / c.Hkv];
    Item::run(c, AttnItem::of(c, b, item % c.Hkv, j0, j1), ahead(item), s);
  }
}

}  // namespace
