// The int8 GEMM's packed weight layout (see int8_gemm.cpp), its scalar reference (the contract
// every vector path meets bit for bit) and the AVX2 / AVX-VNNI tiles. Included by int8_gemm.cpp
// alone, which adds the AVX-512 VNNI tiles and the driver.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include "int8_quant.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

using int8q::QBLK;
using int8q::quantize_blocks;
using int8q::quantize_rows;
using int8q::QuantX;

constexpr int TILE = 16;    // output columns per tile (one zmm of int32 lanes)
constexpr int MAX_RB = 12;  // rows per register block (12 accumulator pairs + 8 other zmm)

struct Packed {
  const uint8_t* w;  // [N/16][K/G][bytes_per_group]
  const void* d;     // [N/16][K/G][16] scale per group and column, fp32 or fp16
  const void* mn;    // [N/16][K/G][16] minimum term per group and column (d's type), or nullptr
  int64_t N, K;
  int G;     // 16 or 32
  int bits;  // 4 or 8
  // fp16 where every scale and minimum is one exactly (GGUF's Q4_0/Q4_1/Q8_0 store them so):
  // at 4 bits fp32 scales and minima were a third of the bytes a decode step streams.
  bool half = false;
  int64_t group_bytes() const { return bits == 4 ? G * TILE / 2 : G * TILE; }
  float scalar_at(const void* a, int64_t i) const {
    if (!half) return static_cast<const float*>(a)[i];
    return static_cast<float>(
        c10::Half(static_cast<const uint16_t*>(a)[i], c10::Half::from_bits()));
  }
};

inline uint16_t to_bf16_bits(float f) {  // round to nearest even, as c10::BFloat16 does
  uint32_t b;
  std::memcpy(&b, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  b += ((b >> 16) & 1u) + 0x7FFFu;
  return static_cast<uint16_t>(b >> 16);
}

// The unsigned weight value of (column c, input j) of group g's packed bytes.
inline int weight_u(const Packed& p, const uint8_t* grp, int c, int j) {
  const int s = j / 4, t = j % 4;
  if (p.bits == 8) return grp[s * 64 + 4 * c + t];
  const int half = p.G / 8;
  const uint8_t byte = grp[(s % half) * 64 + 4 * c + t];
  return s < half ? (byte & 0x0F) : (byte >> 4);
}

// Scalar reference: the contract every vector path meets bit for bit.
void tile_scalar(const Packed& p, const QuantX& qx, int64_t m0, int64_t M, int64_t tile,
                 float* acc /*[M][16]*/) {
  const int64_t ng = p.K / p.G;
  for (int64_t m = 0; m < M; ++m)
    for (int c = 0; c < TILE; ++c) acc[m * TILE + c] = 0.f;
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t gi = tile * ng + g;
    const uint8_t* grp = p.w + gi * p.group_bytes();
    for (int64_t r = 0; r < M; ++r) {
      const int64_t m = m0 + r;
      float* accr = acc + r * TILE;
      const int8_t* xq = qx.q.data() + m * p.K + g * p.G;
      const float dx = qx.d[m * ng + g], sx = qx.s[m * ng + g];
      for (int c = 0; c < TILE; ++c) {
        int32_t dot = 0;
        for (int j = 0; j < p.G; ++j) dot += weight_u(p, grp, c, j) * xq[j];
        if (p.bits == 8) dot -= 128 * qx.sum[m * ng + g];
        float a = std::fma(static_cast<float>(dot), p.scalar_at(p.d, gi * TILE + c) * dx, accr[c]);
        if (p.mn) a = std::fma(p.scalar_at(p.mn, gi * TILE + c), sx, a);
        accr[c] = a;
      }
    }
  }
}

// Group gi's weights, scales and minima into L1. A tile is one contiguous run of memory, so each
// new tile starts a new stream the hardware prefetcher has to detect again: with only the
// hardware to fetch, a step's weights streamed ~2x slower than they do with the next tile's
// groups requested while this one computes (measured: docs/benchmarks.md, eighth session).
// always_inline: GCC counts a function of prefetches alone as free of side effects and deletes
// every call to it (an earlier try at prefetching here measured nothing for that reason).
__attribute__((always_inline)) inline void prefetch_group(const Packed& p, int64_t gi) {
  const uint8_t* w = p.w + gi * p.group_bytes();
  for (int64_t b = 0; b < p.group_bytes(); b += 64) __builtin_prefetch(w + b, 0, 3);
  const int64_t sb = p.half ? 2 : 4;
  __builtin_prefetch(static_cast<const char*>(p.d) + gi * TILE * sb, 0, 3);
  if (p.mn) __builtin_prefetch(static_cast<const char*>(p.mn) + gi * TILE * sb, 0, 3);
}

