// Activation quantization for int8_gemm.cpp: each row to int8 in blocks of 32 (llama.cpp's Q8_1
// idea), with the per-group scale, sum and scale * sum the GEMM's group arithmetic reads. The
// AVX-512 path and the scalar loop produce the same bytes (the tests compare them).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include "vec_exp.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <memory>
#include <type_traits>
#include <vector>

#ifndef AVX512_TARGET
#define AVX512_TARGET DYNASPEC_TARGET("avx512f,avx512bw,avx512vl,avx512vnni,fma")
#endif

namespace int8q {

constexpr int QBLK = 32;  // activation quantization block

// A buffer every element of which the quantizer writes: unlike std::vector's resize it is not
// zeroed first (at a 2,048-token prefill that was ~3 MB of memset per matmul, on the calling
// thread alone while the other waited).
template <typename T>
class Scratch {
 public:
  void resize(int64_t n) { p_.reset(new T[n]); }  // default-initialised: left as it is
  T* data() { return p_.get(); }
  T& operator[](int64_t i) { return p_[i]; }

 private:
  std::unique_ptr<T[]> p_;
};

struct QuantX {  // activations, [M][K] int8 plus per-group facts
  // Row-major (quantize_rows; the AVX2 and scalar tiles read these):
  std::vector<int8_t> q;     // [M][K]
  std::vector<float> d;      // [M][K/G]: the scale of the 32-block the group lies in
  std::vector<float> s;      // [M][K/G]: d * sum(q) over the group (for the minimum term)
  std::vector<int32_t> sum;  // [M][K/G]: sum(q) over the group (for the 8-bit offset)
  // Per block of up to RB rows, rows innermost (quantize_blocks; the AVX-512 tiles read these
  // through the views): q as [K/4][rb] int32, the rest as [K/G][rb].
  Scratch<int32_t> qi, sumi;
  Scratch<float> di, si;
  const int32_t* qv = nullptr;
  const float* dv = nullptr;
  const float* sv = nullptr;
  const int32_t* sumv = nullptr;
};

template <typename T>
AVX512_TARGET inline __m512 load16f(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_loadu_ps(p);
  } else {
    return bf16x16_load(p);
  }
}

// A block's scale amax / 127, or 0 where that is below the smallest normal float: there 1 / d
// could overflow to inf and a zero times it be NaN, which the vector and scalar clamps then
// turned into different bytes. Such a block (|v| < 1.5e-36) is quantized as zeros.
inline float block_scale(float amax) {
  const float d = amax / 127.f;
  return d >= FLT_MIN ? d : 0.f;
}

// q = clamp(rint(v * id), -127, 127) as int32 lanes. A function, not a lambda in its callers:
// a lambda does not inherit its enclosing function's target attribute, and in a build without
// -mavx512f (the avx2 tag) GCC then refused to inline the AVX-512 intrinsics into it.
AVX512_TARGET inline __m512i quant16(__m512 v, __m512 id) {
  const __m512 r =
      _mm512_roundscale_ps(_mm512_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  return _mm512_cvtps_epi32(
      _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.f)), _mm512_set1_ps(127.f)));
}

// One 32-block as the scalar loop below quantizes it
// (amax, d = amax / 127, q = clamp(rint(v / d))): every step is exact or a single rounding the
// scalar code also makes, so the bytes are equal.
template <typename T>
AVX512_TARGET void quantize_block_avx512(const T* xb, int8_t* qb, int G, float* d, int32_t* sum) {
  const __m512 v0 = load16f(xb), v1 = load16f(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float dv = block_scale(amax);
  const __m512 id = _mm512_set1_ps(dv > 0.f ? 1.f / dv : 0.f);
  const __m512i q0 = quant16(v0, id), q1 = quant16(v1, id);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb), _mm512_cvtsepi32_epi8(q0));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(qb + 16), _mm512_cvtsepi32_epi8(q1));
  *d = dv;
  if (G == 32) {
    sum[0] = _mm512_reduce_add_epi32(_mm512_add_epi32(q0, q1));
  } else {
    sum[0] = _mm512_reduce_add_epi32(q0);
    sum[1] = _mm512_reduce_add_epi32(q1);
  }
}

