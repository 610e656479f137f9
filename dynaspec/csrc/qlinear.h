// One Int8DotLinear's packed weights as the C++ layer code calls them (models/int8_dot.py).
#pragma once

#include <torch/extension.h>

// int8_gemm.cpp
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                        c10::optional<torch::Tensor> mn, int64_t N, int64_t G, int64_t bits,
                        int64_t isa);
torch::Tensor int8_gemm_silu(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                             c10::optional<torch::Tensor> mn, int64_t N, int64_t G, int64_t bits);

struct QLinear {
  torch::Tensor w, d;
  c10::optional<torch::Tensor> mn;
  int64_t N, G, bits;
  torch::Tensor operator()(const torch::Tensor& x) const {
    return int8_gemm(x, w, d, mn, N, G, bits, -1);
  }
  // silu(gate) * up where this holds gate's rows over up's.
  torch::Tensor silu_mul(const torch::Tensor& x) const {
    return int8_gemm_silu(x, w, d, mn, N, G, bits);
  }
};
