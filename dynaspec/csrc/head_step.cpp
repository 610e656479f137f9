// An EAGLE-3 draft head's decoder layer, and its greedy drafts, as one C++ call per drafting pass
// (spec_decode/eagle.py runs the head; spec_decode/eagle_head.py is the same layer in torch).
//
// In torch a chained draft ran ~80 ops (two norms and a concatenation, four int8 linears each
// quantizing its activations, RoPE, attention, residuals, the draft lm_head and its argmax):
// 0.8-1.3 ms per drafted token against a ~4.5 ms target step, so the goodput policy rightly
// drafted little. Its arithmetic is ~9 MB of int8 weights read once per pass. Drafts only
// propose (verification decides every token), so this path need not round as the torch one does;
// the tests hold the two to fp32 tolerance.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "qlinear.h"

// fused_ops.cpp
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor w,
                           double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rope_inplace(torch::Tensor qkv, torch::Tensor cos, torch::Tensor sin, int64_t heads,
                  int64_t head_dim);
torch::Tensor argmax_rows(torch::Tensor logits);

namespace {

// One query row q [Hq, D] over keys 0..L-1 of a request's buffers k, v [cap, Hkv, D] (grouped
// query heads share a key head); out [Hq, D]; scores: room for L floats.
void attend_row(const float* q, const float* k, const float* v, int64_t L, int64_t Hq, int64_t Hkv,
                int64_t D, float scale, float* out, float* scores) {
  const int64_t G = Hq / Hkv;
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t kh = h / G;
    const float* qh = q + h * D;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t t = 0; t < L; ++t) {
      const float* kt = k + (t * Hkv + kh) * D;
      float s = 0.f;
#pragma omp simd reduction(+ : s)
      for (int64_t d = 0; d < D; ++d) s += qh[d] * kt[d];
      scores[t] = s * scale;
      mx = std::max(mx, scores[t]);
    }
    float sum = 0.f;
    for (int64_t t = 0; t < L; ++t) {
      scores[t] = std::exp(scores[t] - mx);
      sum += scores[t];
    }
    float* oh = out + h * D;
    std::fill(oh, oh + D, 0.f);
    const float inv = 1.f / sum;
    for (int64_t t = 0; t < L; ++t) {
      const float p = scores[t] * inv;
      const float* vt = v + (t * Hkv + kh) * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) oh[d] += p * vt[d];
    }
  }
}

void check_rows(const torch::Tensor& t, int64_t N, int64_t H, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == H &&
                  t.scalar_type() == torch::kFloat && t.is_contiguous(),
              "HeadStep: ", what, " must be contiguous float32 [", N, ", ", H, "]");
}

}  // namespace

class HeadStep {
 public:
  HeadStep(QLinear fc, QLinear qkv, QLinear o, QLinear gate_up, QLinear down, QLinear lm_head,
           torch::Tensor ln_emb, torch::Tensor ln_hidden, torch::Tensor ln_post, torch::Tensor norm,
           torch::Tensor d2t, int64_t Hq, int64_t Hkv, int64_t D, double eps)
      : fc_(std::move(fc)),
        qkv_(std::move(qkv)),
        o_(std::move(o)),
        gate_up_(std::move(gate_up)),
        down_(std::move(down)),
        lm_(std::move(lm_head)),
        ln_emb_(ln_emb.contiguous()),
        ln_hidden_(ln_hidden.contiguous()),
        ln_post_(ln_post.contiguous()),
        norm_(norm.contiguous()),
        d2t_(d2t.contiguous()),
        Hq_(Hq),
        Hkv_(Hkv),
        D_(D),
        eps_(eps) {
    TORCH_CHECK(Hkv > 0 && Hq % Hkv == 0 && d2t_.scalar_type() == torch::kLong,
                "HeadStep: bad head shape");
  }