// 16 x 16 dwords transposed in registers: t[j] lane r = r_in[r] dword j.
AVX512_TARGET inline void transpose16_epi32(const __m512i* in, __m512i* t) {
  __m512i a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(in[i], in[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(in[i], in[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // b[i + c]: rows i..i+3, dwords {c, c+4, c+8, c+12}
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i x0 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0x88);  // rows 0-7: dwords c, c+8
    const __m512i x1 = _mm512_shuffle_i32x4(b[c], b[4 + c], 0xDD);  // rows 0-7: dwords c+4, c+12
    const __m512i y0 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0x88);
    const __m512i y1 = _mm512_shuffle_i32x4(b[8 + c], b[12 + c], 0xDD);
    t[c] = _mm512_shuffle_i32x4(x0, y0, 0x88);
    t[c + 8] = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    t[c + 4] = _mm512_shuffle_i32x4(x1, y1, 0x88);
    t[c + 12] = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}

// One 32-block of each of rb <= 16 bf16 rows (row r at x + r * K), the rows in the vector lanes:
// the same bytes, scales and sums as quantize_block_avx512 row by row (amax exactly, the same
// IEEE divisions and roundings), written straight into the tiles' layout (qo: [8][rb] int32;
// d, s, sum: [32 / G][rb]). Row by row, every block ran two horizontal reductions, two scalar
// divisions in its dependency chain and a store of its bytes read back as dwords for the
// scatter: ~70 cycles a block, 10% of a prefill step. In lanes nothing is horizontal.
AVX512_TARGET inline void quantize_lanes_bf16(const c10::BFloat16* x, int64_t K, int64_t rb, int G,
                                              int32_t* qo, float* d, float* s, int32_t* sum) {
  const __mmask16 live = static_cast<__mmask16>((1u << rb) - 1u);
  __m512i rows[16], t[16];
  for (int64_t r = 0; r < 16; ++r)
    rows[r] = r < rb ? _mm512_loadu_si512(x + r * K) : _mm512_setzero_si512();
  transpose16_epi32(rows, t);  // t[j] lane r: elements 2j (low half) and 2j + 1 of row r
  // |v| of a bf16 orders as its 15 low bits do (finite or inf), so the row's amax is an
  // integer max.
  __m512i m = _mm512_and_si512(t[0], _mm512_set1_epi32(0x7FFF7FFF));
  for (int j = 1; j < 16; ++j)
    m = _mm512_max_epu16(m, _mm512_and_si512(t[j], _mm512_set1_epi32(0x7FFF7FFF)));
  m = _mm512_max_epu32(_mm512_and_si512(m, _mm512_set1_epi32(0xFFFF)), _mm512_srli_epi32(m, 16));
  const __m512 amax = _mm512_castsi512_ps(_mm512_slli_epi32(m, 16));
  __m512 dv = _mm512_div_ps(amax, _mm512_set1_ps(127.f));
  // block_scale
  dv = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(dv, _mm512_set1_ps(FLT_MIN), _CMP_GE_OQ), dv);
  const __m512 id = _mm512_maskz_div_ps(_mm512_cmp_ps_mask(dv, _mm512_setzero_ps(), _CMP_GT_OQ),
                                        _mm512_set1_ps(1.f), dv);
  // Within each 128-bit lane, bytes [e0 r0..r3, e1 r0..r3, e2 .., e3 ..] to [r0 e0..e3, r1 ..].
  const __m512i order =
      _mm512_broadcast_i32x4(_mm_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15));
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sums[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
  for (int st = 0; st < 8; ++st) {  // elements 4st..4st+3: t[2st] and t[2st + 1]
    const __m512i a = t[2 * st], b = t[2 * st + 1];
    const __m512i e0 = quant16(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), id);
    const __m512i e1 =
        quant16(_mm512_castsi512_ps(_mm512_and_si512(a, _mm512_set1_epi32(0xFFFF0000u))), id);
    const __m512i e2 = quant16(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), id);
    const __m512i e3 =
        quant16(_mm512_castsi512_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xFFFF0000u))), id);
    // |q| <= 127: the saturating packs are exact.
    const __m512i p = _mm512_shuffle_epi8(
        _mm512_packs_epi16(_mm512_packs_epi32(e0, e1), _mm512_packs_epi32(e2, e3)), order);
    _mm512_mask_storeu_epi32(qo + st * rb, live, p);
    sums[G == 16 ? st / 4 : 0] = _mm512_dpbusd_epi32(sums[G == 16 ? st / 4 : 0], ones, p);
  }
  for (int h = 0; h < QBLK / G; ++h) {
    _mm512_mask_storeu_ps(d + h * rb, live, dv);
    _mm512_mask_storeu_epi32(sum + h * rb, live, sums[h]);
    _mm512_mask_storeu_ps(s + h * rb, live, _mm512_mul_ps(dv, _mm512_cvtepi32_ps(sums[h])));
  }
}

