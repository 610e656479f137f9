// The attention kernel's fp32 key path (paged_decode.cpp), for KV in fp32 or fp16, or bf16 on a
// CPU without AVX512-BF16: keys converted to fp32 and transposed to key-major lanes, scores as one
// fp32 FMA chain per key over d in order, and cached rows widened to fp32 (exactly).
#pragma once

#include <torch/extension.h>

#include "attn_rows.h"

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace {

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// s[t] = sum_d q[d] * k[t][d] for n <= 16 keys held transposed (kt[d * 16 + t]): the sum runs
// over d in order in each key's lane, the same for every row and every key.
inline void scores16(const float* __restrict q, const float* __restrict kt, float* __restrict s,
                     int64_t n, int64_t D) {
  float acc[KEY_LANES] = {0.f};
  for (int64_t d = 0; d < D; ++d) {
    const float qd = q[d];
    const float* __restrict kd = kt + d * KEY_LANES;
#pragma omp simd
    for (int64_t t = 0; t < KEY_LANES; ++t) acc[t] = __builtin_fmaf(qd, kd[t], acc[t]);
  }
  for (int64_t t = 0; t < n; ++t) s[t] = acc[t];
}

// kt[d * 16 + t] = kf[t * D + d]: 16 converted key rows to key-major lanes. Only data moves, so
// every path gives identical scores. (A scalar scatter of every key's 64 values here cost more
// than the arithmetic at long contexts; 64 gathers per 16 keys then dominated decode steps.)
inline void transpose_keys(const float* __restrict kf, float* __restrict kt, int64_t D) {
  for (int64_t t = 0; t < KEY_LANES; ++t)
    for (int64_t d = 0; d < D; ++d) kt[d * KEY_LANES + t] = kf[t * D + d];
}

#if defined(DYNASPEC_AVX512)
template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {  // bf16: the high half of an fp32, exactly
    return bf16x16_load(p);
  }
}

// The same kt as converting then transpose_keys, straight from the cache: 16 key rows (row t at
// src + t * stride; rows n.. are zero) go through a 16x16 in-register transpose per 16 dims.
// Forced inline: pass 1 runs it for every 16 keys, and out of line it would add a call to each
// (the compiler inlined it while pass 1 was one function with the rest of the item).
template <typename T>
__attribute__((always_inline)) inline void transpose_keys_from(const T* __restrict src,
                                                               int64_t stride, int64_t n,
                                                               float* __restrict kt, int64_t D) {
  for (int64_t d0 = 0; d0 < D; d0 += 16) {
    __m512 r[16];
    for (int i = 0; i < 16; ++i) r[i] = i < n ? load16(src + i * stride + d0) : _mm512_setzero_ps();
    transpose16x16(r, kt + d0 * KEY_LANES);
  }
}
#endif

// One cached row to fp32 (exact), 16 values per instruction where D allows.
template <typename T>
inline void row_to_float(const T* src, float* dst, int64_t D) {
#if defined(DYNASPEC_AVX512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (D % 16 == 0) {
      for (int64_t d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, load16(src + d));
      return;
    }
  }
#endif
  to_float(src, dst, D);
}

// 16 keys of one KV head, converted to fp32 and transposed to kt (rows n.. zero). Forced inline
// for the same reason as transpose_keys_from.
template <typename T>
__attribute__((always_inline)) inline void load_keys(const T* src, int64_t stride, int64_t n,
                                                     float* kf, float* kt, int64_t D) {
#if defined(DYNASPEC_AVX512)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    if (D % 16 == 0) {
      transpose_keys_from(src, stride, n, kt, D);
      return;
    }
  }
#endif
  for (int64_t t = 0; t < n; ++t) to_float(src + t * stride, kf + t * D, D);
  std::fill(kf + n * D, kf + KEY_LANES * D, 0.f);
  transpose_keys(kf, kt, D);
}

}  // namespace