  // The layer over N rows grouped by request. h (the fused features, or the previous draft's
  // output), emb (the token embeddings): [N, H]; cos, sin: [N, D/2]. Per request: its key and
  // value buffers [cap, Hkv, D], the buffer row its first row is written at, and its row count;
  // row r of a request attends to buffer rows 0..at + r. Returns the layer output [N, H].
  torch::Tensor layer(torch::Tensor h, torch::Tensor emb, torch::Tensor cos, torch::Tensor sin,
                      std::vector<torch::Tensor> keys, std::vector<torch::Tensor> vals,
                      std::vector<int64_t> at, std::vector<int64_t> sizes) const {
    const int64_t N = h.size(0), H = h.size(1), half = D_ / 2;
    check_rows(h, N, H, "h");
    check_rows(emb, N, H, "emb");
    check_rows(cos, N, half, "cos");
    check_rows(sin, N, half, "sin");
    const size_t R = sizes.size();
    TORCH_CHECK(keys.size() == R && vals.size() == R && at.size() == R,
                "HeadStep: one buffer pair per request");
    std::vector<const float*> kp(N), vp(N);
    std::vector<int64_t> len(N);  // keys row r attends to
    int64_t row = 0;
    for (size_t i = 0; i < R; ++i) {
      for (const auto* b : {&keys[i], &vals[i]}) {
        TORCH_CHECK(b->dim() == 3 && b->size(1) == Hkv_ && b->size(2) == D_ && b->is_contiguous() &&
                        b->scalar_type() == torch::kFloat && b->size(0) >= at[i] + sizes[i] &&
                        at[i] >= 0,
                    "HeadStep: request ", i,
                    "'s KV buffer must be contiguous float32 [>= ", at[i] + sizes[i], ", ", Hkv_,
                    ", ", D_, "]");
      }
      for (int64_t r = 0; r < sizes[i]; ++r, ++row) {
        TORCH_CHECK(row < N, "HeadStep: the requests' sizes exceed the ", N, " rows");
        kp[row] = keys[i].data_ptr<float>();
        vp[row] = vals[i].data_ptr<float>();
        len[row] = at[i] + r + 1;
      }
    }
    TORCH_CHECK(row == N, "HeadStep: the requests' sizes cover ", row, " of ", N, " rows");

    // [N, 2H]
    auto x = torch::cat({rms_norm(emb, ln_emb_, eps_), rms_norm(h, ln_hidden_, eps_)}, 1);
    auto qkv = qkv_(x);  // [N, (Hq + 2 Hkv) D]
    rope_inplace(qkv, cos, sin, Hq_ + Hkv_, D_);
    const int64_t W = qkv.size(1), kvw = Hkv_ * D_;
    const float* qp = qkv.data_ptr<float>();
    for (int64_t r = 0; r < N; ++r) {  // this pass's keys and values into their buffer rows
      const int64_t slot = (len[r] - 1) * kvw;
      std::memcpy(const_cast<float*>(kp[r]) + slot, qp + r * W + Hq_ * D_, kvw * sizeof(float));
      std::memcpy(const_cast<float*>(vp[r]) + slot, qp + r * W + Hq_ * D_ + kvw,
                  kvw * sizeof(float));
    }
    auto a = torch::empty({N, Hq_ * D_}, torch::kFloat);
    float* ap = a.data_ptr<float>();
    const float scale = 1.f / std::sqrt(static_cast<float>(D_));
    std::vector<char> single(N, 1);  // rows attended one by one below
    int64_t o = 0;
    for (size_t i = 0; i < R; o += sizes[i], ++i) {
      // A request's catch-up of several rows (a prompt's: hundreds) through torch's vectorised
      // CPU attention: row by row it cost ~50 ms a 250-token prompt, the head's whole prefill.
      if (sizes[i] <= 1) continue;
      const int64_t n = sizes[i], L = at[i] + n;
      auto q = qkv.narrow(0, o, n)
                   .narrow(1, 0, Hq_ * D_)
                   .view({n, Hq_, D_})
                   .transpose(0, 1)
                   .unsqueeze(0);
      auto K = keys[i].narrow(0, 0, L).transpose(0, 1).unsqueeze(0);  // [1, Hkv, L, D]
      auto V = vals[i].narrow(0, 0, L).transpose(0, 1).unsqueeze(0);
      auto mask = torch::ones({n, L}, torch::kBool).tril(at[i]);  // row r sees keys <= at + r
      // [1, Hq, n, D]
      auto out = at::scaled_dot_product_attention(q, K, V, mask, 0.0, false, c10::nullopt, true);
      a.narrow(0, o, n).view({n, Hq_, D_}).copy_(out[0].transpose(0, 1));
      std::fill(single.begin() + o, single.begin() + o + n, 0);
    }
    at::parallel_for(0, N, 4, [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t r = begin; r < end; ++r) {
        if (!single[r]) continue;
        scores.resize(len[r]);
        attend_row(qp + r * W, kp[r], vp[r], len[r], Hq_, Hkv_, D_, scale, ap + r * Hq_ * D_,
                   scores.data());
      }
    });
    auto res = h.clone();  // add_rms_norm adds the attention output into it in place
    auto m = add_rms_norm(res, o_(a), ln_post_, eps_);
    return res + down_(silu_mul(gate_up_(m)));
  }

  // A drafting pass for B requests in one call: fuse each request's pending target features
  // (feats [N, feature_size], emb [N, H] the embeddings of the tokens after theirs, pos [N] their
  // positions; sizes[b] rows each) into the head's KV at buffer rows at[b].., then chain k[b]
  // drafts from each request's newest row (see chain; its drafts are written after those rows).
  torch::Tensor draft(torch::Tensor feats, torch::Tensor emb, torch::Tensor pos,
                      std::vector<int64_t> sizes, std::vector<torch::Tensor> keys,
                      std::vector<torch::Tensor> vals, std::vector<int64_t> at,
                      std::vector<int64_t> k, torch::Tensor emb_rows, torch::Tensor cos_table,
                      torch::Tensor sin_table) const {
    TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.numel() == feats.size(0),
                "HeadStep.draft: one position per feature row");
    auto out = layer(fc_(feats.contiguous()), emb, cos_table.index_select(0, pos),
                     sin_table.index_select(0, pos), keys, vals, at, sizes);  // [N, H]
    std::vector<int64_t> last, next_at(at);
    int64_t row = -1;
    for (size_t b = 0; b < sizes.size(); ++b) {
      row += sizes[b];
      last.push_back(row);
      next_at[b] += sizes[b];
    }
    auto sel = torch::tensor(last, torch::kLong);
    return chain(out.index_select(0, sel), pos.index_select(0, sel), keys, vals, next_at, k,
                 emb_rows, cos_table, sin_table);
  }

  // Chained greedy drafts for B requests, the first from out [B, H] (the layer output at each
  // request's newest verified pair, position pos[b]), each next one from the layer run on the
  // previous draft: request b drafts k[b] tokens, its draft j (j >= 1) written at buffer row
  // at[b] + j - 1. emb_rows: [draft_vocab, H] the embedding of each draft-vocabulary token;
  // cos_table, sin_table: [positions, D/2]. Returns the target ids [B, max k], -1 past k[b].
  torch::Tensor chain(torch::Tensor out, torch::Tensor pos, std::vector<torch::Tensor> keys,
                      std::vector<torch::Tensor> vals, std::vector<int64_t> at,
                      std::vector<int64_t> k, torch::Tensor emb_rows, torch::Tensor cos_table,
                      torch::Tensor sin_table) const {
    const int64_t B = out.size(0);
    TORCH_CHECK(pos.scalar_type() == torch::kLong && pos.numel() == B &&
                    static_cast<int64_t>(k.size()) == B && static_cast<int64_t>(keys.size()) == B &&
                    static_cast<int64_t>(at.size()) == B,
                "HeadStep.chain: one position, k, start row and buffer pair per request");
    TORCH_CHECK(emb_rows.dim() == 2 && emb_rows.size(0) == d2t_.size(0) &&
                    emb_rows.scalar_type() == torch::kFloat,
                "HeadStep.chain: emb_rows must be float32 [draft vocab, H]");
    const int64_t kmax = B ? *std::max_element(k.begin(), k.end()) : 0;
    auto drafts = torch::full({B, std::max<int64_t>(kmax, 0)}, -1, torch::kLong);
    if (kmax <= 0) return drafts;
    auto* dp = drafts.data_ptr<int64_t>();
    std::vector<int64_t> alive(B);  // the requests still drafting, in row order of out / idx
    for (int64_t b = 0; b < B; ++b) alive[b] = b;
    auto idx = draft_index(out);  // [b] draft-vocabulary ids
    auto p = pos.clone();
    for (int64_t j = 0;; ++j) {
      const int64_t* ip = idx.data_ptr<int64_t>();
      const int64_t* tp = d2t_.data_ptr<int64_t>();
      std::vector<int64_t> keep;
      for (size_t m = 0; m < alive.size(); ++m) {
        dp[alive[m] * kmax + j] = tp[ip[m]];
        if (k[alive[m]] > j + 1) keep.push_back(static_cast<int64_t>(m));
      }
      if (keep.empty()) break;
      auto sel = torch::tensor(keep, torch::kLong);
      std::vector<torch::Tensor> kb, vb;
      std::vector<int64_t> ab, ones(keep.size(), 1), next;
      for (int64_t m : keep) {
        const int64_t b = alive[m];
        kb.push_back(keys[b]);
        vb.push_back(vals[b]);
        ab.push_back(at[b] + j);
        next.push_back(b);
      }
      p = p.index_select(0, sel) + 1;
      out = layer(out.index_select(0, sel), emb_rows.index_select(0, idx.index_select(0, sel)),
                  cos_table.index_select(0, p), sin_table.index_select(0, p), kb, vb, ab, ones);
      idx = draft_index(out);
      alive = std::move(next);
    }
    return drafts;
  }

 private:
  torch::Tensor draft_index(const torch::Tensor& out) const {
    check_rows(out, out.size(0), out.size(1), "out");
    return argmax_rows(lm_(rms_norm(out, norm_, eps_)));
  }

  QLinear fc_, qkv_, o_, gate_up_, down_, lm_;
  torch::Tensor ln_emb_, ln_hidden_, ln_post_, norm_, d2t_;
  int64_t Hq_, Hkv_, D_;
  double eps_;
};

void register_head_step(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<HeadStep>(m, "HeadStep", py::module_local())
      .def(py::init<QLinear, QLinear, QLinear, QLinear, QLinear, QLinear, torch::Tensor,
                    torch::Tensor, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, int64_t,
                    int64_t, double>())
      .def("draft", &HeadStep::draft, py::call_guard<py::gil_scoped_release>());
}