// The sum of 8 int32 lanes (a function: a lambda would not inherit the caller's target).
DYNASPEC_TARGET("avx2") inline int32_t hsum8_epi32(__m256i a) {
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  return _mm_cvtsi128_si32(t);
}

// One 32-block as quantize_rows' scalar loop quantizes it, with AVX2 (the tiles of the AVX2 and
// AVX-VNNI paths read these): |v| and its maximum are exact in any order, d and 1 / d are the
// scalar's own divisions, and v * id, its rounding to nearest even and the clamp are each one
// IEEE step, so the bytes, scales and sums are the scalar's.
template <typename T>
DYNASPEC_TARGET("avx2,fma,f16c")
inline void quantize_block_avx2(const T* xb, int8_t* qb, int G, float* d, int32_t* sum) {
  __m256 v[4];
  for (int j = 0; j < 4; ++j) {
    if constexpr (std::is_same_v<T, float>) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
    } else {
      v[j] = bf16x8_load(xb + 8 * j);
    }
  }
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 m =
      _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                    _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
  __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  h = _mm_max_ps(h, _mm_movehl_ps(h, h));
  h = _mm_max_ss(h, _mm_movehdup_ps(h));
  const float dv = block_scale(_mm_cvtss_f32(h));
  const __m256 id = _mm256_set1_ps(dv > 0.f ? 1.f / dv : 0.f);
  __m256i q[4];
  for (int j = 0; j < 4; ++j) {
    const __m256 r =
        _mm256_round_ps(_mm256_mul_ps(v[j], id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q[j] = _mm256_cvtps_epi32(
        _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.f)), _mm256_set1_ps(127.f)));
  }
  // packs interleave the 128-bit lanes: dword i of the result holds bytes 4k..4k+3 of q[j]
  // for (j, k) = (i % 4, i / 4); the permutation puts them back in order.
  const __m256i b =
      _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  *d = dv;
  if (G == 32) {
    sum[0] =
        hsum8_epi32(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
  } else {
    sum[0] = hsum8_epi32(_mm256_add_epi32(q[0], q[1]));
    sum[1] = hsum8_epi32(_mm256_add_epi32(q[2], q[3]));
  }
}

// One 32-block as the reference quantizes it (amax, d = amax / 127, q = clamp(rint(v / d))),
// with its scale and the sum of each group's values: the contract the vector blocks meet.
template <typename T>
inline void quantize_block_scalar(const T* xb, int8_t* qb, int G, float* d, int32_t* sum) {
  float v[QBLK], amax = 0.f;
  for (int i = 0; i < QBLK; ++i) {
    v[i] = static_cast<float>(xb[i]);
    amax = std::fmax(amax, std::fabs(v[i]));
  }
  *d = block_scale(amax);
  const float id = *d > 0.f ? 1.f / *d : 0.f;
  for (int i = 0; i < QBLK; ++i) {
    float r = std::nearbyint(v[i] * id);
    r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
    qb[i] = static_cast<int8_t>(r);
  }
  for (int h = 0; h < QBLK / G; ++h) {
    sum[h] = 0;
    for (int i = 0; i < G; ++i) sum[h] += qb[h * G + i];
  }
}

