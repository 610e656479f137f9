// The largest of a row of floats, shared by the attention softmax and the lm_head's near-max
// search (fused_ops.cpp exact_near_max).
#pragma once

#include "simd.h"

#include <cstdint>
#include <limits>

#if defined(DYNASPEC_AVX512)
// The first k (< 16) lanes: a row's tail as one masked vector.
inline __mmask16 first_lanes(int64_t k) { return static_cast<__mmask16>((1u << k) - 1u); }
#endif

// The largest of x[0..n) (exact in any order; the scalar loop's compare chain was not
// vectorised and cost as much as the scores at long contexts).
inline float row_max(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(DYNASPEC_AVX512)
  __m512 m = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + t));
  if (t < n) {  // the tail as a masked load: -inf in the lanes past n
    m = _mm512_max_ps(m, _mm512_mask_loadu_ps(m, first_lanes(n - t), x + t));
    t = n;
  }
  mx = _mm512_reduce_max_ps(m);
#endif
  for (; t < n; ++t) mx = x[t] > mx ? x[t] : mx;
  return mx;
}
