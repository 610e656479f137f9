// The emulated build's intrinsics (simd.h, -DDYNASPEC_EMULATED; test-only): SIMDe's portable
// implementations under their native names, plus the ones SIMDe 0.7.4 lacks or computes with
// other bits than the hardware, written here from Intel's definitions lane by lane:
// - absent: the AVX512-BF16 conversion, the AVX-VNNI (VEX) dot product, the 512-bit int/float and
//   half conversions, fpclass, masked loads and stores, the reductions (and _mm512_shuffle_f32x4's
//   native alias);
// - other bits (each found against the hardware on a Zen 4, intrinsic by intrinsic): fmadd/fmsub
//   (SIMDe's fallback rounds the product, then the sum: two roundings where the instruction has
//   one), dpbf16 (SIMDe's adds the even product first and keeps denormals; vdpbf16ps adds the odd
//   one first, reads denormals as zero and flushes results), roundscale (SIMDe's ignores the
//   rounding mode when _MM_FROUND_NO_EXC is set: a floor came out as a round), scalef (SIMDe's
//   flushes denormal results), abs_ps (SIMDe's keeps a NaN's sign) and cvtph_ps (SIMDe's keeps
//   a signalling half NaN signalling).
// Not held: which NaN a fused multiply-add returns when several inputs are NaN (the compiler's
// choice of operand order decides it natively).
// A later SIMDe that has one of the absent ones keeps its own (#ifndef on the native name).
#pragma once

// The compiler's own header first, as torch's headers include it in every kernel source: its
// _MM_ constants, and SIMDe's aliases then take one form (macros over the native names).
#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>
#include <simde/x86/f16c.h>
#include <simde/x86/fma.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace dsim {

// A vector's lanes as an array of T and back (by bytes: any SIMDe representation).
template <typename T, typename V>
inline std::array<T, sizeof(V) / sizeof(T)> lanes(const V& v) {
  std::array<T, sizeof(V) / sizeof(T)> a;
  std::memcpy(a.data(), &v, sizeof(V));
  return a;
}

template <typename V, typename T, size_t N>
inline V vec(const std::array<T, N>& a) {
  static_assert(sizeof(V) == sizeof(T) * N, "lanes fill the vector");
  V v;
  std::memcpy(&v, a.data(), sizeof(V));
  return v;
}

inline float bits_f32(uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}

inline uint32_t f32_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Denormals as the BF16 instructions read and write them: as zero of the same sign.
inline float flush(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x;
}

// cvtps2dq / cvttps2dq: a NaN or out-of-range lane is the "integer indefinite" 0x80000000.
inline int32_t to_i32(float x) {
  return (x >= -2147483648.f && x < 2147483648.f) ? static_cast<int32_t>(x) : INT32_MIN;
}

// One fused multiply-add per lane: one rounding, as vfmadd.
template <typename V>
inline V fmadd(V a, V b, V c, float sign_c) {
  auto x = lanes<float>(a), y = lanes<float>(b), z = lanes<float>(c);
  for (size_t i = 0; i < x.size(); ++i)  // (fmsub: a NaN c is returned as it is, not negated)
    x[i] = std::fma(x[i], y[i], std::isnan(z[i]) ? z[i] : sign_c * z[i]);
  return vec<V>(x);
}

// vroundscaleps with M = imm >> 4 fraction bits kept, rounded by imm's low two bits (bit 2:
// MXCSR's mode, nearest even here); a NaN comes back quiet.
inline float roundscale(float x, int imm) {
  if (std::isnan(x)) return bits_f32(f32_bits(x) | 0x400000u);
  const int m = (imm >> 4) & 15, mode = (imm & 4) ? 0 : (imm & 3);
  const float y = std::ldexp(x, m);
  const float r = mode == 0   ? std::nearbyint(y)
                  : mode == 1 ? std::floor(y)
                  : mode == 2 ? std::ceil(y)
                              : std::trunc(y);
  return std::ldexp(r, -m);
}

// vscalefps: a * 2^floor(b), rounded once (denormal results kept, as MXCSR's defaults do).
inline float scalef(float a, float b) {
  if (std::isnan(a)) return bits_f32(f32_bits(a) | 0x400000u);
  if (std::isnan(b)) return bits_f32(f32_bits(b) | 0x400000u);
  if (std::isinf(b)) {
    if ((b > 0 && a == 0.f) || (b < 0 && std::isinf(a))) return bits_f32(0xFFC00000u);  // QNaN
    return b > 0 ? a * INFINITY : a * 0.f;
  }
  const float e = std::floor(b);
  return std::ldexp(a, e > 1000.f ? 1000 : (e < -1000.f ? -1000 : static_cast<int>(e)));
}

