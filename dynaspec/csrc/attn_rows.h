// Per-row pieces of the paged attention kernel (paged_decode.cpp): bf16 dot-product scores,
// the value accumulation, the row max and the shifted exp. Each is one fixed sequence of operations
// per row, which is what keeps a row's result independent of its step, tile and batch.
#pragma once

#include <torch/extension.h>

#include "attn_tree.h"
#include "row_max.h"
#include "vec_exp.h"

#include "simd.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

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
#define BF16DOT_TARGET DYNASPEC_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")
// Run only on the attention.avx512_bf16 path (dynaspec/cpu_features.py), where the CPU has them.

// out lane t = the 16 lanes of a[t] summed as ((b0 + b1) + (b2 + b3)) over 128-bit blocks bk,
// each block as ((l0 + l2) + (l1 + l3)).
BF16DOT_TARGET inline __m512 reduce16(const __m512* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int j = 0; j < 4; ++j) {
    const __m512d u = _mm512_castps_pd(x[2 * j]), w = _mm512_castps_pd(x[2 * j + 1]);
    y[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, w)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(u, w)));
  }
  const __m512 w0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 w1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xDD));
}

// s[t] = scale * q . k_t for the n <= 16 keys at k0 + t * stride (bf16, D % 32 == 0).
BF16DOT_TARGET void scores16_bf16(const c10::BFloat16* q, const c10::BFloat16* k0, int64_t stride,
                                  int64_t n, int64_t D, float scale, float* s) {
  __m512 a[KEY_LANES];
  for (int64_t t = 0; t < KEY_LANES; ++t) {
    a[t] = _mm512_setzero_ps();
    if (t >= n) continue;
    const c10::BFloat16* k = k0 + t * stride;
    for (int64_t c = 0; c < D; c += 32)
      a[t] = _mm512_dpbf16_ps(a[t], (__m512bh)_mm512_loadu_si512(q + c),
                              (__m512bh)_mm512_loadu_si512(k + c));
  }
  const __m512 f = _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale));
  _mm512_mask_storeu_ps(s, static_cast<__mmask16>((1u << n) - 1u), f);
}

// scores16_bf16 for a full group of 16 keys with D = 32 * NC known at compile time: the same
// operations in the same order (so the same bits), but the chunk loop unrolled, q held in
// registers and the 16 keys' chains independent. The generic loop ran each key's chain behind
// a runtime trip count and spilled the sums: ~3x the cycles.
template <int NC>
BF16DOT_TARGET void scores16_bf16_full(const c10::BFloat16* q, const c10::BFloat16* k0,
                                       int64_t stride, float scale, float* s) {
  __m512bh qv[NC];
  for (int c = 0; c < NC; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + 32 * c);
  __m512 a[KEY_LANES];
#pragma GCC unroll 16
  for (int64_t t = 0; t < KEY_LANES; ++t) {
    const c10::BFloat16* k = k0 + t * stride;
    a[t] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
    for (int c = 1; c < NC; ++c)
      a[t] = _mm512_dpbf16_ps(a[t], qv[c], (__m512bh)_mm512_loadu_si512(k + 32 * c));
  }
  _mm512_storeu_ps(s, _mm512_mul_ps(reduce16(a), _mm512_set1_ps(scale)));
}

// s[t] for n <= 16 keys: the fixed-D path where D and n allow (a lane's sum depends on its key
// alone, so both paths give the same bits), else the generic loop.
BF16DOT_TARGET inline void scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k0,
                                       int64_t stride, int64_t n, int64_t D, float scale,
                                       float* s) {
  if (n == KEY_LANES) {
    switch (D) {
      case 64: return scores16_bf16_full<2>(q, k0, stride, scale, s);
      case 128: return scores16_bf16_full<4>(q, k0, stride, scale, s);
      default: break;
    }
  }
  scores16_bf16(q, k0, stride, n, D, scale, s);
}

