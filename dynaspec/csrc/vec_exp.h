// exp(x) as the kernels compute it: vectorisable where libm's expf is a scalar call.
// 2^n * p(r) with x = n*ln2 + r, |r| <= ln2/2, degree-6 polynomial, relative error ~2e-7; x is
// clamped to [-87, 88] (below: flushes to ~0, as softmax and silu want; above: the largest
// finite power of two the exponent bits hold).
#pragma once

#include <cstdint>

#include "simd.h"

// The constants of every form (scalar, 8 and 16 lanes): one copy, so the forms keep one result.
namespace expc {
constexpr float LO = -87.f, HI = 88.f, LOG2E = 1.44269504f;
constexpr float LN2_HI = 0.693359375f, LN2_LO = 2.12194440e-4f;  // ln 2 = LN2_HI - LN2_LO
constexpr float P0 = 1.3981999507e-3f, P1 = 8.3334519073e-3f, P2 = 4.1665795894e-2f;
constexpr float P3 = 1.6666665459e-1f, P4 = 5.0000001201e-1f;
}  // namespace expc

inline float exp_vec(float x) {
  using namespace expc;
  x = x < LO ? LO : (x > HI ? HI : x);
  const float n = __builtin_floorf(x * LOG2E + 0.5f);
  const float r = x - n * LN2_HI + n * LN2_LO;
  float p = P0;
  p = p * r + P1;
  p = p * r + P2;
  p = p * r + P3;
  p = p * r + P4;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The 8-lane forms: target-attributed, so any build compiles them and a path chosen at run time
// (attention's AVX2 rows) or an AVX2 build's loops can call them.
#define VEC8_TARGET DYNASPEC_TARGET("avx2,fma,f16c")

// exp_vec above on 8 lanes: the same operations in the same order, so the same bits for
// any finite x.
VEC8_TARGET inline __m256 exp8(__m256 x) {
  using namespace expc;
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(LO)), _mm256_set1_ps(HI));
  const __m256 n =
      _mm256_floor_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _mm256_set1_ps(0.5f)));
  const __m256 r = _mm256_add_ps(_mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(LN2_HI))),
                                 _mm256_mul_ps(n, _mm256_set1_ps(LN2_LO)));
  __m256 p = _mm256_set1_ps(P0);
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P1));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P2));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P3));
  p = _mm256_add_ps(_mm256_mul_ps(p, r), _mm256_set1_ps(P4));
  p = _mm256_add_ps(_mm256_add_ps(_mm256_mul_ps(_mm256_mul_ps(p, r), r), r), _mm256_set1_ps(1.f));
  const __m256i bits =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// bf16 <-> fp32 on 8 lanes as c10::BFloat16 converts (exact up; down to nearest even, NaN to
// 0x7FC0): the 8-lane twins of bf16x16_load / bf16x16_round / bf16x16_store below.
VEC8_TARGET inline __m256 bf16x8_load(const void* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// The bf16 bits in the low half of each lane.
VEC8_TARGET inline __m256i bf16x8_bits(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i r =
      _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0),
                            _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
}

VEC8_TARGET inline __m256 bf16x8_round(__m256 v) {  // float(bf16(v))
  return _mm256_castsi256_ps(_mm256_slli_epi32(bf16x8_bits(v), 16));
}

