// A Llama-family decoder's layers as one C++ call per step on the CPU fast path.
//
// At batch 1 a step is ~5 ms of kernels; the Python around them (about 40 ops and 10 Python calls
// per layer, 30 layers) cost about as much again. This runs the same kernels, in the same order,
// with the same rounding, as the Python layer loop (models/llama.py DecoderLayer.forward on the
// int8dot + cpu_paged + fused-ops path), so the two are bit-identical (the MLP's gate|up GEMM and
// silu_mul run fused here: int8_gemm_silu gives silu_mul's bits); the model picks this one only
// when every part of a layer is on that path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstring>
#include <vector>

#include "qlinear.h"

// Declared in the other kernel files (one extension module).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w,
                           double eps);
void rope_inplace(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                  int64_t head_dim);
void paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor tables, torch::Tensor ctx,
                  torch::Tensor qstart, torch::Tensor qlen, int64_t block_size, double scale,
                  torch::Tensor out, int64_t window, c10::optional<torch::Tensor> tree_mask,
                  int64_t path, int64_t numerics_of);

struct Layer {
  QLinear qkv, o, gate_up, down;
  torch::Tensor ln1, ln2;
};

// Rows of k and v ([T, Hkv, D] views into qkv) into their KV slots: kv [2, S, Hkv, D].
void write_kv(torch::Tensor kv, const torch::Tensor& k, const torch::Tensor& v,
              const torch::Tensor& slots) {
  TORCH_CHECK(kv.is_contiguous() && slots.scalar_type() == torch::kLong && slots.is_contiguous(),
              "write_kv: bad input");
  TORCH_CHECK(k.scalar_type() == kv.scalar_type() && v.scalar_type() == kv.scalar_type(),
              "write_kv: dtype mismatch");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
                  v.stride(1) == v.size(2) && k.size(1) == kv.size(2) && k.size(2) == kv.size(3) &&
                  slots.numel() == k.size(0),
              "write_kv: k/v rows must be [T, Hkv, D] with contiguous heads");
  const int64_t T = k.size(0), row = k.size(1) * k.size(2), S = kv.size(1);
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t es = kv.element_size();
  char* base = static_cast<char*>(kv.data_ptr());
  for (int64_t t = 0; t < T; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < S, "write_kv: slot out of range");
  // Both threads for a prefill chunk's rows (2,048 rows are 3 MB a layer, which the calling
  // thread copied alone while the other waited); a decode step's few rows in place.
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      // k/v rows are contiguous within a token (heads x D) but strided between tokens.
      std::memcpy(base + (sp[t] * row) * es,
                  static_cast<const char*>(k.data_ptr()) + t * k.stride(0) * es, row * es);
      std::memcpy(base + ((S + sp[t]) * row) * es,
                  static_cast<const char*>(v.data_ptr()) + t * v.stride(0) * es, row * es);
    }
  });
}

class LayerStack {
 public:
  LayerStack(std::vector<Layer> layers, int64_t H, int64_t Hkv, int64_t D, double eps)
      : layers_(std::move(layers)), H_(H), Hkv_(Hkv), D_(D), eps_(eps) {}

  // x: [T, hidden] residual stream (updated in place); returns (x, the last MLP output not yet
  // added), as the Python loop does. cos/sin: [T, D/2]; metadata as paged_decode takes it.
  std::tuple<torch::Tensor, torch::Tensor> forward(
      torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kv_caches,
      torch::Tensor slots, torch::Tensor tables, torch::Tensor ctx, torch::Tensor qstart,
      torch::Tensor qlen, int64_t block_size, double scale,
      c10::optional<torch::Tensor> tree_mask) const {
    return run(x, cos, sin, kv_caches, slots, tables, ctx, qstart, qlen, block_size, scale,
               tree_mask, {}, nullptr);
  }

