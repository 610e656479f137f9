// Value sums with bf16 probabilities for the paged attention kernel (paged_decode.cpp), taken for
// bf16 KV on AVX512-BF16 CPUs: FlashAttention's numerics. A row's unnormalised probabilities
// e_t = exp(s_t - max) are rounded to bf16 and meet the cached bf16 values two keys at a time in
// vdpbf16ps (both products exact, sums in fp32); the row is scaled by 1 / (its fp32 sum of the
// e_t) at the end. Against fp32 probabilities times widened values: half the multiply-adds, no
// normalising pass over the probabilities and half their bytes.
//
// Row invariance: every row adds its key pairs (2j, 2j + 1) in order from key 0, whatever its
// step, tile or batch, with the same accumulator layout; a pair's key past the row's last has
// probability 0, so it adds exactly nothing (its value is zeroed where it lies past the context).
#pragma once

#include <torch/extension.h>

#include "attn_rows.h"
#include "row_max.h"
#include "vec_exp.h"

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

#if defined(DYNASPEC_AVX512)
// A row's D / 16 accumulators hold its dims interleaved as vpunpck{l,h}wd leave them: lane
// 4i + l of accumulator 2c + hi is dim 32c + 8i + 4hi + l (store_pairs_row puts them back).

// Keys v0 and v1 (bf16 rows of D = 16 * NV; v1 null: zeros) as NV vectors of (v0[d], v1[d]) pairs.
// No target attribute (it needs only the build's AVX512BW): with BF16DOT_TARGET it could not be
// inlined into the kernel's lambdas, and a call per pair cost more than the pair's arithmetic.
template <int NV>
inline void value_pairs(const c10::BFloat16* v0, const c10::BFloat16* v1, __m512i* out) {
  for (int c = 0; c < NV / 2; ++c) {
    const __m512i a = _mm512_loadu_si512(v0 + 32 * c);
    const __m512i b = v1 ? _mm512_loadu_si512(v1 + 32 * c) : _mm512_setzero_si512();
    out[2 * c] = _mm512_unpacklo_epi16(a, b);
    out[2 * c + 1] = _mm512_unpackhi_epi16(a, b);
  }
}

// 2^t on 16 lanes for the probabilities: 2^round(t) by vscalefps times a degree-5 Taylor
// polynomial of 2^f, |f| <= 1/2 (relative error < 2.5e-6, against the 3.9e-3 of the bf16 the
// probabilities are rounded to). A third of exp16's operations, which keeps exp_vec's bits for
// the fp32 path and the silu.
inline __m512 exp2_16(__m512 t) {
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504109e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022651e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

// pb[t] = bf16(exp(s[t] - max)), as 2^(s[t] log2 e - max log2 e), for t in [lo, pos] (max over
// those keys), 0 for the other t < ne. Returns 1 / the fp32 sum of the exps (16 lanes by
// (t - lo) % 16, each in order, then the lanes as a tree).
BF16DOT_TARGET inline float exp_row_bf16(const float* srow, int64_t lo, int64_t pos, int64_t ne,
                                         c10::BFloat16* pb) {
  const int64_t n = pos + 1 - lo;
  const float* e = srow + lo;
  constexpr float LOG2E = 1.44269504f;
  const __m512 l2e = _mm512_set1_ps(LOG2E), m = _mm512_set1_ps(row_max(e, n) * LOG2E);
  std::memset(pb, 0, lo * sizeof(*pb));  // bf16 zeros (std::fill converted the 0 per element)
  __m512 acc = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= n; t += 16) {
    const __m512 x = exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(e + t), l2e, m));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(pb + lo + t), (__m256i)_mm512_cvtneps_pbh(x));
    acc = _mm512_add_ps(acc, x);
  }
  if (t < n) {
    const __mmask16 k = first_lanes(n - t);
    const __m512 x = exp2_16(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(k, e + t), l2e, m));
    _mm256_mask_storeu_epi16(pb + lo + t, k, (__m256i)_mm512_cvtneps_pbh(x));
    acc = _mm512_mask_add_ps(acc, k, acc, x);
  }
  std::memset(pb + pos + 1, 0, (ne - pos - 1) * sizeof(*pb));
  // The lanes as one tree: adding them one by one was a quarter of the function on short rows.
  return 1.f / _mm512_reduce_add_ps(acc);
}

