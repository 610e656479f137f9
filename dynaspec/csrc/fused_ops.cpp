// Fused row-wise small ops of a decoder layer, each one call instead of the 5-8 eager ops (and
// their per-op dispatch) it replaces. Rounding matches the eager code exactly: statistics in
// fp32, the normalised row rounded to the activation dtype, then multiplied by the weight in
// that dtype (HF's LlamaRMSNorm); the residual add rounds like torch's add.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "row_max.h"
#include "vec_exp.h"

#include "simd.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

template <typename T>
void rms_rows(const T* x, const T* w, T* out, int64_t rows, int64_t n, float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * n;
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < n; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
      T* o = out + r * n;
      for (int64_t i = 0; i < n; ++i)
        o[i] = static_cast<T>(static_cast<float>(w[i]) *
                              static_cast<float>(static_cast<T>(static_cast<float>(xr[i]) * inv)));
    }
  });
}

}  // namespace

// x: [T, n] contiguous; w: [n]. Returns w * rms_normalise(x).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) {
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.scalar_type() == w.scalar_type(),
              "rms_norm: bad input");
  auto out = torch::empty_like(x);
  const int64_t n = x.size(-1), rows = x.numel() / n;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       rows, n, static_cast<float>(eps));
  });
  return out;
}

// residual += delta in place (rounded like torch's add), then returns rms_norm(residual, w).
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w,
                           double eps) {
  TORCH_CHECK(residual.is_contiguous() && delta.is_contiguous() &&
                  residual.sizes() == delta.sizes() &&
                  residual.scalar_type() == delta.scalar_type(),
              "add_rms_norm: bad input");
  const int64_t count = residual.numel();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, residual.scalar_type(), "add", [&] {
    scalar_t* r = residual.data_ptr<scalar_t>();
    const scalar_t* d = delta.data_ptr<scalar_t>();
    for (int64_t i = 0; i < count; ++i)
      r[i] = static_cast<scalar_t>(static_cast<float>(r[i]) + static_cast<float>(d[i]));
  });
  return rms_norm(residual, w, eps);
}

// a / (1 + exp(-a)) in place (outside the dispatch macro: a pragma cannot sit in a macro argument).
inline void silu_inplace(float* __restrict a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) a[i] = a[i] / (1.f + exp_vec(-a[i]));
}

// gate_up: [T, 2 * inter] -> silu(gate) * up: [T, inter], rounded like the eager silu then mul
// (exp to ~1 ulp of torch's; every element on its own, so split across threads freely).
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous(), "silu_mul: contiguous input expected");
  const int64_t inter = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * inter);
  auto out = torch::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
    const scalar_t* g = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> buf;  // the scalar loop's: sized there, not for rows the vectors take
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* gate = g + r * 2 * inter;
        const scalar_t* up = gate + inter;
#if defined(DYNASPEC_AVX512)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (inter % 16 == 0) {  // the scalar loop below, 16 lanes at a time (the same bits)
            for (int64_t i = 0; i < inter; i += 16) {
              bf16x16_store(o + r * inter + i,
                            silu_mul16(bf16x16_load(gate + i), bf16x16_load(up + i)));
            }
            continue;
          }
        }
#elif defined(DYNASPEC_AVX2)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (inter % 8 == 0) {  // the scalar loop below, 8 lanes at a time (the same bits)
            for (int64_t i = 0; i < inter; i += 8) {
              bf16x8_store(o + r * inter + i, silu_mul8(bf16x8_load(gate + i), bf16x8_load(up + i)));
            }
            continue;
          }
        }
#endif
        buf.resize(inter);
        for (int64_t i = 0; i < inter; ++i) buf[i] = static_cast<float>(gate[i]);
        silu_inplace(buf.data(), inter);
        scalar_t* orow = o + r * inter;
        for (int64_t i = 0; i < inter; ++i)
          orow[i] = static_cast<scalar_t>(static_cast<float>(static_cast<scalar_t>(buf[i])) *
                                          static_cast<float>(up[i]));
      }
    });
  });
  return out;
}

