// The paged attention kernel's prefetches (paged_decode.cpp): a few blocks ahead within a work
// item, and the next request's blocks into L2 while the current one runs. They only hint loads:
// no result depends on them.
#pragma once

#include "simd.h"

#include <algorithm>
#include <cstdint>

namespace {

// Ask for the next block's rows of this head while the current one is computed: blocks sit at
// random places in the pool, so the hardware prefetcher cannot see the next one coming, and at
// batch 32 the loads stalled more than the arithmetic ran.
constexpr int64_t AHEAD = 4;  // blocks: one block's work is shorter than a memory round trip

template <typename T>
inline void prefetch_rows(const T* src, int64_t stride, int64_t n, int64_t D) {
  const int64_t bytes = D * static_cast<int64_t>(sizeof(T));
  for (int64_t t = 0; t < n; ++t)
    for (int64_t off = 0; off < bytes; off += 64)
      __builtin_prefetch(reinterpret_cast<const char*>(src + t * stride) + off, 0, 3);
}

// Brings one request's KV blocks into L2 a slice at a time, spread over another item's block
// steps: head h of Hkv takes blocks [h, h + 1) * nblk / Hkv, keys and values, every head's rows
// (a block of one cache is one contiguous run of slots x heads x D).
struct NextRequest {
  const char* k = nullptr;
  const char* v = nullptr;
  const int64_t* table = nullptr;
  int64_t region = 0, region_lines = 0, per_step = 0, left = 0;
  int64_t blk = 0, line = 0;  // where the next line is: block first + blk, keys then values
  bool values = false;
  template <typename T>
  NextRequest(const T* kp, const T* vp, const int64_t* tb, int64_t NB, int64_t block_elems,
              int64_t req, const int64_t* cl, int64_t h, int64_t Hkv, int64_t block_size,
              int64_t steps) {
    if (req < 0 || steps <= 0) return;
    const int64_t nblk = std::min(NB, (cl[req] + block_size - 1) / block_size);
    const int64_t first = h * nblk / Hkv;
    const int64_t blocks = (h + 1) * nblk / Hkv - first;
    k = reinterpret_cast<const char*>(kp), v = reinterpret_cast<const char*>(vp),
    table = tb + req * NB + first;
    region = block_elems * static_cast<int64_t>(sizeof(T));
    region_lines = region / 64;
    left = blocks * 2 * region_lines;
    per_step = (left + steps - 1) / steps;
  }
  // The next per_step lines in order (block by block, its keys then its values). Counters rather
  // than a division per line: dividing to find each line's block was ~40% of a decode item.
  __attribute__((always_inline)) inline void step() {
    int64_t n = std::min(per_step, left);
    left -= n;
    while (n > 0) {
      const char* base = (values ? v : k) + table[blk] * region + line * 64;
      const int64_t take = std::min(n, region_lines - line);
      for (int64_t i = 0; i < take; ++i) _mm_prefetch(base + i * 64, _MM_HINT_T1);
      n -= take;
      line += take;
      if (line == region_lines) {
        line = 0;
        values = !values;
        if (!values) ++blk;
      }
    }
  }
};

}  // namespace