// acc(r) += pairs [0, np) of src for RB rows sharing each pair's load; p(r): the row's bf16
// probabilities from the span's first key, read a pair (one int32) at a time.
template <int NV, int RB, typename Src>
BF16DOT_TARGET inline void pv_pairs_block(float* const* acc, const c10::BFloat16* const* p,
                                          Src&& src, int64_t np) {
  __m512 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_loadu_ps(acc[r] + 16 * i);
  for (int64_t j = 0; j < np; ++j) {
    __m512i v[NV];
    src(j, v);
    for (int r = 0; r < RB; ++r) {
      // A broadcast load, not dpbf16_bcast's asm operand: with it GCC kept the sums in memory.
      const __m512bh pr = (__m512bh)_mm512_set1_epi32(reinterpret_cast<const int32_t*>(p[r])[j]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_dpbf16_ps(a[r][i], (__m512bh)v[i], pr);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[r] + 16 * i, a[r][i]);
}

// RB rows together over the pairs they all see, then each alone over the rest of its own.
template <int NV, int RB, typename Src>
BF16DOT_TARGET inline void pv_pairs_group(float* const* acc, const c10::BFloat16* const* p,
                                          const int64_t* np, Src&& src) {
  int64_t m = np[0];
  for (int i = 1; i < RB; ++i) m = std::min(m, np[i]);
  if (m > 0) pv_pairs_block<NV, RB>(acc, p, src, m);
  for (int i = 0; i < RB; ++i) {
    if (np[i] <= m) continue;
    const c10::BFloat16* pi[1] = {p[i] + 2 * m};
    float* ai[1] = {acc[i]};
    pv_pairs_block<NV, 1>(ai, pi, [&](int64_t j, __m512i* v) { src(j + m, v); }, np[i] - m);
  }
}

// Rows 0..R over a span of key pairs: acc(r) += the pairs of the span the row sees (pairs(r):
// its visible keys rounded up to a pair), prob(r) its probabilities from the span's first key,
// src(j, v) pair j's values. Four rows (D = 64) or two (D = 128) share each pair's load.
template <int NV, typename Acc, typename Prob, typename Pairs, typename Src>
BF16DOT_TARGET inline void accumulate_pairs(int64_t R, Acc&& acc, Prob&& prob, Pairs&& pairs,
                                            Src&& src) {
  constexpr int64_t RB = NV == 4 ? 4 : 2;
  for (int64_t r = 0; r < R; r += RB) {
    const int64_t k = std::min(RB, R - r);
    float* a[RB];
    const c10::BFloat16* p[RB];
    int64_t np[RB];
    for (int64_t i = 0; i < k; ++i) a[i] = acc(r + i), p[i] = prob(r + i), np[i] = pairs(r + i);
    switch (k) {
      case 4:
        if constexpr (RB >= 4) pv_pairs_group<NV, 4>(a, p, np, src);
        break;
      case 3:
        if constexpr (RB >= 3) pv_pairs_group<NV, 3>(a, p, np, src);
        break;
      case 2: pv_pairs_group<NV, 2>(a, p, np, src); break;
      default: pv_pairs_group<NV, 1>(a, p, np, src); break;
    }
  }
}

// A row's output: its interleaved accumulators back in dim order, times inv, rounded to bf16 as
// static_cast rounds (bf16x16_store_cvt).
template <int NV>
BF16DOT_TARGET inline void store_pairs_row(const float* acc, float inv, c10::BFloat16* dst) {
  const __m512i lo = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i hi =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  const __m512 s = _mm512_set1_ps(inv);
  for (int c = 0; c < NV / 2; ++c) {
    const __m512 a = _mm512_loadu_ps(acc + 32 * c), b = _mm512_loadu_ps(acc + 32 * c + 16);
    bf16x16_store_cvt(dst + 32 * c, _mm512_mul_ps(_mm512_permutex2var_ps(a, lo, b), s));
    bf16x16_store_cvt(dst + 32 * c + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, hi, b), s));
  }
}
#endif

}  // namespace
