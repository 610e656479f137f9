// Per-row pieces of the paged attention kernel (paged_decode.cpp): bf16 dot-product scores,
// the value accumulation, the row max and the shifted exp. Each is one fixed sequence of operations
// per row, which is what keeps a row's result independent of its step, tile and batch.
#pragma once

#include <torch/extension.h>

#include "vec_exp.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t KEY_LANES = 16;  // keys scored together (one zmm of fp32 lanes)

// acc[d] += sum_t p[t] * v[t][d], v: [n, D] fp32.
inline void axpy_rows(float* __restrict acc, const float* __restrict p, const float* __restrict v,
                      int64_t n, int64_t D) {
  for (int64_t t = 0; t < n; ++t) {
    const float pt = p[t];
    const float* __restrict vt = v + t * D;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] += pt * vt[d];
  }
}

// ---- bf16 dot products (AVX512-BF16) ----------------------------------------------------------
// Scores as s_t = scale * q . k_t straight from bf16 q and bf16 keys: vdpbf16ps forms each pair
// product exactly in fp32, so nothing is converted or transposed, and the 16 keys of a group are
// reduced together. A key's sum is fixed by D alone: lane L (16 per key) accumulates pairs
// L, L + 16, ... in order; the lanes then add in one tree (see reduce16). Every row of every step
// runs this sequence, so the path keeps row invariance. (The fp32 path it replaces ran one
// 64-long dependent FMA chain per row and 16 keys, plus a transpose: ~5x the time at batch 32.)
#define BF16DOT_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))

bool detect_bf16dot() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
}
const bool g_bf16dot = detect_bf16dot();

// out lane t = the 16 lanes of a[t] summed as ((b0 + b1) + (b2 + b3)) over 128-bit blocks bk,
// each block as ((l0 + l2) + (l1 + l3)).
BF16DOT_TARGET inline __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d u = _mm512_castps_pd(x[2 * j]), w = _mm512_castps_pd(x[2 * j + 1]);
    y[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)), _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
  }
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// s[t] = scale * q . k_t for the n <= 16 keys at k0 + t * stride (bf16, D % 32 == 0).
BF16DOT_TARGET void scores16_bf16(const c10::BFloat16* q, const c10::BFloat16* k0, int64_t stride, int64_t n,
                                  int64_t D, float scale, float* s) {
  __m512 a[KEY_LANES];
  for (int64_t t = 0; t < KEY_LANES; ++t) {
    a[t] = _mm512_setzero_ps();
    if (t >= n) continue;
    const c10::BFloat16* k = k0 + t * stride;
    for (int64_t c = 0; c < D; c += 32)
      a[t] = _mm512_dpbf16_ps(a[t], (__m512bh)_mm512_loadu_si512(q + c), (__m512bh)_mm512_loadu_si512(k + c));
  }
  const __m512 f = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << n) - 1u), f);
}

#if defined(__AVX512F__)
// acc[0..16*NV) += p[t] * v[t] for t < n in order (v: [n][16*NV] fp32), the sums kept in
// registers across keys (the plain loop stored them back for every key).
template <int NV>
inline void pv_rows(float* __restrict acc, const float* __restrict p, const float* __restrict v, int64_t n) {
  __m512 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(pt, _mm512_loadu_ps(v + (t * NV + i) * 16), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}
#endif

#if defined(__AVX512F__)
// pv_rows for two rows over the same values: twice the independent FMA chains (one row's four
// waited on the FMA latency), each row's sums in the same order as alone.
template <int NV>
inline void pv_rows2(float* __restrict acc0, const float* __restrict p0, float* __restrict acc1,
                     const float* __restrict p1, const float* __restrict v, int64_t n) {
  __m512 a[NV], c[NV];
  for (int i = 0; i < NV; ++i) {
    a[i] = _mm512_loadu_ps(acc0 + 16 * i);
    c[i] = _mm512_loadu_ps(acc1 + 16 * i);
  }
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pa = _mm512_set1_ps(p0[t]), pc = _mm512_set1_ps(p1[t]);
    for (int i = 0; i < NV; ++i) {
      const __m512 vt = _mm512_loadu_ps(v + (t * NV + i) * 16);
      a[i] = _mm512_fmadd_ps(pa, vt, a[i]);
      c[i] = _mm512_fmadd_ps(pc, vt, c[i]);
    }
  }
  for (int i = 0; i < NV; ++i) {
    _mm512_storeu_ps(acc0 + 16 * i, a[i]);
    _mm512_storeu_ps(acc1 + 16 * i, c[i]);
  }
}
#endif

// acc += sum_t p[t] * v[t] (t < n, in order), registers where D allows.
inline void accumulate_v(float* acc, const float* p, const float* v, int64_t n, int64_t D) {
#if defined(__AVX512F__)
  switch (D) {
    case 64: return pv_rows<4>(acc, p, v, n);
    case 128: return pv_rows<8>(acc, p, v, n);
    case 256: return pv_rows<16>(acc, p, v, n);
    default: break;
  }
#endif
  axpy_rows(acc, p, v, n, D);
}

// Two rows' acc += sum_t p[t] * v[t] over their first n0 and n1 values: the common part
// together, the rest of the longer row alone (each row's order unchanged). False: D has no
// two-row path, the caller goes row by row.
inline bool accumulate_v2(float* acc0, const float* p0, int64_t n0, float* acc1, const float* p1,
                          int64_t n1, const float* v, int64_t D) {
#if defined(__AVX512F__)
  if (D == 64 || D == 128) {
    const int64_t m = std::min(n0, n1);
    if (m > 0) (D == 64 ? pv_rows2<4> : pv_rows2<8>)(acc0, p0, acc1, p1, v, m);
    if (n0 > m) accumulate_v(acc0, p0 + m, v + m * D, n0 - m, D);
    if (n1 > m) accumulate_v(acc1, p1 + m, v + m * D, n1 - m, D);
    return true;
  }
#endif
  return false;
}

// The largest of x[0..n) (exact in any order; the scalar loop's compare chain was not
// vectorised and cost as much as the scores at long contexts).
inline float row_max(const float* x, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  int64_t t = 0;
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(x + t));
  mx = _mm512_reduce_max_ps(m);
#endif
  for (; t < n; ++t) mx = x[t] > mx ? x[t] : mx;
  return mx;
}

// e[t] = exp(e[t] - mx), 16 at a time where the ISA allows (the same bits as exp_vec).
inline void exp_shifted(float* e, int64_t n, float mx) {
  int64_t t = 0;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx);
  for (; t + 16 <= n; t += 16) _mm512_storeu_ps(e + t, exp16(_mm512_sub_ps(_mm512_loadu_ps(e + t), m)));
#endif
  for (; t < n; ++t) e[t] = exp_vec(e[t] - mx);
}

}  // namespace
