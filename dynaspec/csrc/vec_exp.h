// exp(x) as the kernels compute it: vectorisable where libm's expf is a scalar call.
// 2^n * p(r) with x = n*ln2 + r, |r| <= ln2/2, degree-6 polynomial, relative error ~2e-7; x is
// clamped to [-87, 88] (below: flushes to ~0, as softmax and silu want; above: the largest
// finite power of two the exponent bits hold).
#pragma once

#include <cstdint>

inline float exp_vec(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float n = __builtin_floorf(x * 1.44269504f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  __builtin_memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}