// ---- AVX2 (with AVX-VNNI where present, else maddubs + madd) -----------------------------------
#define AVX2_TARGET __attribute__((target("avx2,fma,f16c")))

AVX2_TARGET inline __m256 scales8(const Packed& p, const void* a, int64_t i) {
  if (!p.half) return _mm256_loadu_ps(static_cast<const float*>(a) + i);
  return _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a) + i)));
}
#define AVXVNNI_TARGET __attribute__((target("avx2,fma,avxvnni")))

// One tile as two halves of 8 columns. Without VNNI, maddubs adds two u8*s8 products into
// int16: exact for 4-bit weights (2 * 15 * 127 < 32767) but not for 8-bit ones (u up to 255),
// so an 8-bit weight is split into its nibbles, u = 16 * hi + lo, each product exact and the
// int32 dot the same integer (DOT8). On AVX2-only CPUs the tied Q8_0 lm_head took the scalar
// loop: 17.5 of a 24 ms decode step (docs/benchmarks.md, wave 4 second session).
#define DEFINE_TILE_AVX2(NAME, TARGET, DOT4, DOT8)                                              \
  template <int BITS, int G>                                                                    \
  __attribute__((target(TARGET))) void NAME(const Packed& p, const QuantX& qx, int64_t m0,      \
                                            int64_t M, int64_t tile, float* acc) {              \
    constexpr int STEPS = G / 4;                                                                \
    const int64_t ng = p.K / G;                                                                 \
    const __m256i lo = _mm256_set1_epi8(0x0F);                                                  \
    const bool pf = m0 == 0 && tile + 1 < p.N / TILE; /* as rows_avx512: the first pass only */ \
    for (int half = 0; half < 2; ++half) {                                                      \
      for (int64_t r = 0; r < M; ++r) {                                                         \
        const int64_t m = m0 + r;                                                               \
        __m256 facc = _mm256_setzero_ps();                                                      \
        for (int64_t g = 0; g < ng; ++g) {                                                      \
          const int64_t gi = tile * ng + g;                                                     \
          const uint8_t* grp = p.w + gi * p.group_bytes() + half * 32;                          \
          if (half == 0 && r == 0 && pf) prefetch_group(p, gi + ng);                            \
          const int32_t* xq = reinterpret_cast<const int32_t*>(qx.q.data() + m * p.K + g * G);  \
          __m256i idot = _mm256_setzero_si256();                                                \
          for (int s = 0; s < STEPS; ++s) {                                                     \
            __m256i w;                                                                          \
            if (BITS == 4) {                                                                    \
              const __m256i v = _mm256_loadu_si256(                                             \
                  reinterpret_cast<const __m256i*>(grp + (s % (STEPS / 2)) * 64));              \
              w = s < STEPS / 2 ? _mm256_and_si256(v, lo)                                       \
                                : _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);                \
            } else {                                                                            \
              w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + s * 64));           \
            }                                                                                   \
            const __m256i xb = _mm256_set1_epi32(xq[s]);                                        \
            idot = BITS == 4 ? DOT4 : DOT8;                                                     \
          }                                                                                     \
          if (BITS == 8)                                                                        \
            idot = _mm256_sub_epi32(idot, _mm256_set1_epi32(128 * qx.sum[m * ng + g]));         \
          const __m256 scale = _mm256_mul_ps(scales8(p, p.d, gi * TILE + half * 8),             \
                                             _mm256_set1_ps(qx.d[m * ng + g]));                 \
          facc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), scale, facc);                        \
          if (p.mn)                                                                             \
            facc = _mm256_fmadd_ps(scales8(p, p.mn, gi * TILE + half * 8),                      \
                                   _mm256_set1_ps(qx.s[m * ng + g]), facc);                     \
        }                                                                                       \
        _mm256_storeu_ps(acc + r * TILE + half * 8, facc);                                      \
      }                                                                                         \
    }                                                                                           \
  }

DEFINE_TILE_AVX2(tile_avxvnni, "avx2,fma,f16c,avxvnni", _mm256_dpbusd_avx_epi32(idot, w, xb),
                 _mm256_dpbusd_avx_epi32(idot, w, xb))
#define AVX2_DOT(W) _mm256_madd_epi16(_mm256_maddubs_epi16((W), xb), _mm256_set1_epi16(1))
DEFINE_TILE_AVX2(
    tile_avx2, "avx2,fma,f16c", _mm256_add_epi32(idot, AVX2_DOT(w)),
    _mm256_add_epi32(
        idot,
        _mm256_add_epi32(AVX2_DOT(_mm256_and_si256(w, lo)),
                         _mm256_slli_epi32(AVX2_DOT(_mm256_and_si256(_mm256_srli_epi16(w, 4), lo)),
                                           4))))
#undef AVX2_DOT

}  // namespace