  // forward, also returning the residual stream entering each layer listed in `capture` (as
  // x + delta, a new tensor: x is updated in place by the next layer), for an EAGLE-style drafter.
  std::tuple<torch::Tensor, torch::Tensor, std::vector<torch::Tensor>> forward_capture(
      torch::Tensor x, torch::Tensor cos, torch::Tensor sin, std::vector<torch::Tensor> kv_caches,
      torch::Tensor slots, torch::Tensor tables, torch::Tensor ctx, torch::Tensor qstart,
      torch::Tensor qlen, int64_t block_size, double scale, c10::optional<torch::Tensor> tree_mask,
      std::vector<int64_t> capture) const {
    std::vector<torch::Tensor> feats(capture.size());
    auto [y, delta] = run(x, cos, sin, kv_caches, slots, tables, ctx, qstart, qlen, block_size,
                          scale, tree_mask, capture, &feats);
    return {y, delta, feats};
  }

 private:
  std::tuple<torch::Tensor, torch::Tensor> run(
      torch::Tensor x, torch::Tensor cos, torch::Tensor sin,
      const std::vector<torch::Tensor>& kv_caches, torch::Tensor slots, torch::Tensor tables,
      torch::Tensor ctx, torch::Tensor qstart, torch::Tensor qlen, int64_t block_size, double scale,
      const c10::optional<torch::Tensor>& tree_mask, const std::vector<int64_t>& capture,
      std::vector<torch::Tensor>* feats) const {
    const int64_t T = x.size(0);
    torch::Tensor delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      for (size_t c = 0; c < capture.size(); ++c) {
        if (capture[c] == static_cast<int64_t>(i))
          (*feats)[c] = delta.defined() ? x + delta : x.clone();
      }
      const Layer& L = layers_[i];
      torch::Tensor h =
          delta.defined() ? add_rms_norm(x, delta, L.ln1, eps_) : rms_norm(x, L.ln1, eps_);
      torch::Tensor qkv = L.qkv(h);  // [T, (H + 2 Hkv) D]
      rope_inplace(qkv, cos, sin, H_ + Hkv_, D_);
      // A view: paged_decode reads each token's queries in place (a contiguous copy was 2.4 MB a
      // layer at a 2,048-token prefill).
      auto q = qkv.narrow(1, 0, H_ * D_).view({T, H_, D_});
      auto k = qkv.narrow(1, H_ * D_, Hkv_ * D_).view({T, Hkv_, D_});
      auto v = qkv.narrow(1, (H_ + Hkv_) * D_, Hkv_ * D_).view({T, Hkv_, D_});
      write_kv(kv_caches[i], k, v, slots);
      auto a = torch::empty({T, H_, D_}, qkv.options());  // [T, H, D]
      // tree_mask: [T, W] visibility among a request's rows (a draft tree's), else causal.
      paged_decode(q, kv_caches[i], tables, ctx, qstart, qlen, block_size, scale, a, 0, tree_mask,
                   -1, -1);
      h = add_rms_norm(x, L.o(a.view({T, H_ * D_})), L.ln2, eps_);
      delta = L.down(L.gate_up.silu_mul(h));
    }
    return {x, delta};
  }

  std::vector<Layer> layers_;
  int64_t H_, Hkv_, D_;
  double eps_;
};

void register_layer_stack(pybind11::module& m) {
  namespace py = pybind11;
  // module_local: a JIT build of edited sources loads beside the prebuilt module in one process
  // (cpu_kernels.py imports the prebuilt one first to read its build facts); global pybind types
  // of the same name would clash there.
  py::class_<QLinear>(m, "QLinear", py::module_local())
      .def(py::init([](torch::Tensor w, torch::Tensor d, c10::optional<torch::Tensor> mn, int64_t N,
                       int64_t G, int64_t bits) { return QLinear{w, d, mn, N, G, bits}; }));
  py::class_<Layer>(m, "Layer", py::module_local())
      .def(py::init([](QLinear qkv, QLinear o, QLinear gu, QLinear down, torch::Tensor ln1,
                       torch::Tensor ln2) { return Layer{qkv, o, gu, down, ln1, ln2}; }));
  py::class_<LayerStack>(m, "LayerStack", py::module_local())
      .def(py::init<std::vector<Layer>, int64_t, int64_t, int64_t, double>())
      // Without the GIL (see paged_decode.cpp's module): the whole layer stack is one call.
      .def("forward", &LayerStack::forward, py::call_guard<py::gil_scoped_release>())
      .def("forward_capture", &LayerStack::forward_capture,
           py::call_guard<py::gil_scoped_release>());
  m.def("write_kv", &write_kv, "rows of k and v into their KV slots",
        py::call_guard<py::gil_scoped_release>());
}
