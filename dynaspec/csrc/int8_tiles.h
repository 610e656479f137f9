// The int8 GEMM's packed weight layout (see int8_gemm.cpp), its scalar reference (the contract
// every vector path meets bit for bit) and the AVX2 / AVX-VNNI tiles. Included by int8_gemm.cpp
// alone, which adds the AVX-512 VNNI tiles and the driver.
#pragma once

#include <torch/extension.h>

#include "simd.h"

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
// groups requested while this one computes (measured: docs/history/benchmarks-waves-1-4.md,
// eighth session).
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
#define AVX2_TARGET DYNASPEC_TARGET("avx2,fma,f16c")

AVX2_TARGET inline __m256 scales8(const Packed& p, const void* a, int64_t i) {
  if (!p.half) return _mm256_loadu_ps(static_cast<const float*>(a) + i);
  return _mm256_cvtph_ps(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(a) + i)));
}

// 4 int8 activations to every lane (a function: a lambda would not inherit the tile's target).
__attribute__((always_inline)) AVX2_TARGET inline __m256i bcast4(const int8_t* x) {
  int32_t v;
  std::memcpy(&v, x, 4);
  return _mm256_set1_epi32(v);
}

// A tile as two halves of 8 columns, each in register blocks of up to RB rows: a step's weights
// are loaded and unpacked once for the block's rows, and the rows' dot products are independent
// chains. (One row at a time, each row reloaded and unpacked every step and ran one dependent
// chain: a verify row cost ~40% of a 1-row step on the AVX2 machine of wave 4.)
//
// Without VNNI, maddubs adds two u8*s8 products into int16: exact for 4-bit weights
// (2 * 15 * 127 = 3,810), so a group's G/4 <= 8 steps add in int16 (<= 30,480 < 32,767) and widen
// once per group (madd with ones). 8-bit weights (u up to 255) would saturate maddubs, so each is
// split into its nibbles, u = 16 * hi + lo, each product exact, and the int32 dot is the same
// integer (hi and lo kept apart in int16). The tied Q8_0 lm_head took the scalar loop on
// AVX2-only CPUs before: 17.5 of a 24 ms decode step (docs/history/benchmarks-waves-1-4.md,
// wave 4 second session).
// The float sequence per row is the scalar reference's, so the bits are its bits.
#define AVX2_MADD(W) _mm256_maddubs_epi16((W), xb)
#define DEFINE_BLOCK_AVX2(NAME, TARGET, VNNI)                                                      \
  template <int RB, int BITS, int G, bool MN>                                                      \
  DYNASPEC_TARGET(TARGET)                                                                          \
  void NAME(const Packed& p, const QuantX& qx, int64_t m0, int64_t tile, int half, float* acc,     \
            bool pf) {                                                                             \
    constexpr int STEPS = G / 4, HALF = STEPS / 2;                                                 \
    const int64_t ng = p.K / G;                                                                    \
    const __m256i lo = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);                        \
    const int8_t* xrow = qx.q.data() + m0 * p.K;                                                   \
    __m256 facc[RB];                                                                               \
    _Pragma("GCC unroll 8") for (int r = 0; r < RB; ++r) facc[r] = _mm256_setzero_ps();            \
    for (int64_t g = 0; g < ng; ++g) {                                                             \
      const int64_t gi = tile * ng + g;                                                            \
      const uint8_t* grp = p.w + gi * p.group_bytes() + half * 32;                                 \
      if (pf) prefetch_group(p, gi + ng);                                                          \
      __m256i a[RB], b[RB]; /* b: the high nibbles' sums (8-bit weights without VNNI) */           \
      _Pragma("GCC unroll 8") for (int r = 0; r < RB; ++r) a[r] = b[r] = _mm256_setzero_si256();   \
      _Pragma("GCC unroll 8") for (int s = 0; s < (BITS == 4 ? HALF : STEPS); ++s) {               \
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + s * 64));      \
        const __m256i wl = _mm256_and_si256(v, lo);                                                \
        const __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);                          \
        _Pragma("GCC unroll 8") for (int r = 0; r < RB; ++r) {                                     \
          if (VNNI) {                                                                              \
            if (BITS == 8) {                                                                       \
              a[r] = DPBUSD(a[r], v, bcast4(xrow + r * p.K + g * G + 4 * s));                      \
            } else {                                                                               \
              a[r] = DPBUSD(a[r], wl, bcast4(xrow + r * p.K + g * G + 4 * s));                     \
              a[r] = DPBUSD(a[r], wh, bcast4(xrow + r * p.K + g * G + 4 * (s + HALF)));            \
            }                                                                                      \
          } else if (BITS == 8) {                                                                  \
            const __m256i xb = bcast4(xrow + r * p.K + g * G + 4 * s);                             \
            a[r] = _mm256_add_epi16(a[r], AVX2_MADD(wl));                                          \
            b[r] = _mm256_add_epi16(b[r], AVX2_MADD(wh));                                          \
          } else {                                                                                 \
            __m256i xb = bcast4(xrow + r * p.K + g * G + 4 * s);                                   \
            a[r] = _mm256_add_epi16(a[r], AVX2_MADD(wl));                                          \
            xb = bcast4(xrow + r * p.K + g * G + 4 * (s + HALF));                                  \
            a[r] = _mm256_add_epi16(a[r], AVX2_MADD(wh));                                          \
          }                                                                                        \
        }                                                                                          \
      }                                                                                            \
      const __m256 dw = scales8(p, p.d, gi * TILE + half * 8);                                     \
      __m256 mw = _mm256_setzero_ps();                                                             \
      if (MN) mw = scales8(p, p.mn, gi * TILE + half * 8);                                         \
      _Pragma("GCC unroll 8") for (int r = 0; r < RB; ++r) {                                       \
        const int64_t m = m0 + r;                                                                  \
        __m256i idot = a[r];                                                                       \
        if (!VNNI && BITS == 4) idot = _mm256_madd_epi16(a[r], ones);                              \
        if (!VNNI && BITS == 8)                                                                    \
          idot = _mm256_add_epi32(_mm256_madd_epi16(a[r], ones),                                   \
                                  _mm256_slli_epi32(_mm256_madd_epi16(b[r], ones), 4));            \
        if (BITS == 8) idot = _mm256_sub_epi32(idot, _mm256_set1_epi32(128 * qx.sum[m * ng + g])); \
        const __m256 scale = _mm256_mul_ps(dw, _mm256_set1_ps(qx.d[m * ng + g]));                  \
        facc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(idot), scale, facc[r]);                       \
        if (MN) facc[r] = _mm256_fmadd_ps(mw, _mm256_set1_ps(qx.s[m * ng + g]), facc[r]);          \
      }                                                                                            \
    }                                                                                              \
    _Pragma("GCC unroll 8") for (int r = 0; r < RB; ++r)                                           \
        _mm256_storeu_ps(acc + r * TILE + half * 8, facc[r]);                                      \
  }

