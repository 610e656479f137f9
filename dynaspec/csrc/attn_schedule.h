// How the paged attention kernel's work items (paged_decode.cpp) are cut (query tiles) and go to
// the threads. Which rows share an item, which thread runs it and when never change a row's
// arithmetic: only speed depends on this file.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <numeric>
#include <vector>

namespace {

// A call's query tiles: (request, first query token, end token), at most `tile` tokens each.
struct AttnTiles {
  std::vector<std::array<int64_t, 3>> list;
  bool short_queries;  // every request fits one tile (decode and verify steps)
  bool split;          // a small step's queries cut in two tiles, so both threads get rows
};

// A small verify step (batch 1: 3 KV heads on 2 threads) left one thread twice the other's rows;
// its queries then split in two tiles, so each thread gets half of every head's rows.
inline AttnTiles attn_tiles(const int64_t* ql, int64_t B, int64_t Hkv, int64_t tile) {
  AttnTiles t;
  t.short_queries = true;
  for (int64_t b = 0; b < B; ++b) t.short_queries = t.short_queries && ql[b] <= tile;
  t.split = t.short_queries && B * Hkv < 2 * at::get_num_threads();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = t.split && ql[b] > 1 ? (ql[b] + 1) / 2 : tile;
    for (int64_t j0 = 0; j0 < ql[b]; j0 += n) t.list.push_back({b, j0, std::min(ql[b], j0 + n)});
  }
  return t;
}

// Item i is (tile i / Hkv, KV head i % Hkv). run_items(next, ahead) runs one thread's share:
// next() its next item (-1: none left), ahead(item) the request whose KV to bring into L2 while
// that item runs (-1: none).

// Decode and verify steps (every request one tile, or two when split): contiguous ranges, so a
// thread keeps the same (request, KV head) items from step to step and finds their keys in its
// own L2 (handing them out dynamically measured 5-10% slower at batch 1). A thread that finishes
// its range takes the rest of the others' items from where they are: the two vCPUs here do not
// run at one speed, and contexts differ between ranges. Not for a batch that splits its items by
// query tile (a small batch: halves of the same rows).
template <typename RunItems>
void schedule_ranges(const AttnTiles& t, int64_t Hkv, RunItems&& run_items) {
  const std::vector<std::array<int64_t, 3>>& tiles = t.list;
  const bool split = t.split;
  const int64_t items = static_cast<int64_t>(tiles.size()) * Hkv;
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(items, at::get_num_threads()));
  struct alignas(64) Next {
    std::atomic<int64_t> item{0};
  };
  std::unique_ptr<Next[]> next(new Next[workers]);
  const int64_t ranges = split ? 1 : workers;
  // Range r: [lo(r), lo(r + 1)), at::parallel_for's split (the first ranges take the remainder).
  const int64_t per = (items + workers - 1) / workers;
  auto lo = [&](int64_t r) { return std::min(items, r * per); };
  at::parallel_for(0, workers, 1, [&](int64_t wb, int64_t we) {
    for (int64_t w = wb; w < we; ++w) {
      int64_t k = 0, r = w;
      auto take = [&]() -> int64_t {  // own range first, then the others'
        for (; k < ranges; ++k) {
          r = (w + k) % workers;
          const int64_t i = lo(r) + next[r].item++;
          if (i < lo(r + 1)) return i;
        }
        return -1;
      };
      // The range's next request, while this one runs: its blocks (every head's rows, keys and
      // values) into L2, a share per item of this request. Not when split (the next item is the
      // same request).
      auto ahead = [&](int64_t it) -> int64_t {
        const int64_t nt = (it / Hkv + 1) * Hkv;
        return split || nt >= lo(r + 1) ? -1 : tiles[nt / Hkv][0];
      };
      run_items(take, ahead);
    }
  });
}

// A prefill chunk spans several tiles and its late tiles see the most keys: contiguous halves
// gave one thread ~3x the other's work while the other waited. Longest first (rows x keys), one
// at a time to whichever thread is free.
template <typename RunItems>
void schedule_longest_first(const AttnTiles& t, int64_t Hkv, const int64_t* cl, const int64_t* ql,
                            RunItems&& run_items) {
  const std::vector<std::array<int64_t, 3>>& tiles = t.list;
  const int64_t items = static_cast<int64_t>(tiles.size()) * Hkv;
  auto cost = [&](int64_t item) {
    const auto [b, j0, j1] = tiles[item / Hkv];
    return (j1 - j0) * (cl[b] - ql[b] + j1);
  };
  std::vector<int64_t> order(items);
  std::iota(order.begin(), order.end(), int64_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t c) { return cost(a) > cost(c); });
  std::atomic<int64_t> next_item{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(items, at::get_num_threads()));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    run_items(
        [&] {
          const int64_t k = next_item++;
          return k < items ? order[k] : int64_t{-1};
        },
        [](int64_t) { return int64_t{-1}; });
  });
}

template <typename RunItems>
void schedule_items(const AttnTiles& t, int64_t Hkv, const int64_t* cl, const int64_t* ql,
                    RunItems&& run_items) {
  if (t.short_queries) schedule_ranges(t, Hkv, run_items);
  else schedule_longest_first(t, Hkv, cl, ql, run_items);
}

}  // namespace