// Row i of a 16 x 16 block of 32-bit values to column i of out (out[c * 16 + i] = r[i] lane c).
// Only data moves (the lanes may hold fp32 or bf16 pairs alike).
DYNASPEC_TARGET("avx512f") inline void transpose16x16(const __m512* r, float* out) {
  __m512 t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + c]: rows i..i+3, columns {c, c+4, c+8, c+12}
    u[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    u[i + 1] =
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    u[i + 2] = _mm512_castpd_ps(
        _mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    u[i + 3] = _mm512_castpd_ps(
        _mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  for (int c = 0; c < 4; ++c) {
    const __m512 x0 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0x88);  // rows 0-7: cols c, c+8
    const __m512 x1 = _mm512_shuffle_f32x4(u[c], u[4 + c], 0xDD);  // rows 0-7: cols c+4, c+12
    const __m512 y0 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0x88);
    const __m512 y1 = _mm512_shuffle_f32x4(u[8 + c], u[12 + c], 0xDD);
    _mm512_storeu_ps(out + c * 16, _mm512_shuffle_f32x4(x0, y0, 0x88));
    _mm512_storeu_ps(out + (c + 8) * 16, _mm512_shuffle_f32x4(x0, y0, 0xDD));
    _mm512_storeu_ps(out + (c + 4) * 16, _mm512_shuffle_f32x4(x1, y1, 0x88));
    _mm512_storeu_ps(out + (c + 12) * 16, _mm512_shuffle_f32x4(x1, y1, 0xDD));
  }
}

// ---- Scores for many rows over the same keys ----------------------------------------------------
// A prefill tile's 96 rows (32 tokens x 3 heads) score the same keys: reduce16 per row and key
// group was ~40% of their score instructions. The key pairs are transposed once for the rows
// instead, and each row runs the same operations as scores_bf16 with keys in the lanes: lane L's
// chain (pairs L, L + 16, ... in order) for all 16 keys at once, then reduce16's tree as vertical
// adds ((l0 + l2) + (l1 + l3) per 128-bit block, (b0 + b1) + (b2 + b3)). Same values, same
// operations, so the same bits as a row scored alone.

// kt[j * 16 + t] = pair j (elements 2j, 2j + 1) of key t (at k0 + t * stride) for j < D / 2;
// keys n.. zero.
BF16DOT_TARGET inline void transpose_key_pairs(const c10::BFloat16* k0, int64_t stride, int64_t n,
                                               float* kt, int64_t D) {
  for (int64_t j0 = 0; j0 < D / 2; j0 += 16) {
    __m512 r[16];
    for (int64_t i = 0; i < 16; ++i)
      r[i] = i < n ? _mm512_castsi512_ps(_mm512_loadu_si512(k0 + i * stride + 2 * j0))
                   : _mm512_setzero_ps();
    transpose16x16(r, kt + j0 * 16);
  }
}

