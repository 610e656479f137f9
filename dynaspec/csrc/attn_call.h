// One paged attention call's inputs as its work items read them (paged_decode.cpp), one work
// item's geometry (a request, a tile of its query tokens and a KV head), and what each path
// computes for a call's inputs.
#pragma once

#include <torch/extension.h>

#include "attn_reference.h"
#include "cpu_paths.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

template <typename T>
struct AttnCall;

// Work item: request b's query tokens j0..j1 (rows r = (token j0 + r / G, head h * G + r % G))
// against KV head h.
struct AttnItem {
  int64_t b, h, j0, j1;
  int64_t R;      // query rows: (j1 - j0) * G
  int64_t Ct;     // keys the tile's last row sees
  int64_t first;  // the position of token j0 (it sees keys up to it)
  int64_t last;   // the last block read

  template <typename T>
  static AttnItem of(const AttnCall<T>& c, int64_t b, int64_t h, int64_t j0, int64_t j1) {
    const int64_t first = c.cl[b] - c.ql[b] + j0, Ct = c.cl[b] - c.ql[b] + j1;
    const int64_t nblk = (Ct + c.block_size - 1) / c.block_size;
    return {b, h, j0, j1, (j1 - j0) * c.G, Ct, first, std::min(nblk, c.NB) - 1};
  }
  // Keys in block blk (fewer in the last).
  int64_t keys_in(int64_t blk, int64_t block_size) const {
    return std::min(block_size, Ct - blk * block_size);
  }
  // Keys row r sees in the n keys from key k0 on (its causal end, clipped to them).
  int64_t seen(int64_t G, int64_t r, int64_t k0, int64_t n) const {
    return std::max<int64_t>(0, std::min(n, first + r / G + 1 - k0));
  }
};

template <typename T>
struct AttnCall {
  const T* qp;        // [T, H, D] queries, token stride qstride
  int64_t qstride;    // elements between tokens' queries
  const T* kp;        // keys: [slots, Hkv, D]
  const T* vp;        // values: [slots, Hkv, D]
  T* op;              // [T, H, D] output
  const int64_t* tb;  // [B, NB] block tables
  const int64_t* cl;  // [B] context lengths (after this step's rows)
  const int64_t* qs;  // [B] first query token
  const int64_t* ql;  // [B] query tokens
  int64_t NB, H, Hkv, G, D, block_size;
  float sc;           // the softmax scale, folded into the queries
  int64_t window;     // > 0: a sliding window of that many keys
  const uint8_t* tm;  // token trees: [T, tmw] visibility over each request's rows, or null
  int64_t tmw;
  const char* tree;  // [B]: whether request b's step is a tree

  // Request b's rows of KV head h in block blk of a cache (row t at + t * Hkv * D).
  const T* head_rows(const T* cache, int64_t b, int64_t h, int64_t blk) const {
    return cache + (tb[b * NB + blk] * block_size * Hkv + h) * D;
  }
  // The first key a query at position pos sees (later than 0 in a sliding window).
  int64_t first_key(int64_t pos) const {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0};
  }
  // Row r of an item (token j0 + r / G, head h * G + r % G): its queries and its output.
  const T* q_row(const AttnItem& it, int64_t r) const {
    return qp + (qs[it.b] + it.j0 + r / G) * qstride + (it.h * G + r % G) * D;
  }
  T* out_row(const AttnItem& it, int64_t r) const {
    return op + ((qs[it.b] + it.j0 + r / G) * H + it.h * G + r % G) * D;
  }
};

// Whether the AVX2 rows (attn_avx2_item.h) take these inputs; otherwise the avx2 path runs the
// fp32 rows (a double cache, or D not a multiple of 8).
template <typename T>
constexpr bool kAvx2Type =
    std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16> || std::is_same_v<T, c10::Half>;

template <typename T>
constexpr bool avx2_rows(int64_t D) {
  return kAvx2Type<T> && D % 8 == 0;
}

// What path p computes for these inputs, as the reference would reproduce it (the AVX-512 paths
// as they run: in an AVX-512 build).
template <typename T>
RowNumerics numerics(AttnPath p, int64_t D, int64_t block_size) {
  RowNumerics n;
  n.bf16_scores = p == AttnPath::Avx512Bf16 && std::is_same_v<T, c10::BFloat16> && D % 32 == 0;
  n.bf16_probs = n.bf16_scores && (D == 64 || D == 128) && block_size % 2 == 0;
  n.fused_pv = (p == AttnPath::Avx2 && avx2_rows<T>(D)) ||
               (p >= AttnPath::Avx512 && (D == 64 || D == 128 || D == 256));
  return n;
}

}  // namespace