// vcvtph2ps: exact; a NaN comes back quiet.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16, e = (h >> 10) & 31, m = h & 1023u;
  if (e == 31) return bits_f32(sign | 0x7F800000u | (m << 13) | (m ? 0x400000u : 0u));
  if (e == 0) return std::copysign(std::ldexp(static_cast<float>(m), -24), sign ? -1.f : 1.f);
  return bits_f32(sign | ((e + 112) << 23) | (m << 13));
}

template <typename V>
inline V map_f32(V a, float (*f)(float, int), int imm) {
  auto x = lanes<float>(a);
  for (float& v : x) v = f(v, imm);
  return vec<V>(x);
}

// vcvtneps2bf16: round to nearest even; a denormal input is read as zero (DAZ); a NaN stays a
// NaN of its sign and high payload with the quiet bit set.
inline uint16_t cvtne_bf16(float f) {
  const uint32_t b = f32_bits(flush(f));
  if (std::isnan(f)) return static_cast<uint16_t>((b >> 16) | 0x40);
  return static_cast<uint16_t>((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

// vdpbf16ps lane j: src + odd pair's product, then + the even pair's, each product exact and
// each sum rounded once to nearest even; inputs read DAZ, results flushed (FTZ).
inline simde__m512 dpbf16(simde__m512 src, simde__m512bh a, simde__m512bh b) {
  auto s = lanes<float>(src);
  const auto x = lanes<uint16_t>(a), y = lanes<uint16_t>(b);
  for (int j = 0; j < 16; ++j) {
    float acc = flush(s[j]);
    for (int e : {2 * j + 1, 2 * j}) {
      const float p = flush(bits_f32(uint32_t{x[e]} << 16)),
                  q = flush(bits_f32(uint32_t{y[e]} << 16));
      acc = flush(std::fma(p, q, acc));
    }
    s[j] = acc;
  }
  return vec<simde__m512>(s);
}

// _mm512_reduce_*_ps as GCC's avx512fintrin.h sequences them (the native build's order): the
// 256-bit halves lane-wise, then the 128-bit halves, then lanes (0, 2) and (1, 3), then the two.
template <typename Op>
inline float reduce16(simde__m512 v, Op op) {
  const auto a = lanes<float>(v);
  float h8[8], h4[4];
  for (int i = 0; i < 8; ++i) h8[i] = op(a[8 + i], a[i]);
  for (int i = 0; i < 4; ++i) h4[i] = op(h8[4 + i], h8[i]);
  return op(op(h4[0], h4[2]), op(h4[1], h4[3]));
}

inline float max_x86(float a, float b) { return a > b ? a : b; }  // maxps: b where unordered

// vfpclassps: bit 0 QNaN, 1 +0, 2 -0, 3 +inf, 4 -inf, 5 denormal, 6 negative finite, 7 SNaN.
inline bool fpclass(float x, int imm) {
  const uint32_t b = f32_bits(x);
  const bool neg = b >> 31, nan = std::isnan(x), quiet = (b >> 22) & 1;
  const int c = std::fpclassify(x);
  return ((imm & 0x01) && nan && quiet) || ((imm & 0x80) && nan && !quiet) ||
         ((imm & 0x02) && c == FP_ZERO && !neg) || ((imm & 0x04) && c == FP_ZERO && neg) ||
         ((imm & 0x08) && c == FP_INFINITE && !neg) || ((imm & 0x10) && c == FP_INFINITE && neg) ||
         ((imm & 0x20) && c == FP_SUBNORMAL) || ((imm & 0x40) && neg && !nan && c != FP_INFINITE);
}

}  // namespace dsim

// ---- other bits than the hardware in SIMDe: replaced ----------------------------------------
#undef _mm256_fmadd_ps
#define _mm256_fmadd_ps(a, b, c) dsim::fmadd<simde__m256>((a), (b), (c), 1.f)
#undef _mm512_fmadd_ps
#define _mm512_fmadd_ps(a, b, c) dsim::fmadd<simde__m512>((a), (b), (c), 1.f)
#undef _mm512_fmsub_ps
#define _mm512_fmsub_ps(a, b, c) dsim::fmadd<simde__m512>((a), (b), (c), -1.f)
#undef _mm512_dpbf16_ps
#define _mm512_dpbf16_ps(src, a, b) dsim::dpbf16((src), (a), (b))
#undef _mm512_roundscale_ps
#define _mm512_roundscale_ps(a, imm) dsim::map_f32<simde__m512>((a), dsim::roundscale, (imm))

inline simde__m512 dsim_mm512_scalef_ps(simde__m512 a, simde__m512 b) {
  auto x = dsim::lanes<float>(a);
  const auto y = dsim::lanes<float>(b);
  for (int i = 0; i < 16; ++i) x[i] = dsim::scalef(x[i], y[i]);
  return dsim::vec<simde__m512>(x);
}
#undef _mm512_scalef_ps
#define _mm512_scalef_ps(a, b) dsim_mm512_scalef_ps((a), (b))
#undef _mm512_abs_ps
#define _mm512_abs_ps(a)    \
  simde_mm512_castsi512_ps( \
      simde_mm512_and_si512(simde_mm512_castps_si512(a), simde_mm512_set1_epi32(0x7FFFFFFF)))

inline simde__m256 dsim_mm256_cvtph_ps(simde__m128i a) {
  const auto h = dsim::lanes<uint16_t>(a);
  std::array<float, 8> r;
  for (int i = 0; i < 8; ++i) r[i] = dsim::half_to_float(h[i]);
  return dsim::vec<simde__m256>(r);
}
#undef _mm256_cvtph_ps
#define _mm256_cvtph_ps(a) dsim_mm256_cvtph_ps((a))

// ---- absent in SIMDe 0.7.4 -----------------------------------------------------------------
// SIMDe has it under its own name only (no native alias).
#undef _mm512_shuffle_f32x4
#define _mm512_shuffle_f32x4(a, b, imm8) simde_mm512_shuffle_f32x4((a), (b), (imm8))

#ifndef _mm256_dpbusd_avx_epi32  // AVX-VNNI: the EVEX vpdpbusd's operation, VEX-encoded
#define _mm256_dpbusd_avx_epi32(src, a, b) simde_mm256_dpbusd_epi32((src), (a), (b))
#endif

#ifndef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh(a) dsim_mm512_cvtneps_pbh((a))
inline simde__m256bh dsim_mm512_cvtneps_pbh(simde__m512 a) {
  const auto f = dsim::lanes<float>(a);
  std::array<uint16_t, 16> r;
  for (int i = 0; i < 16; ++i) r[i] = dsim::cvtne_bf16(f[i]);
  return dsim::vec<simde__m256bh>(r);
}
#endif

#ifndef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps(a) dsim_mm512_cvtepi32_ps((a))
inline simde__m512 dsim_mm512_cvtepi32_ps(simde__m512i a) {
  const auto x = dsim::lanes<int32_t>(a);
  std::array<float, 16> r;
  for (int i = 0; i < 16; ++i) r[i] = static_cast<float>(x[i]);  // to nearest even, as cvtdq2ps
  return dsim::vec<simde__m512>(r);
}
#endif

#ifndef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32(a) dsim_mm512_cvtps_epi32((a))
inline simde__m512i dsim_mm512_cvtps_epi32(simde__m512 a) {
  const auto x = dsim::lanes<float>(a);
  std::array<int32_t, 16> r;
  for (int i = 0; i < 16; ++i) r[i] = dsim::to_i32(std::nearbyint(x[i]));  // MXCSR: nearest even
  return dsim::vec<simde__m512i>(r);
}
#endif

#ifndef _mm512_cvttps_epi32
#define _mm512_cvttps_epi32(a) dsim_mm512_cvttps_epi32((a))
inline simde__m512i dsim_mm512_cvttps_epi32(simde__m512 a) {
  const auto x = dsim::lanes<float>(a);
  std::array<int32_t, 16> r;
  for (int i = 0; i < 16; ++i) r[i] = dsim::to_i32(std::trunc(x[i]));
  return dsim::vec<simde__m512i>(r);
}
#endif

#ifndef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32(a) dsim_mm512_cvtepu16_epi32((a))
inline simde__m512i dsim_mm512_cvtepu16_epi32(simde__m256i a) {
  const auto x = dsim::lanes<uint16_t>(a);
  std::array<int32_t, 16> r;
  for (int i = 0; i < 16; ++i) r[i] = x[i];
  return dsim::vec<simde__m512i>(r);
}
#endif

#ifndef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16(a) dsim_mm512_cvtepi32_epi16((a))
inline simde__m256i dsim_mm512_cvtepi32_epi16(simde__m512i a) {  // vpmovdw: truncation
  const auto x = dsim::lanes<uint32_t>(a);
  std::array<uint16_t, 16> r;
  for (int i = 0; i < 16; ++i) r[i] = static_cast<uint16_t>(x[i]);
  return dsim::vec<simde__m256i>(r);
}
#endif

#ifndef _mm512_cvtph_ps
#define _mm512_cvtph_ps(a) dsim_mm512_cvtph_ps((a))
inline simde__m512 dsim_mm512_cvtph_ps(simde__m256i a) {
  const auto h = dsim::lanes<uint16_t>(a);
  std::array<float, 16> r;
  for (int i = 0; i < 16; ++i) r[i] = dsim::half_to_float(h[i]);
  return dsim::vec<simde__m512>(r);
}
#endif

#ifndef _mm512_fpclass_ps_mask
#define _mm512_fpclass_ps_mask(a, imm) dsim_mm512_fpclass_ps_mask((a), (imm))
inline simde__mmask16 dsim_mm512_fpclass_ps_mask(simde__m512 a, int imm) {
  const auto x = dsim::lanes<float>(a);
  simde__mmask16 k = 0;
  for (int i = 0; i < 16; ++i)
    if (dsim::fpclass(x[i], imm)) k = static_cast<simde__mmask16>(k | (1u << i));
  return k;
}
#endif

// Masked loads and stores touch only the lanes their mask names (the hardware suppresses
// faults past them: a row's tail may end at the end of its allocation).
#ifndef _mm512_mask_loadu_ps
#define _mm512_mask_loadu_ps(src, k, p) dsim_mm512_mask_loadu_ps((src), (k), (p))
inline simde__m512 dsim_mm512_mask_loadu_ps(simde__m512 src, simde__mmask16 k, const void* p) {
  auto r = dsim::lanes<float>(src);
  for (int i = 0; i < 16; ++i)
    if ((k >> i) & 1) std::memcpy(&r[i], static_cast<const float*>(p) + i, 4);
  return dsim::vec<simde__m512>(r);
}
#endif

#ifndef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps(k, p) dsim_mm512_maskz_loadu_ps((k), (p))
inline simde__m512 dsim_mm512_maskz_loadu_ps(simde__mmask16 k, const void* p) {
  return dsim_mm512_mask_loadu_ps(simde_mm512_setzero_ps(), k, p);
}
#endif

template <typename T, typename V>
inline void dsim_mask_store(void* p, uint32_t k, V a) {
  const auto x = dsim::lanes<T>(a);
  for (size_t i = 0; i < x.size(); ++i)
    if ((k >> i) & 1) std::memcpy(static_cast<T*>(p) + i, &x[i], sizeof(T));
}

#ifndef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps(p, k, a) dsim_mask_store<float>((p), (k), (a))
#endif
#ifndef _mm512_mask_storeu_epi32
#define _mm512_mask_storeu_epi32(p, k, a) dsim_mask_store<int32_t>((p), (k), (a))
#endif
#ifndef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16(p, k, a) dsim_mask_store<int16_t>((p), (k), (a))
#endif

#ifndef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps(a) dsim_mm512_reduce_add_ps((a))
inline float dsim_mm512_reduce_add_ps(simde__m512 a) {
  return dsim::reduce16(a, [](float x, float y) { return x + y; });
}
#endif
#ifndef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps(a) dsim_mm512_reduce_max_ps((a))
inline float dsim_mm512_reduce_max_ps(simde__m512 a) { return dsim::reduce16(a, dsim::max_x86); }
#endif
#ifndef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32(a) dsim_mm512_reduce_add_epi32((a))
inline int32_t dsim_mm512_reduce_add_epi32(simde__m512i a) {  // integers: any order, the same sum
  uint32_t s = 0;                                             // wrapping, as vpaddd
  for (uint32_t x : dsim::lanes<uint32_t>(a)) s += x;
  return static_cast<int32_t>(s);
}
#endif
