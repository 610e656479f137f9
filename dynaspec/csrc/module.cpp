// The Python module: every kernel's binding in one place (the kernels live in their own files).
#include <torch/extension.h>
#include <pybind11/stl.h>

#include "cpu_paths.h"

// paged_decode.cpp
void paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor tables, torch::Tensor ctx,
                  torch::Tensor qstart, torch::Tensor qlen, int64_t block_size, double scale,
                  torch::Tensor out, int64_t window, c10::optional<torch::Tensor> tree_mask,
                  int64_t path, int64_t numerics_of);

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w,
                           double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_inplace(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                  int64_t head_dim);
void exact_near_max(torch::Tensor logits, torch::Tensor rows, torch::Tensor x, torch::Tensor q,
                    torch::Tensor scale, int64_t group, double margin);
torch::Tensor argmax_rows(torch::Tensor logits);

// int8_gemm.cpp
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                        c10::optional<torch::Tensor> mn, int64_t N, int64_t G, int64_t bits,
                        int64_t isa);
torch::Tensor int8_gemm_silu(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                             c10::optional<torch::Tensor> mn, int64_t N, int64_t G, int64_t bits);
int64_t int8_gemm_isa();

// Build facts passed as bare tokens (-DDYNASPEC_ISA_TAG=avx512): quotes do not survive the
// shell lines of every build tool.
#ifndef DYNASPEC_ISA_TAG
#define DYNASPEC_ISA_TAG unknown
#endif
#ifndef DYNASPEC_SRC_HASH
#define DYNASPEC_SRC_HASH unknown
#endif
// Variadic: DYNASPEC_BUILD_FLAGS is a comma-separated list, which a one-argument macro would
// take as several arguments.
#define DYNASPEC_STR2(...) #__VA_ARGS__
#define DYNASPEC_STR(...) DYNASPEC_STR2(__VA_ARGS__)

#ifndef DYNASPEC_BUILD_FLAGS
#define DYNASPEC_BUILD_FLAGS
#endif

// The build's facts where cpu_kernels.py reads them from the file without importing it: a module
// compiled with flags this CPU lacks may run them in any code, its static initializers included,
// so it is refused before anything of it runs.
extern "C" __attribute__((used, visibility("default"))) const char dynaspec_build_facts[] =
    // clang-format off: one fact to a line
    "DYNASPEC-BUILD-FACTS: tag=" DYNASPEC_STR(DYNASPEC_ISA_TAG)
    " hash=" DYNASPEC_STR(DYNASPEC_SRC_HASH)
    " flags=" DYNASPEC_STR(DYNASPEC_BUILD_FLAGS) " ;";
// clang-format on

// layer_stack.cpp
void register_layer_stack(pybind11::module& m);

// head_step.cpp
void register_head_step(pybind11::module& m);

// The kernels run without the GIL (arguments are converted before it is released): a long
// forward holding it starved the server's event loop, so /health waited ~90 s behind a
// 130k-token prefill. They touch no Python object.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  register_layer_stack(m);
  register_head_step(m);
  m.def(
      "build_info",
      [] {
        return std::make_tuple(std::string(DYNASPEC_STR(DYNASPEC_ISA_TAG)),
                               std::string(DYNASPEC_STR(DYNASPEC_SRC_HASH)));
      },
      "(ISA tag, source hash) this module was built with");
  m.def("int8_gemm", &int8_gemm,
        "x W^T with W in GGUF groups, x quantized to int8 per 32 (row-invariant)", nogil);
  m.def("int8_gemm_silu", &int8_gemm_silu, "silu_mul(int8_gemm(x, ...)) of a gate|up matrix, fused",
        nogil);
  m.def("int8_gemm_isa", &int8_gemm_isa,
        "the selected int8_gemm path: 0 scalar, 1 AVX2, 2 AVX-VNNI, 3 AVX-512 VNNI");
  m.def("set_cpu_paths", &set_cpu_paths,
        "the kernel paths this CPU may run (cpu_features.py), once at load", py::arg("allowed"),
        py::arg("gemm"));
  m.def("cpu_paths", &allowed_cpu_paths, "the run-time kernel paths set_cpu_paths allowed");
  m.def("paged_decode", &paged_decode,
        "paged attention over the KV cache in place, any query length", py::arg("q"), py::arg("kv"),
        py::arg("tables"), py::arg("ctx"), py::arg("qstart"), py::arg("qlen"),
        py::arg("block_size"), py::arg("scale"), py::arg("out"), py::arg("window") = 0,
        py::arg("tree_mask") = py::none(), py::arg("path") = -1, py::arg("numerics_of") = -1,
        nogil);
  m.def("rms_norm", &rms_norm, "w * rms_normalise(x), row-wise", nogil);
  m.def("add_rms_norm", &add_rms_norm, "residual += delta; rms_norm(residual)", nogil);
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [T, 2*inter] gate|up product", nogil);
  m.def("rope_inplace", &rope_inplace, "rotate-half RoPE in place on the first heads of each row",
        nogil);
  m.def("exact_near_max", &exact_near_max,
        "a greedy row's logits near its maximum, exactly, in place", nogil);
  m.def("argmax_rows", &argmax_rows, "torch.argmax(logits, dim=-1) of float32 [M, N], vectorised",
        nogil);
}
