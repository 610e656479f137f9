// Which keys a token-tree row sees, for every attention path (attn_rows.h, attn_avx2.h): the
// keys its root path sees when verified as a chain, so a tree row gives its chain row's bits.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// A token-tree row (docs/design.md §4c) at position pos sees what its root path verified as a
// chain sees: the context, then its ancestors and itself (the step's rows k - step0 where
// `visible` is set) at chain positions step0, step0 + 1, ...; its own chain position is step0 +
// its depth, and a sliding window (> 0) counts in chain positions, as the chain's rows would.
// Its chain position.
inline int64_t tree_chain_pos(int64_t pos, int64_t step0, const uint8_t* visible) {
  int64_t depth = -1;
  for (int64_t k = step0; k <= pos; ++k) depth += visible[k - step0] != 0;
  return step0 + depth;
}

// The first key a tree row sees: its window's start, counted in chain positions (0 without one).
inline int64_t tree_first_key(int64_t pos, int64_t step0, const uint8_t* visible, int64_t window) {
  if (window <= 0) return 0;
  return std::max<int64_t>(0, tree_chain_pos(pos, step0, visible) - window + 1);
}

// f(k) for each key the tree row sees, in key order, from `lo` (tree_first_key) on.
template <typename F>
inline void for_tree_keys(int64_t pos, int64_t step0, const uint8_t* visible, int64_t lo, F&& f) {
  for (int64_t k = lo; k < step0; ++k) f(k);
  int64_t at = step0;  // the chain position of the next visible step row
  for (int64_t k = step0; k <= pos; ++k) {
    if (!visible[k - step0]) continue;
    if (at++ >= lo) f(k);
  }
}

// softmax_row for a token-tree row: the scores of the keys it sees (for_tree_keys) are packed
// in key order and go through `softmax` (softmax_row or a path's form of it), so the row's max,
// exps and sum are those of its chain row over exactly those keys; the others get probability
// 0, which pass 2 adds as nothing. Same bits as verifying the path as a chain.
template <typename Softmax>
inline void softmax_tree_row(float* srow, int64_t Ct, int64_t pos, int64_t step0,
                             const uint8_t* visible, int64_t window, std::vector<float>& packed,
                             Softmax&& softmax) {
  packed.resize(pos + 1);
  const int64_t lo = tree_first_key(pos, step0, visible, window);  // once: both passes use it
  int64_t n = 0;
  for_tree_keys(pos, step0, visible, lo, [&](int64_t k) { packed[n++] = srow[k]; });
  softmax(packed.data(), n);
  std::fill(srow, srow + Ct, 0.f);
  n = 0;
  for_tree_keys(pos, step0, visible, lo, [&](int64_t k) { srow[k] = packed[n++]; });
}

}  // namespace
