// Decode/verify attention that reads the paged KV cache in place (no gather into a padded copy).
//
// One work item is (request, KV head): its G query heads x W query tokens are scored against the
// request's context block by block, straight from the cache; K and V of each block are read once
// per work item and converted to fp32 in a small scratch buffer. Softmax and accumulation are in
// fp32. Causal within the step: query j of a request with W queries and context C sits at absolute
// position C - W + j and sees keys 0..C-W+j. Written as plain loops the compiler vectorises for
// the ISA chosen at build time (the build runs on the machine that runs it).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

// exp(x) for x <= 0 (softmax after subtracting the row maximum), vectorisable (libm's expf is a
// scalar call here): 2^n * p(r) with x = n*ln2 + r, |r| <= ln2/2, degree-6 polynomial, relative
// error ~2e-7. Inputs below -87 flush to 0.
inline float exp_nonpos(float x) {
  x = x < -87.f ? -87.f : x;
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

// dot of two fp32 rows of length D.
inline float dot(const float* __restrict a, const float* __restrict b, int64_t D) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t d = 0; d < D; ++d) s += a[d] * b[d];
  return s;
}

template <typename T>
inline void to_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
         const torch::Tensor& ctx, const torch::Tensor& qstart, const torch::Tensor& qlen,
         int64_t block_size, double scale, torch::Tensor& out) {
  const int64_t B = tables.size(0), NB = tables.size(1);
  const int64_t H = q.size(1), D = q.size(2), Hkv = kv.size(2), G = H / Hkv;
  const int64_t slots = kv.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + slots * Hkv * D;
  T* op = out.data_ptr<T>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t* ql = qlen.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, sf, accf, kf(block_size * D), vf(block_size * D);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t W = ql[b], C = cl[b], R = W * G;  // R query rows: (token j, head g)
      qf.assign(R * D, 0.f);
      sf.assign(R * C, 0.f);
      accf.assign(R * D, 0.f);
      for (int64_t j = 0; j < W; ++j)
        for (int64_t g = 0; g < G; ++g) {
          const T* src = qp + ((qs[b] + j) * H + h * G + g) * D;
          float* dst = qf.data() + (j * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<float>(src[d]) * sc;
        }
      const int64_t nblk = (C + block_size - 1) / block_size;
      // Pass 1: scores. Keys past a row's position are masked to -inf after the block loop.
      for (int64_t blk = 0; blk < nblk && blk < NB; ++blk) {
        const int64_t base = tb[b * NB + blk] * block_size;
        const int64_t n = std::min(block_size, C - blk * block_size);
        for (int64_t t = 0; t < n; ++t) to_float(kp + ((base + t) * Hkv + h) * D, kf.data() + t * D, D);
        for (int64_t r = 0; r < R; ++r) {
          const float* qr = qf.data() + r * D;
          float* srow = sf.data() + r * C + blk * block_size;
          for (int64_t t = 0; t < n; ++t) srow[t] = dot(qr, kf.data() + t * D, D);
        }
      }
      // Softmax per row over its visible keys.
      for (int64_t r = 0; r < R; ++r) {
        const int64_t visible = C - W + r / G + 1;
        float* srow = sf.data() + r * C;
        float mx = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : mx)
        for (int64_t t = 0; t < visible; ++t) mx = srow[t] > mx ? srow[t] : mx;
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < visible; ++t) {
          srow[t] = exp_nonpos(srow[t] - mx);
          sum += srow[t];
        }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < visible; ++t) srow[t] *= inv;
        for (int64_t t = visible; t < C; ++t) srow[t] = 0.f;
      }
      // Pass 2: weighted sum of V, block by block.
      for (int64_t blk = 0; blk < nblk && blk < NB; ++blk) {
        const int64_t base = tb[b * NB + blk] * block_size;
        const int64_t n = std::min(block_size, C - blk * block_size);
        for (int64_t t = 0; t < n; ++t) to_float(vp + ((base + t) * Hkv + h) * D, vf.data() + t * D, D);
        for (int64_t r = 0; r < R; ++r) {
          const float* prow = sf.data() + r * C + blk * block_size;
          axpy_rows(accf.data() + r * D, prow, vf.data(), n, D);
        }
      }
      for (int64_t j = 0; j < W; ++j)
        for (int64_t g = 0; g < G; ++g) {
          T* dst = op + ((qs[b] + j) * H + h * G + g) * D;
          const float* src = accf.data() + (j * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
        }
    }
  });
}

}  // namespace

// q: [T, H, D]; kv: [2, S, Hkv, D]; tables: [B, NB] long; ctx, qstart, qlen: [B] long.
// Writes rows qstart[b] .. qstart[b] + qlen[b] of out ([T, H, D], same dtype as q).
void paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor tables, torch::Tensor ctx,
                  torch::Tensor qstart, torch::Tensor qlen, int64_t block_size, double scale,
                  torch::Tensor out) {
  TORCH_CHECK(q.is_contiguous() && kv.is_contiguous() && out.is_contiguous(), "contiguous tensors expected");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && q.scalar_type() == out.scalar_type(), "dtype mismatch");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && ctx.scalar_type() == torch::kLong, "long metadata expected");
  TORCH_CHECK(q.size(1) % kv.size(2) == 0, "query heads must be a multiple of KV heads");
  auto t = tables.contiguous(), c = ctx.contiguous(), s = qstart.contiguous(), l = qlen.contiguous();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(q, kv, t, c, s, l, block_size, scale, out);
  });
}

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_inplace(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads, int64_t head_dim);

// int8_gemm.cpp
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor d, c10::optional<torch::Tensor> mn,
                        int64_t N, int64_t G, int64_t bits, int64_t isa);
int64_t int8_gemm_isa();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int8_gemm", &int8_gemm, "x W^T with W in GGUF groups, x quantized to int8 per 32 (row-invariant)");
  m.def("int8_gemm_isa", &int8_gemm_isa, "0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI");
  m.def("paged_decode", &paged_decode, "paged decode/verify attention over the KV cache in place");
  m.def("rms_norm", &rms_norm, "w * rms_normalise(x), row-wise");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; rms_norm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [T, 2*inter] gate|up product");
  m.def("rope_inplace", &rope_inplace, "rotate-half RoPE in place on the first heads of each row");
}