// acc += k . broadcast(*q) (one bf16 pair to every lane): the pair as the instruction's embedded
// broadcast, which GCC does not fold from _mm512_set1_epi32. Which operand holds q does not
// matter: each lane adds its two exact products in the same order either way.
BF16DOT_TARGET inline __m512 dpbf16_bcast(__m512 acc, __m512bh k, const int32_t* q) {
#if defined(DYNASPEC_EMULATED)  // the instruction's operation, through the intrinsic
  return _mm512_dpbf16_ps(acc, k, (__m512bh)_mm512_set1_epi32(*q));
#else
  asm("vdpbf16ps %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(k), "m"(*q));
  return acc;
#endif
}

// s(r)[t] = scale * q(r) . k_t for R rows and the n <= 16 keys of kt (D = 32 * NC), row r's
// scores at s0 + r * ld. part: [4][R][16] scratch for the 128-bit blocks' sums.
template <int NC, typename QRow>
BF16DOT_TARGET void scores_rows_bf16(const float* kt, int64_t R, QRow&& qrow, float* s0, int64_t ld,
                                     int64_t n, float scale, float* part) {
  const __mmask16 m = static_cast<__mmask16>((1u << n) - 1u);
  if constexpr (NC == 2) {
    // D = 64: two 128-bit blocks a pass (16 key registers), so a row's blocks b0 + b1 wait in
    // part for b2 + b3 rather than all four blocks going through it: four stores and reloads
    // a row and key group were a third of the pass's instructions besides the dot products.
    for (int half = 0; half < 2; ++half) {
      __m512bh kv[2][NC][4];  // pairs 16c + 4bk + l of the 16 keys, bk = 2 * half + i
      for (int i = 0; i < 2; ++i)
        for (int c = 0; c < NC; ++c)
          for (int l = 0; l < 4; ++l)
            kv[i][c][l] = (__m512bh)_mm512_loadu_ps(kt + (16 * c + 4 * (2 * half + i) + l) * 16);
      for (int64_t r = 0; r < R; ++r) {
        const int32_t* qd = reinterpret_cast<const int32_t*>(qrow(r));  // q's pairs
        __m512 blk[2];
        for (int i = 0; i < 2; ++i) {
          const int bk = 2 * half + i;
          __m512 a[4];
          for (int l = 0; l < 4; ++l) {
            a[l] = dpbf16_bcast(_mm512_setzero_ps(), kv[i][0][l], qd + 4 * bk + l);
            for (int c = 1; c < NC; ++c)
              a[l] = dpbf16_bcast(a[l], kv[i][c][l], qd + 16 * c + 4 * bk + l);
          }
          blk[i] = _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3]));
        }
        const __m512 pair = _mm512_add_ps(blk[0], blk[1]);  // b0 + b1, then b2 + b3
        if (half == 0) {
          _mm512_storeu_ps(part + r * 16, pair);
        } else {
          const __m512 sum = _mm512_add_ps(_mm512_loadu_ps(part + r * 16), pair);
          _mm512_mask_storeu_ps(s0 + r * ld, m, _mm512_mul_ps(sum, _mm512_set1_ps(scale)));
        }
      }
    }
    return;
  }
  for (int bk = 0; bk < 4; ++bk) {
    __m512bh kv[NC][4];  // pairs 16c + 4bk + l of the 16 keys
    for (int c = 0; c < NC; ++c)
      for (int l = 0; l < 4; ++l)
        kv[c][l] = (__m512bh)_mm512_loadu_ps(kt + (16 * c + 4 * bk + l) * 16);
    for (int64_t r = 0; r < R; ++r) {
      const int32_t* qd = reinterpret_cast<const int32_t*>(qrow(r));  // q's pairs
      __m512 a[4];
      for (int l = 0; l < 4; ++l) {
        a[l] = dpbf16_bcast(_mm512_setzero_ps(), kv[0][l], qd + 4 * bk + l);
        for (int c = 1; c < NC; ++c) a[l] = dpbf16_bcast(a[l], kv[c][l], qd + 16 * c + 4 * bk + l);
      }
      _mm512_storeu_ps(part + (bk * R + r) * 16,
                       _mm512_add_ps(_mm512_add_ps(a[0], a[2]), _mm512_add_ps(a[1], a[3])));
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float* p = part + r * 16;
    const __m512 b01 = _mm512_add_ps(_mm512_loadu_ps(p), _mm512_loadu_ps(p + R * 16));
    const __m512 b23 =
        _mm512_add_ps(_mm512_loadu_ps(p + 2 * R * 16), _mm512_loadu_ps(p + 3 * R * 16));
    _mm512_mask_storeu_ps(s0 + r * ld, m,
                          _mm512_mul_ps(_mm512_add_ps(b01, b23), _mm512_set1_ps(scale)));
  }
}

#if defined(DYNASPEC_AVX512)
// 16 values of a value row as fp32: fp32 rows as they are, bf16 rows widened exactly.
template <typename VT>
inline __m512 vload16(const VT* p) {
  if constexpr (std::is_same_v<VT, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return bf16x16_load(p);
  }
}

