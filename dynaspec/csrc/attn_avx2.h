// The attention rows' pieces in AVX2 + FMA (+ F16C for fp16 KV) intrinsics on 8 lanes, for the
// attention.avx2 path (dynaspec/cpu_features.py: a CPU with avx2, fma and f16c). Target-attributed
// rather than guarded, so every build has them and they run only where Python allowed the path.
// Each piece is the fp32 rows' sequence of operations (attn_rows.h, attn_fp32.h) in another
// register width, so a row's bits are the reference's (attn_reference.h) with fused value sums:
// scores as one fma chain per key over d in order (keys in lanes), the max exact, the exps
// exp_vec's operations, their sum in 16 lanes by key index % 16 then the lanes in order, and
// acc = fma(p, v, acc) over the keys in order. None of it depends on how many rows share a call.
#pragma once

#include <torch/extension.h>

#include "attn_tree.h"
#include "simd.h"

#include "vec_exp.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#define AVX2_TARGET DYNASPEC_TARGET("avx2,fma,f16c")

namespace {

constexpr int64_t AVX2_KEYS = 16;  // keys scored together: two ymm of fp32 lanes

// 8 values of a cached row as fp32, exactly: fp32 as they are, bf16 shifted into the high half
// of each lane, fp16 through F16C.
template <typename T>
AVX2_TARGET inline __m256 load8(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm256_loadu_ps(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return bf16x8_load(p);
  } else {
    static_assert(std::is_same_v<T, c10::Half>, "fp32, bf16 or fp16 rows");
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

// All ones in the first k (<= 8) lanes.
AVX2_TARGET inline __m256i first8(int64_t k) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(k)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// r[i] lane j <- r[j] lane i (only data moves).
AVX2_TARGET inline void transpose8x8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// kt[d * 16 + t] = key t's element d as fp32 for the n <= 16 keys at k0 + t * stride (keys n..
// zero; D % 8 == 0): the keys in lanes, converted as they are loaded.
template <typename T>
AVX2_TARGET void keys_to_lanes(const T* k0, int64_t stride, int64_t n, int64_t D, float* kt) {
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t d0 = 0; d0 < D; d0 += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) {
        const int64_t t = 8 * half + i;
        r[i] = t < n ? load8(k0 + t * stride + d0) : _mm256_setzero_ps();
      }
      transpose8x8(r);
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (d0 + i) * 16 + 8 * half, r[i]);
    }
}

// s(r)[t] = sum_d q(r)[d] * k_t[d] as one fma chain over d in order, for RB rows (q(r) at
// q + r * D, scaled) and the n <= 16 keys of kt; row r's scores at s + r * ld. The RB x 2
// chains are independent, so the FMA units stay busy; each is the one a row runs alone.
template <int RB>
AVX2_TARGET inline void scores_block(const float* q, int64_t D, const float* kt, float* s,
                                     int64_t ld, int64_t n) {
  __m256 a[RB][2];
  for (int r = 0; r < RB; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    const __m256 k0 = _mm256_loadu_ps(kt + d * 16), k1 = _mm256_loadu_ps(kt + d * 16 + 8);
    for (int r = 0; r < RB; ++r) {
      const __m256 qd = _mm256_broadcast_ss(q + r * D + d);
      a[r][0] = _mm256_fmadd_ps(qd, k0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(qd, k1, a[r][1]);
    }
  }
  for (int r = 0; r < RB; ++r) {
    alignas(32) float out[16];
    _mm256_store_ps(out, a[r][0]);
    _mm256_store_ps(out + 8, a[r][1]);
    std::copy(out, out + n, s + r * ld);
  }
}

// scores_block for R rows, four at a time.
AVX2_TARGET inline void scores_rows_avx2(const float* q, int64_t R, int64_t D, const float* kt,
                                         float* s, int64_t ld, int64_t n) {
  int64_t r = 0;
  for (; r + 4 <= R; r += 4) scores_block<4>(q + r * D, D, kt, s + r * ld, ld, n);
  switch (R - r) {
    case 3: return scores_block<3>(q + r * D, D, kt, s + r * ld, ld, n);
    case 2: return scores_block<2>(q + r * D, D, kt, s + r * ld, ld, n);
    case 1: return scores_block<1>(q + r * D, D, kt, s + r * ld, ld, n);
    default: return;
  }
}

// The largest of x[0..n) (exact in any order; a NaN is skipped as the scalar compare skips it).
AVX2_TARGET inline float row_max8(const float* x, int64_t n) {
  const __m256 ninf = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  __m256 m = ninf;
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + t), m);
  if (t < n) {
    const __m256i k = first8(n - t);
    m = _mm256_max_ps(_mm256_blendv_ps(ninf, _mm256_maskload_ps(x + t, k), _mm256_castsi256_ps(k)),
                      m);
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, m);
  float mx = l[0];
  for (int i = 1; i < 8; ++i) mx = l[i] > mx ? l[i] : mx;
  return mx;
}