#define DPBUSD(A, W, X) _mm256_dpbusd_avx_epi32((A), (W), (X))
DEFINE_BLOCK_AVX2(block_avxvnni, "avx2,fma,f16c,avxvnni", true)
#undef DPBUSD
#define DPBUSD(A, W, X) (A)  // not reached: VNNI is false
DEFINE_BLOCK_AVX2(block_avx2, "avx2,fma,f16c", false)
#undef DPBUSD
#undef AVX2_MADD

constexpr int RB_AVX2 = 4;  // 4 rows: 8 accumulators (+4 for 8-bit) and 4 for weights fit 16 ymm

// M rows of a tile in register blocks; pf as rows_avx512: the first pass over the tile only.
#define DEFINE_TILE_AVX2(NAME, BLOCK, TARGET)                                                     \
  template <int BITS, int G, bool MN>                                                             \
  DYNASPEC_TARGET(TARGET)                                                                         \
  void NAME(const Packed& p, const QuantX& qx, int64_t m0, int64_t M, int64_t tile, float* acc) { \
    const bool pf = m0 == 0 && tile + 1 < p.N / TILE;                                             \
    for (int half = 0; half < 2; ++half) {                                                        \
      int64_t r = 0;                                                                              \
      for (; r + RB_AVX2 <= M; r += RB_AVX2)                                                      \
        BLOCK<RB_AVX2, BITS, G, MN>(p, qx, m0 + r, tile, half, acc + r * TILE,                    \
                                    pf && r == 0 && half == 0);                                   \
      const bool rest_pf = pf && r == 0 && half == 0;                                             \
      switch (M - r) {                                                                            \
        case 3: BLOCK<3, BITS, G, MN>(p, qx, m0 + r, tile, half, acc + r * TILE, rest_pf); break; \
        case 2: BLOCK<2, BITS, G, MN>(p, qx, m0 + r, tile, half, acc + r * TILE, rest_pf); break; \
        case 1: BLOCK<1, BITS, G, MN>(p, qx, m0 + r, tile, half, acc + r * TILE, rest_pf); break; \
        default: break;                                                                           \
      }                                                                                           \
    }                                                                                             \
  }                                                                                               \
  template <int BITS, int G>                                                                      \
  void NAME(const Packed& p, const QuantX& qx, int64_t m0, int64_t M, int64_t tile, float* acc) { \
    if (p.mn) return NAME<BITS, G, true>(p, qx, m0, M, tile, acc);                                \
    NAME<BITS, G, false>(p, qx, m0, M, tile, acc);                                                \
  }

DEFINE_TILE_AVX2(tile_avxvnni, block_avxvnni, "avx2,fma,f16c,avxvnni")
DEFINE_TILE_AVX2(tile_avx2, block_avx2, "avx2,fma,f16c")
#undef DEFINE_TILE_AVX2
#undef DEFINE_BLOCK_AVX2

}  // namespace
