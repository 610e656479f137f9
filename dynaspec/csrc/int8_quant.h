// Activation quantization for int8_gemm.cpp: each row to int8 in blocks of 32 (llama.cpp's Q8_1
// idea), with the per-group scale, sum and scale * sum the GEMM's group arithmetic reads. The
// AVX-512 path and the scalar loop produce the same bytes (the tests compare them).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include "vec_exp.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#ifndef AVX512_TARGET
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,fma")))
#endif

namespace int8q {

constexpr int QBLK = 32;  // activation quantization block

struct QuantX {  // activations, [M][K] int8 plus per-group facts
  // Row-major (quantize_rows; the AVX2 and scalar tiles read these):
  std::vector<int8_t> q;     // [M][K]
  std::vector<float> d;      // [M][K/G]: the scale of the 32-block the group lies in
  std::vector<float> s;      // [M][K/G]: d * sum(q) over the group (for the minimum term)
  std::vector<int32_t> sum;  // [M][K/G]: sum(q) over the group (for the 8-bit offset)
  // Per block of up to RB rows, rows innermost (quantize_blocks; the AVX-512 tiles read these
  // through the views): q as [K/4][rb] int32, the rest as [K/G][rb].
  std::vector<int32_t> qi, sumi;
  std::vector<float> di, si;
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

// One 32-block as the scalar loop below quantizes it (amax, d = amax / 127, q = clamp(rint(v / d))):
// every step is exact or a single rounding the scalar code also makes, so the bytes are equal.
template <typename T>
AVX512_TARGET void quantize_block_avx512(const T* xb, int8_t* qb, int G, float* d, int32_t* sum) {
  const __m512 v0 = load16f(xb), v1 = load16f(xb + 16);
  const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
  const float dv = amax / 127.f;
  const __m512 id = _mm512_set1_ps(dv > 0.f ? 1.f / dv : 0.f);
  const __m512 hi = _mm512_set1_ps(127.f), lo = _mm512_set1_ps(-127.f);
  auto quant = [&](__m512 v) {
    const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(v, id), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lo), hi));
  };
  const __m512i q0 = quant(v0), q1 = quant(v1);
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

// The scalar quantizer (amax, d = amax / 127, q = clamp(rint(v / d))), row-major.
template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int G, QuantX& out) {
  const int64_t ng = K / G;
  out.q.resize(M * K);
  out.d.resize(M * ng);
  out.s.resize(M * ng);
  out.sum.resize(M * ng);
  at::parallel_for(0, M, 16, [&](int64_t m_begin, int64_t m_end) {
    for (int64_t m = m_begin; m < m_end; ++m) {
      for (int64_t b = 0; b < K / QBLK; ++b) {
        const T* xb = x + m * K + b * QBLK;
        float v[QBLK], amax = 0.f;
        for (int i = 0; i < QBLK; ++i) {
          v[i] = static_cast<float>(xb[i]);
          amax = std::fmax(amax, std::fabs(v[i]));
        }
        const float d = amax / 127.f;
        const float id = d > 0.f ? 1.f / d : 0.f;
        int8_t* qb = out.q.data() + m * K + b * QBLK;
        for (int i = 0; i < QBLK; ++i) {
          float r = std::nearbyint(v[i] * id);
          r = r > 127.f ? 127.f : (r < -127.f ? -127.f : r);
          qb[i] = static_cast<int8_t>(r);
        }
        for (int h = 0; h < QBLK / G; ++h) {
          const int64_t g = b * (QBLK / G) + h;
          int32_t sq = 0;
          for (int i = 0; i < G; ++i) sq += qb[h * G + i];
          out.d[m * ng + g] = d;
          out.sum[m * ng + g] = sq;
          out.s[m * ng + g] = d * static_cast<float>(sq);
        }
      }
    }
  });
}

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
      for (int64_t r = 0; r < rb; ++r) {
        float dv;
        int32_t sum[QBLK / 16];
        quantize_block_avx512(x + (b0 + r) * K + kb * QBLK, reinterpret_cast<int8_t*>(q), G, &dv, sum);
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
  out.qv = out.qi.data(), out.dv = out.di.data(), out.sv = out.si.data(), out.sumv = out.sumi.data();
}

}  // namespace int8q