// Row-major activations for the scalar reference (avx2 false: the contract) and the AVX2 /
// AVX-VNNI tiles (avx2 true: quantize_block_avx2, the same bytes; the scalar loop was ~6% of a
// width-9 verify step on an AVX2-only CPU, and at fewer than 16 rows one thread ran it alone).
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int G, QuantX& out, bool avx2 = false) {
  const int64_t ng = K / G;
  out.q.resize(M * K);
  out.d.resize(M * ng);
  out.s.resize(M * ng);
  out.sum.resize(M * ng);
  at::parallel_for(0, M, 16, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      for (int64_t b = 0; b < K / QBLK; ++b) {
        const T* xb = x + m * K + b * QBLK;
        int8_t* qb = out.q.data() + m * K + b * QBLK;
        float d;
        int32_t sq[QBLK / 16];
        if (avx2) {
          quantize_block_avx2(xb, qb, G, &d, sq);
        } else {
          quantize_block_scalar(xb, qb, G, &d, sq);
        }
        for (int h = 0; h < QBLK / G; ++h) {
          const int64_t g = b * (QBLK / G) + h;
          out.d[m * ng + g] = d;
          out.sum[m * ng + g] = sq[h];
          out.s[m * ng + g] = d * static_cast<float>(sq[h]);
        }
      }
    }
  });
}

// Row blocks of at least this many rows go through quantize_lanes_bf16 (fewer leave most
// lanes idle).
constexpr int64_t LANES_MIN_ROWS = 4;

// The AVX-512 tiles' activations: the same bytes as quantize_rows, written straight into blocks
// of up to RB rows with the rows innermost, so a tile addresses all its rows through one
// register (with a pointer per row, 8 rows left too few general registers). One 32-block of
// one block of rows is a work item: a verify step's 9 rows of K = 576 are 18 items both threads
// share (quantized row by row, then copied to the block layout, they were serial work the other
// thread waited through at every matmul). A lone row is its own block layout.
template <typename T>
void quantize_blocks(const T* x, int64_t M, int64_t K, int G, int64_t RB, QuantX& out) {
  const int64_t ng = K / G, nk = K / QBLK, nblocks = (M + RB - 1) / RB;
  out.qi.resize(M * K / 4);
  out.di.resize(M * ng);
  out.si.resize(M * ng);
  out.sumi.resize(M * ng);
  // ~100 row-blocks of 32 per task: below that the fork and join cost more than they save.
  const int64_t grain = std::max<int64_t>(1, 96 / std::min(M, RB));
  at::parallel_for(0, nblocks * nk, grain, [&](int64_t begin, int64_t end) {
    alignas(64) int32_t q[QBLK / 4];
    for (int64_t it = begin; it < end; ++it) {
      const int64_t b0 = it / nk * RB, kb = it % nk, rb = std::min(RB, M - b0);
      int32_t* qo = out.qi.data() + b0 * K / 4 + kb * (QBLK / 4) * rb;
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (rb >= LANES_MIN_ROWS && rb <= 16) {
          const int64_t at = b0 * ng + kb * (QBLK / G) * rb;
          quantize_lanes_bf16(x + b0 * K + kb * QBLK, K, rb, G, qo, out.di.data() + at,
                              out.si.data() + at, out.sumi.data() + at);
          continue;
        }
      }
      for (int64_t r = 0; r < rb; ++r) {
        float dv;
        int32_t sum[QBLK / 16];
        quantize_block_avx512(x + (b0 + r) * K + kb * QBLK, reinterpret_cast<int8_t*>(q), G, &dv,
                              sum);
        for (int j = 0; j < QBLK / 4; ++j) qo[j * rb + r] = q[j];
        for (int h = 0; h < QBLK / G; ++h) {
          const int64_t at = b0 * ng + (kb * (QBLK / G) + h) * rb + r;
          out.di[at] = dv;
          out.sumi[at] = sum[h];
          out.si[at] = dv * static_cast<float>(sum[h]);
        }
      }
    }
  });
  out.qv = out.qi.data(), out.dv = out.di.data(), out.sv = out.si.data(),
  out.sumv = out.sumi.data();
}

}  // namespace int8q