// acc[0..16*NV) += p[t] * v[t] for t < n in order (row t at v + t * vs), the sums kept in
// registers across keys (the plain loop stored them back for every key).
template <int NV, typename VT>
inline void pv_rows(float* __restrict acc, const float* __restrict p, const VT* __restrict v,
                    int64_t vs, int64_t n) {
  __m512 a[NV];
  for (int i = 0; i < NV; ++i) a[i] = _mm512_loadu_ps(acc + 16 * i);
  for (int64_t t = 0; t < n; ++t) {
    const __m512 pt = _mm512_set1_ps(p[t]);
    for (int i = 0; i < NV; ++i) a[i] = _mm512_fmadd_ps(pt, vload16(v + t * vs + i * 16), a[i]);
  }
  for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc + 16 * i, a[i]);
}

// pv_rows for RB rows over the same n values: each value vector is loaded once for all RB rows
// and the sums stay in registers for the block; every row's sums run in the same order as alone.
template <int NV, int RB, typename VT>
inline void pv_rows_block(float* const* acc, const float* const* p, const VT* __restrict v,
                          int64_t vs, int64_t n) {
  __m512 a[RB][NV];
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) a[r][i] = _mm512_loadu_ps(acc[r] + 16 * i);
  for (int64_t t = 0; t < n; ++t) {
    __m512 vt[NV];
    for (int i = 0; i < NV; ++i) vt[i] = vload16(v + t * vs + i * 16);
    for (int r = 0; r < RB; ++r) {
      const __m512 pr = _mm512_set1_ps(p[r][t]);
      for (int i = 0; i < NV; ++i) a[r][i] = _mm512_fmadd_ps(pr, vt[i], a[r][i]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int i = 0; i < NV; ++i) _mm512_storeu_ps(acc[r] + 16 * i, a[r][i]);
}
#endif

// acc += sum_t p[t] * v[t] (t < n, in order; fp32 rows of D): on the AVX-512 path (v512) in
// registers by fma where D allows, else acc + p * v as plain loops (the fp32 path's rounding).
inline void accumulate_v(float* acc, const float* p, const float* v, int64_t n, int64_t D,
                         bool v512) {
#if defined(DYNASPEC_AVX512)
  if (v512) switch (D) {
      case 64: return pv_rows<4>(acc, p, v, D, n);
      case 128: return pv_rows<8>(acc, p, v, D, n);
      case 256: return pv_rows<16>(acc, p, v, D, n);
      default: break;
    }
#endif
  axpy_rows(acc, p, v, n, D);
}

#if defined(DYNASPEC_AVX512)
// RB rows over the values they all see, together; the rest of a longer row alone after them.
template <int NV, int RB, typename VT>
inline void pv_group(float* const* a, const float* const* p, const int64_t* seen, const VT* v,
                     int64_t vs) {
  int64_t m = seen[0];
  for (int i = 1; i < RB; ++i) m = std::min(m, seen[i]);
  if (m > 0) pv_rows_block<NV, RB>(a, p, v, vs, m);
  for (int i = 0; i < RB; ++i)
    if (seen[i] > m) pv_rows<NV>(a[i], p[i] + m, v + m * vs, vs, seen[i] - m);
}
#endif

// Rows 0..R of one block: acc(r) += sum_t prob(r)[t] * v[t] over t < seen(r), in order (value row
// t at v + t * vs: fp32 rows converted once for many query rows, or bf16 rows read from the cache
// as they are). Up to four rows (D = 64) or two (D = 128) at a time share each value load, and
// the sums stay in registers for the block (two rows at a time took 42 us where four take 23, for
// 15 rows x 512 keys x 3 heads on one core). False: D has no block path (the caller goes row by
// row).
template <typename VT, typename Acc, typename Prob, typename Seen>
inline bool accumulate_v_rows(int64_t R, Acc&& acc, Prob&& prob, Seen&& seen, const VT* v,
                              int64_t vs, int64_t D) {
#if defined(DYNASPEC_AVX512)
  if (D != 64 && D != 128) return false;
  const int64_t rb = D == 64 ? 4 : 2;
  for (int64_t r = 0; r < R; r += rb) {
    const int64_t k = std::min(rb, R - r);
    float* a[4];
    const float* p[4];
    int64_t s[4];
    for (int64_t i = 0; i < k; ++i) {
      a[i] = acc(r + i);
      p[i] = prob(r + i);
      s[i] = seen(r + i);
    }
    if (D == 128) {
      if (k == 2) pv_group<8, 2>(a, p, s, v, vs);
      else pv_group<8, 1>(a, p, s, v, vs);
      continue;
    }
    switch (k) {
      case 4: pv_group<4, 4>(a, p, s, v, vs); break;
      case 3: pv_group<4, 3>(a, p, s, v, vs); break;
      case 2: pv_group<4, 2>(a, p, s, v, vs); break;
      default: pv_group<4, 1>(a, p, s, v, vs); break;
    }
  }
  return true;
#else
  return false;
#endif
}

// e[t] = exp(e[t] - mx) for t < n, and their sum: in 16 lanes by t % 16 (each lane in order of
// t), then the lanes in order. Fixed by n alone, never by the buffer's alignment (which differs
// between tiles).
inline float exp_shifted_sum(float* e, int64_t n, float mx) {
  float lanes[16] = {0.f};
  int64_t t = 0;
#if defined(DYNASPEC_AVX512)
  // The rows' last n % 16 keys (7.5 on average: a prefill tile's rows end at every position)
  // as a masked vector too: the scalar exps of those tails cost as much as the vector ones.
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; t + 16 <= n; t += 16) {
    const __m512 x = exp16(_mm512_sub_ps(_mm512_loadu_ps(e + t), m));
    _mm512_storeu_ps(e + t, x);
    acc = _mm512_add_ps(acc, x);
  }
  if (t < n) {
    const __mmask16 k = first_lanes(n - t);
    const __m512 x = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, e + t), m));
    _mm512_mask_storeu_ps(e + t, k, x);
    acc = _mm512_mask_add_ps(acc, k, acc, x);  // lanes past n keep their sums
  }
  _mm512_storeu_ps(lanes, acc);