VEC8_TARGET inline void bf16x8_store(void* p, __m256 v) {
  const __m256i b = bf16x8_bits(v);  // lanes hold 0..0xFFFF: packus keeps them as they are
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

// silu(gate) * up on 8 lanes, rounded as silu_mul16 rounds (silu to bf16, then the product).
VEC8_TARGET inline __m256 silu_mul8(__m256 gate, __m256 up) {
  const __m256 neg = _mm256_xor_ps(gate, _mm256_set1_ps(-0.f));
  const __m256 silu = _mm256_div_ps(gate, _mm256_add_ps(_mm256_set1_ps(1.f), exp8(neg)));
  return _mm256_mul_ps(bf16x8_round(silu), up);
}

#if defined(DYNASPEC_AVX512)
// exp_vec on 16 lanes, the same operations in the same order (so the same bits for any finite
// x; the compiler left the scalar loop unvectorised, and softmax's exps were then ~40% of an
// attention step).
inline __m512 exp16(__m512 x) {
  using namespace expc;
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(LO)), _mm512_set1_ps(HI));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_add_ps(_mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(LN2_HI))),
                                 _mm512_mul_ps(n, _mm512_set1_ps(LN2_LO)));
  __m512 p = _mm512_set1_ps(P0);
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P1));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P2));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P3));
  p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(P4));
  p = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.f));
  const __m512i bits =
      _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}
#endif

// bf16 <-> fp32 on 16 lanes as c10::BFloat16 converts (exact up; down to nearest even, NaN to
// 0x7FC0), so vector loops round exactly where the scalar ones did. Target-attributed rather than
// guarded: the int8 GEMM's AVX-512 path is chosen at run time and calls them from any build.
#define BF16X16_TARGET DYNASPEC_TARGET("avx512f,avx512bw")

BF16X16_TARGET inline __m512 bf16x16_load(const void* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// The bf16 bits in the low half of each lane.
BF16X16_TARGET inline __m512i bf16x16_bits(__m512 v) {
  __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  b = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  return _mm512_mask_mov_epi32(b, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q),
                               _mm512_set1_epi32(0x7FC0));
}

BF16X16_TARGET inline __m512 bf16x16_round(__m512 v) {  // float(bf16(v))
  return _mm512_castsi512_ps(_mm512_slli_epi32(bf16x16_bits(v), 16));
}

BF16X16_TARGET inline void bf16x16_store(void* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16x16_bits(v)));
}

// The same bits through AVX512-BF16's vcvtneps2bf16: one instruction for bf16x16_bits' seven.
// It takes subnormal inputs as zero and keeps a NaN's sign and payload, so lanes holding either
// (fpclass: QNaN 0x01, subnormal 0x20, SNaN 0x80; rare) take the integer path, which rounds
// them as c10::BFloat16 does. For callers allowed bf16_convert.avx512_bf16 (cpu_paths.h).
#define BF16CVT_TARGET DYNASPEC_TARGET("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")

BF16CVT_TARGET inline __m256i bf16x16_pack_cvt(__m512 v) {
  if (_mm512_fpclass_ps_mask(v, 0xA1) == 0) return (__m256i)_mm512_cvtneps_pbh(v);
  return _mm512_cvtepi32_epi16(bf16x16_bits(v));
}

BF16CVT_TARGET inline __m512 bf16x16_round_cvt(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bf16x16_pack_cvt(v)), 16));
}

BF16CVT_TARGET inline void bf16x16_store_cvt(void* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16x16_pack_cvt(v));
}

#if defined(DYNASPEC_AVX512)
// silu(gate) * up on 16 lanes of bf16 values (as fp32), rounded as the eager ops round: silu to
// bf16, then the product (the caller's store rounds it). silu_mul and the gate|up GEMM's fused
// epilogue both call this, so the two give the same bits.
inline __m512 silu16(__m512 gate) {  // silu, before its rounding to bf16
  const __m512 neg = _mm512_castsi512_ps(
      _mm512_xor_si512(_mm512_castps_si512(gate), _mm512_set1_epi32(INT32_MIN)));
  return _mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.f), exp16(neg)));
}

inline __m512 silu_mul16(__m512 gate, __m512 up) {
  return _mm512_mul_ps(bf16x16_round(silu16(gate)), up);
}

BF16CVT_TARGET inline __m512 silu_mul16_cvt(__m512 gate, __m512 up) {  // the same bits
  return _mm512_mul_ps(bf16x16_round_cvt(silu16(gate)), up);
}
#endif