// In place on the first `heads` heads of each row of qkv ([T, >= heads * D], row stride
// qkv.stride(0)): HF rotate-half RoPE, x1' = x1*cos - x2*sin, x2' = x2*cos + x1*sin, with cos/sin
// [T, D/2] in qkv's dtype; every product and sum is rounded to that dtype as the eager ops do.
void rope_inplace(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                  int64_t head_dim) {
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && cos.is_contiguous() && sin.is_contiguous(),
              "rope: bad layout");
  TORCH_CHECK(qkv.scalar_type() == cos.scalar_type() && qkv.scalar_type() == sin.scalar_type(),
              "rope: dtype mismatch");
  const int64_t T = qkv.size(0), stride = qkv.stride(0), half = head_dim / 2;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "rope", [&] {
    using S = scalar_t;
    S* base = qkv.data_ptr<S>();
    const S* cp = cos.data_ptr<S>();
    const S* sp = sin.data_ptr<S>();
    at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const S* c = cp + t * half;
        const S* s = sp + t * half;
        for (int64_t h = 0; h < heads; ++h) {
          S* x = base + t * stride + h * head_dim;
#if defined(DYNASPEC_AVX512)
          if constexpr (std::is_same_v<S, c10::BFloat16>) {
            if (half % 16 == 0) {  // the loop below on 16 lanes: the same roundings
              for (int64_t i = 0; i < half; i += 16) {
                const __m512 x1 = bf16x16_load(x + i), x2 = bf16x16_load(x + i + half);
                const __m512 ci = bf16x16_load(c + i), si = bf16x16_load(s + i);
                const __m512 a = bf16x16_round(_mm512_mul_ps(x1, ci)),
                             b = bf16x16_round(_mm512_mul_ps(x2, si));
                const __m512 e = bf16x16_round(_mm512_mul_ps(x2, ci)),
                             f = bf16x16_round(_mm512_mul_ps(x1, si));
                bf16x16_store(x + i, _mm512_sub_ps(a, b));
                bf16x16_store(x + i + half, _mm512_add_ps(e, f));
              }
              continue;
            }
          }
#endif
          for (int64_t i = 0; i < half; ++i) {
            const float x1 = static_cast<float>(x[i]), x2 = static_cast<float>(x[i + half]);
            const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
            const float a = static_cast<float>(static_cast<S>(x1 * ci)),
                        b = static_cast<float>(static_cast<S>(x2 * si));
            const float e = static_cast<float>(static_cast<S>(x2 * ci)),
                        f = static_cast<float>(static_cast<S>(x1 * si));
            x[i] = static_cast<S>(a - b);
            x[i + half] = static_cast<S>(e + f);
          }
        }
      }
    });
  });
}

