// The attention kernel's reference (paged_decode.cpp, path "scalar"): every query row as plain
// loops over its visible keys, in the per-row order of operations the vector paths keep, so a
// path's rows equal the reference run with that path's numerics (RowNumerics) bit for bit. The
// one exception is bf16 probabilities (attn_pairs.h): their polynomial exp, bf16 rounding, pair
// order and lane tree are not reproduced here, so that path is held to a stated bound instead
// (tests/unit/test_attention_paths.py). No intrinsics: it runs on every CPU, and with
// `numerics_of` it emulates a path this CPU lacks (vdpbf16ps's exact products and DAZ/FTZ).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "vec_exp.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// What a path computes for a row (the choices where paths differ; everything else is shared).
struct RowNumerics {
  bool bf16_scores = false;  // q . k as vdpbf16ps pairs in 16 lanes + a fixed tree, then * scale
  bool bf16_probs = false;   // values summed with bf16 probabilities (attn_pairs.h): bound only
  bool fused_pv = false;     // the value sums as fma(p, v, acc) rather than acc + p * v
};

// Denormals as vdpbf16ps reads and writes them (DAZ in, FTZ out).
inline float flush_denormal(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.f, x) : x;
}

// scale * q . k as scores16_bf16 forms it: lane L adds pairs L, L + 16, ... in order, each pair
// as (odd product, then even), every sum exact-product fma then flushed; the lanes then as
// reduce16's tree: per 128-bit block (l0 + l2) + (l1 + l3), the blocks (b0 + b1) + (b2 + b3).
inline float score_bf16_pairs(const c10::BFloat16* q, const c10::BFloat16* k, int64_t D,
                              float scale) {
  float lane[16];
  for (int64_t L = 0; L < 16; ++L) {
    float a = 0.f;
    for (int64_t c = 0; c < D; c += 32) {
      for (int64_t e : {c + 2 * L + 1, c + 2 * L}) {
        const float x = flush_denormal(static_cast<float>(q[e])),
                    y = flush_denormal(static_cast<float>(k[e]));
        a = flush_denormal(std::fma(x, y, a));
      }
    }
    lane[L] = a;
  }
  float block[4];
  for (int b = 0; b < 4; ++b) {
    const float* l = lane + 4 * b;
    block[b] = (l[0] + l[2]) + (l[1] + l[3]);
  }
  return ((block[0] + block[1]) + (block[2] + block[3])) * scale;
}

// scale * q . k on the fp32 path: q[d] * scale rounded, then one fma chain over d in order.
template <typename T>
inline float score_fp32(const T* q, const T* k, int64_t D, float scale) {
  float s = 0.f;
  for (int64_t d = 0; d < D; ++d)
    s = std::fma(static_cast<float>(q[d]) * scale, static_cast<float>(k[d]), s);
  return s;
}

// One row: scores s of its n visible keys in key order -> probabilities in place, as softmax_row
// (exp_vec of s - max; the sum in 16 lanes by index % 16, each in order, then the lanes in order).
inline void softmax_reference(float* s, int64_t n) {
  float mx = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) mx = s[i] > mx ? s[i] : mx;
  float lanes[16] = {0.f};
  for (int64_t i = 0; i < n; ++i) {
    s[i] = exp_vec(s[i] - mx);
    lanes[i % 16] += s[i];
  }
  float sum = 0.f;
  for (float l : lanes) sum += l;
  const float inv = 1.f / sum;
  for (int64_t i = 0; i < n; ++i) s[i] *= inv;
}

// Every query row of the batch (arguments as paged_decode's, pointers to contiguous metadata):
// row (token t of request b, head hq) sees keys first_key(pos) .. pos, pos = C - W + j, those of
// this step only where its tree row says so; out[t, hq] = softmax(scores) . V in key order.
template <typename T>
void attend_reference(const T* qp, int64_t qstride, const T* kp, const T* vp, T* op,
                      const int64_t* tb, int64_t NB, const int64_t* cl, const int64_t* qs,
                      const int64_t* ql, int64_t B, int64_t H, int64_t Hkv, int64_t D,
                      int64_t block_size, float sc, int64_t window, const uint8_t* tm, int64_t tmw,
                      RowNumerics num) {
  const int64_t G = H / Hkv;
  std::vector<std::array<int64_t, 2>> rows;  // (request, query token)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t j = 0; j < ql[b]; ++j) rows.push_back({b, j});
  const int64_t nrows = static_cast<int64_t>(rows.size());
  at::parallel_for(0, nrows * H, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> keys;
    std::vector<float> s, acc(D);
    for (int64_t r = r0; r < r1; ++r) {
      const auto [b, j] = rows[r / H];
      const int64_t hq = r % H, h = hq / G, C = cl[b], step0 = C - ql[b], pos = step0 + j,
                    tok = qs[b] + j;
      const int64_t lo = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0;
      keys.clear();
      if (tm == nullptr) {
        for (int64_t k = lo; k <= pos; ++k) keys.push_back(k);
      } else {  // what the row's root path sees as a chain: its window in chain positions
        const uint8_t* seen = tm + tok * tmw;
        int64_t depth = -1;
        for (int64_t k = 0; k <= j; ++k) depth += seen[k] != 0;
        const int64_t cpos = step0 + depth;
        const int64_t clo = window > 0 ? std::max<int64_t>(0, cpos - window + 1) : 0;
        for (int64_t k = clo; k < step0; ++k) keys.push_back(k);
        for (int64_t k = 0, at = step0; k <= j; ++k)
          if (seen[k] && at++ >= clo) keys.push_back(step0 + k);
      }
      auto row = [&](const T* cache, int64_t k) {
        return cache + ((tb[b * NB + k / block_size] * block_size + k % block_size) * Hkv + h) * D;
      };
      const T* q = qp + tok * qstride + hq * D;
      const int64_t n = static_cast<int64_t>(keys.size());
      s.resize(n);
      for (int64_t i = 0; i < n; ++i) {
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (num.bf16_scores) {
            s[i] = score_bf16_pairs(q, row(kp, keys[i]), D, sc);
            continue;
          }
        }
        s[i] = score_fp32(q, row(kp, keys[i]), D, sc);
      }
      softmax_reference(s.data(), n);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < n; ++i) {
        const T* v = row(vp, keys[i]);
        for (int64_t d = 0; d < D; ++d) {
          const float x = static_cast<float>(v[d]);
          acc[d] = num.fused_pv ? std::fma(s[i], x, acc[d]) : acc[d] + s[i] * x;
        }
      }
      T* dst = op + (tok * H + hq) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(acc[d]);
    }
  });
}

}  // namespace