#else
  for (; t < n; ++t) {
    e[t] = exp_vec(e[t] - mx);
    lanes[t % 16] += e[t];
  }
#endif
  float sum = 0.f;
  for (int l = 0; l < 16; ++l) sum += lanes[l];
  return sum;
}

// The softmax of one score row over its visible keys [lo, pos]; every other key gets 0.
inline void softmax_row(float* srow, int64_t Ct, int64_t lo, int64_t pos) {
  const int64_t n = pos + 1 - lo;
  float* e = srow + lo;
  const float inv = 1.f / exp_shifted_sum(e, n, row_max(e, n));
  std::fill(srow, e, 0.f);
  int64_t t = 0;
#if defined(DYNASPEC_AVX512)
  const __m512 v = _mm512_set1_ps(inv);
  for (; t + 16 <= n; t += 16) _mm512_storeu_ps(e + t, _mm512_mul_ps(_mm512_loadu_ps(e + t), v));
  if (t < n) {
    const __mmask16 k = first_lanes(n - t);
    _mm512_mask_storeu_ps(e + t, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, e + t), v));
    t = n;
  }
#endif
  for (; t < n; ++t) e[t] *= inv;
  std::fill(srow + pos + 1, srow + Ct, 0.f);
}

inline void softmax_row_tree(float* srow, int64_t Ct, int64_t pos, int64_t step0,
                             const uint8_t* visible, int64_t window, std::vector<float>& packed) {
  softmax_tree_row(srow, Ct, pos, step0, visible, window, packed,
                   [](float* p, int64_t n) { softmax_row(p, n, 0, n - 1); });
}

}  // namespace