// Greedy rows of the int8 lm_head (int8_dot.Int8DotHead): for each of `rows`, every logit
// within `margin` of the row's maximum is recomputed exactly, in place, as the dot product of
// x[row] (fp32) with the table's row (int8 q times its fp32 group scale, each product exact
// in double, summed in k order in double, rounded once to fp32): a function of the row alone.
// Two passes over each row find them (a row is ~50k logits; the eager compare and nonzero cost
// ~50 us a row, this ~6).
void exact_near_max(torch::Tensor logits, torch::Tensor rows, torch::Tensor x, torch::Tensor q,
                    torch::Tensor scale, int64_t group, double margin) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.is_contiguous(),
              "exact_near_max: contiguous float32 [M, N] logits expected");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && x.is_contiguous() &&
                  q.scalar_type() == torch::kChar && q.is_contiguous() &&
                  scale.scalar_type() == torch::kFloat && scale.is_contiguous(),
              "exact_near_max: x fp32 [M, K], q int8 [N, K], scale fp32 [N, K/group] expected");
  auto r = rows.to(torch::kLong).contiguous();
  const int64_t A = r.numel(), N = logits.size(1), K = q.size(1), ng = K / group;
  TORCH_CHECK(q.size(0) == N && x.size(1) == K && scale.size(1) == ng,
              "exact_near_max: shapes disagree");
  float* lp = logits.data_ptr<float>();
  const int64_t* rp = r.data_ptr<int64_t>();
  const float* xp = x.data_ptr<float>();
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  at::parallel_for(0, A, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> hits;
    for (int64_t a = begin; a < end; ++a) {
      float* y = lp + rp[a] * N;
      const float thr = row_max(y, N) - static_cast<float>(margin);
      hits.clear();
      int64_t i = 0;
#if defined(DYNASPEC_AVX512)
      const __m512 t = _mm512_set1_ps(thr);
      for (; i + 16 <= N; i += 16) {  // hits are a handful per row: test 16 at a time
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(y + i), t, _CMP_GE_OQ);
        for (; hit; hit &= hit - 1) hits.push_back(i + __builtin_ctz(hit));
      }
#endif
      for (; i < N; ++i)
        if (y[i] >= thr) hits.push_back(i);
      const float* xr = xp + rp[a] * K;
      for (int64_t tok : hits) {  // after the scan: the row's threshold saw one-part values only
        const int8_t* qr = qp + tok * K;
        const float* sr = sp + tok * ng;
        double acc = 0.0;
        for (int64_t k = 0; k < K; ++k)
          acc += static_cast<double>(static_cast<float>(qr[k]) * sr[k / group]) *
                 static_cast<double>(xr[k]);
        y[tok] = static_cast<float>(acc);
      }
    }
  });
}

// torch.argmax(logits, dim=-1) for contiguous float32 [M, N]: the first index of each row's
// maximum, or of its first NaN (torch ranks NaN above every number). torch's reduction compares
// one element at a time: 0.2 ms for 9 x 49k logits alone, 0.3-0.7 ms inside a width-9 verify step;
// two vector passes over each row (its maximum, then its first position) take 14 us.
torch::Tensor argmax_rows(torch::Tensor logits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat && logits.is_contiguous(),
              "argmax_rows: contiguous float32 [M, N] logits expected");
  const int64_t M = logits.size(0), N = logits.size(1);
  TORCH_CHECK(N > 0 || M == 0, "argmax_rows: a row of no logits has no argmax");
  auto out = torch::empty({M}, torch::kLong);
  const float* lp = logits.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, M, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* y = lp + r * N;
      float mx = -std::numeric_limits<float>::infinity();
      bool nan = false;
      int64_t i = 0;
#if defined(DYNASPEC_AVX512)
      __m512 m = _mm512_set1_ps(mx);
      __mmask16 un = 0;
      for (; i + 16 <= N; i += 16) {  // the maximum, and whether any lane was NaN
        const __m512 v = _mm512_loadu_ps(y + i);
        un |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, v);
      }
      mx = _mm512_reduce_max_ps(m);
      nan = un != 0;
#endif
      for (; i < N; ++i) {
        if (std::isnan(y[i])) nan = true;
        else if (y[i] > mx) mx = y[i];
      }
      int64_t best = -1;
      i = 0;
      if (nan) {  // rare: the first NaN, scalar
        while (!std::isnan(y[i])) ++i;
        op[r] = i;
        continue;
      }
#if defined(DYNASPEC_AVX512)
      const __m512 t = _mm512_set1_ps(mx);
      for (; i + 16 <= N && best < 0; i += 16) {
        const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(y + i), t, _CMP_EQ_OQ);
        if (hit) best = i + __builtin_ctz(hit);
      }
#endif
      for (; i < N && best < 0; ++i)
        if (y[i] == mx) best = i;
      op[r] = best;
    }
  });
  return out;
}