// e[0..k) = exp(e - m) (k <= 8), added to acc's first k lanes (the others add +0: unchanged).
AVX2_TARGET inline void exp_part8(float* e, int64_t k, __m256 m, __m256& acc) {
  const __m256i mask = first8(k);
  const __m256 x =
      _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_maskload_ps(e, mask), m)), _mm256_castsi256_ps(mask));
  _mm256_maskstore_ps(e, mask, x);
  acc = _mm256_add_ps(acc, x);
}

// e[t] = exp(e[t] - mx) for t < n, and their sum as exp_shifted_sum forms it: 16 lanes by
// t % 16 (two registers), each in order of t, then the lanes in order.
AVX2_TARGET inline float exp_shifted_sum8(float* e, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m256 x0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + t), m));
    const __m256 x1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(e + t + 8), m));
    _mm256_storeu_ps(e + t, x0);
    _mm256_storeu_ps(e + t + 8, x1);
    a0 = _mm256_add_ps(a0, x0);
    a1 = _mm256_add_ps(a1, x1);
  }
  if (t < n) exp_part8(e + t, std::min<int64_t>(8, n - t), m, a0);
  if (t + 8 < n) exp_part8(e + t + 8, n - t - 8, m, a1);
  alignas(32) float lanes[16];
  _mm256_store_ps(lanes, a0);
  _mm256_store_ps(lanes + 8, a1);
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum;
}

// softmax_row (attn_rows.h) in these pieces: row srow's probabilities over its visible keys
// [lo, pos], every other key 0.
AVX2_TARGET inline void softmax_row_avx2(float* srow, int64_t Ct, int64_t lo, int64_t pos) {
  const int64_t n = pos + 1 - lo;
  float* e = srow + lo;
  const float inv = 1.f / exp_shifted_sum8(e, n, row_max8(e, n));
  std::fill(srow, e, 0.f);
  const __m256 v = _mm256_set1_ps(inv);
  int64_t t = 0;
  for (; t + 8 <= n; t += 8) _mm256_storeu_ps(e + t, _mm256_mul_ps(_mm256_loadu_ps(e + t), v));
  for (; t < n; ++t) e[t] *= inv;
  std::fill(srow + pos + 1, srow + Ct, 0.f);
}

// softmax_row_tree (attn_rows.h) with softmax_row_avx2: the visible keys packed in key order.
AVX2_TARGET inline void softmax_row_tree_avx2(float* srow, int64_t Ct, int64_t pos, int64_t step0,
                                              const uint8_t* visible, int64_t window,
                                              std::vector<float>& packed) {
  softmax_tree_row(srow, Ct, pos, step0, visible, window, packed,
                   [](float* p, int64_t n) AVX2_TARGET { softmax_row_avx2(p, n, 0, n - 1); });
}

// acc(r)[dc, dc + 8 NV) = fma(p(r)[t], v[t], acc(r)) for t < m in order, for RB rows (acc(r) at
// acc + r * D, p(r) at p + r * ld, value row t at v + t * vs): each value vector loaded once for
// the RB rows, the sums in registers across the keys.
template <int RB, int NV, typename T>
AVX2_TARGET inline void pv_chunk(float* acc, int64_t D, const float* p, int64_t ld, const T* v,
                                 int64_t vs, int64_t m, int64_t dc) {
  __m256 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm256_loadu_ps(acc + r * D + dc + 8 * i);
  for (int64_t t = 0; t < m; ++t) {
    __m256 x[NV];
    for (int i = 0; i < NV; ++i) x[i] = load8(v + t * vs + dc + 8 * i);
    for (int r = 0; r < RB; ++r) {
      const __m256 pr = _mm256_broadcast_ss(p + r * ld + t);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm256_fmadd_ps(pr, x[i], a[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) _mm256_storeu_ps(acc + r * D + dc + 8 * i, a[r][i]);
}

// pv_chunk over all of D (D % 8 == 0), 16 columns at a time (RB x 2 sums and 2 values fit the
// 16 registers at RB = 4).
template <int RB, typename T>
AVX2_TARGET inline void pv_rows_avx2(float* acc, int64_t D, const float* p, int64_t ld, const T* v,
                                     int64_t vs, int64_t m) {
  int64_t dc = 0;
  for (; dc + 16 <= D; dc += 16) pv_chunk<RB, 2>(acc, D, p, ld, v, vs, m, dc);
  if (dc < D) pv_chunk<RB, 1>(acc, D, p, ld, v, vs, m, dc);
}

}  // namespace
