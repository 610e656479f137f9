// Attention that reads the paged KV cache in place (no gather into a padded copy), for decode,
// verify and prefill rows alike: a row's result is the same sequence of operations whatever the
// width of its request's step, its tile or the batch, so chunking, batching and speculation
// cannot change a request's tokens.
//
// One work item is (request, tile of <= 32 query tokens, KV head): its G query heads x tokens are
// scored against the request's context block by block, straight from the cache, then each row's
// softmax, the value sums and the output. Every path's item has that shape (attn_item.h): an
// AttnCall (the call's inputs) and an AttnItem (the item's geometry, attn_call.h) in, the blocks
// walked by one iterator shared by the paths (ItemBlocks: the next blocks prefetched, since they
// sit at random places in the pool, and the next request's KV brought into L2 meanwhile). This
// file only chooses the path's item and hands the items to the threads (attn_schedule.h). Causal
// within the step: query j of a request with W queries and context C sits at absolute position
// C - W + j and sees keys 0..C-W+j (from C - W + j - window + 1 in a sliding window; a token
// tree's row sees its root path's keys, attn_tree.h).
//
// Paths (AttnPath, cpu_paths.h; chosen once by dynaspec/cpu_features.py, or forced per call):
// scalar, the plain-loop reference (attn_reference.h); fp32 (Fp32Item, attn_fp32_item.h), the
// keys converted to fp32 and transposed, loops the compiler vectorises for the build's ISA, the
// reference's bits; avx2 (Avx2Item, attn_avx2_item.h: any build, an AVX2 + FMA CPU), the same rows
// in 8-lane intrinsics, the reference's bits with fused value sums; avx512 (Fp32Item<true>, an
// AVX-512 build), the fp32 rows with the value sums in registers by fma, the reference's bits
// with fused value sums; avx512_bf16 (attn_bf16_item.h), bf16 dot-product scores on the cached
// keys as they are (Bf16Item: the reference's bits with its vdpbf16ps emulation) and, for bf16 KV
// at D = 64 / 128, bf16 probabilities two keys at a time (PairsItem: attn_pairs.h, within a
// stated bound of the reference). Softmax, key transposes and conversions give the same bits on
// every path (exact, or the same operations in the same order), so they follow the build rather
// than the path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attn_avx2_item.h"
#include "attn_bf16_item.h"
#include "attn_call.h"
#include "attn_fp32_item.h"
#include "attn_item.h"
#include "attn_reference.h"
#include "attn_schedule.h"
#include "cpu_paths.h"

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace {

// Query tokens per work item: long prefill chunks split into tiles so both threads get work and
// the score buffer stays in L2 (96 rows x 800 keys: 300 KB). 32 against 16 measured 0.92-0.95x
// on prefill chunks (the key transposes and value conversions shared by twice the rows); 8 was
// 1.09x. A row's arithmetic does not depend on its tile (see above).
constexpr int64_t QUERY_TILE = 32;

// Token trees: tm[(qs[b] + j) * tmw + k] says whether request b's row j sees its row k; a request
// is a tree where some row does not see every earlier row of its step. [B]: whether each is one.
std::vector<char> tree_requests(const uint8_t* tm, int64_t tmw, const int64_t* qs,
                                const int64_t* ql, int64_t B) {
  std::vector<char> tree(B, 0);
  for (int64_t b = 0; tm != nullptr && b < B; ++b)
    for (int64_t j = 0; j < ql[b] && !tree[b]; ++j)
      for (int64_t k = 0; k <= j && !tree[b]; ++k) tree[b] = !tm[(qs[b] + j) * tmw + k];
  return tree;
}

// Every item of the call through Item::run, each thread its share.
template <typename Item, typename T>
void schedule(const AttnCall<T>& c, const AttnTiles& tiles) {
  schedule_items(tiles, c.Hkv, c.cl, c.ql,
                 [&](auto&& next, auto&& ahead) { run_items<Item>(c, tiles.list, next, ahead); });
}

// The call's inputs as every path's items read them; tree: [B] tree_requests'.
template <typename T>
AttnCall<T> call_of(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
                    const torch::Tensor& ctx, const torch::Tensor& qstart,
                    const torch::Tensor& qlen, torch::Tensor& out, int64_t block_size, double scale,
                    int64_t window, const uint8_t* tm, int64_t tmw, const char* tree) {
  const int64_t H = q.size(1), D = q.size(2), Hkv = kv.size(2);
  const T* kp = kv.data_ptr<T>();
  // A token's queries: contiguous heads, any token stride (is_contiguous ignores the strides of
  // size-1 dimensions, so a contiguous q's own stride(0) may not be H * D).
  const int64_t qstride = q.is_contiguous() ? H * D : q.stride(0);
  return {.qp = q.data_ptr<T>(),
          .qstride = qstride,
          .kp = kp,
          .vp = kp + kv.size(1) * Hkv * D,
          .op = out.data_ptr<T>(),
          .tb = tables.data_ptr<int64_t>(),
          .cl = ctx.data_ptr<int64_t>(),
          .qs = qstart.data_ptr<int64_t>(),
          .ql = qlen.data_ptr<int64_t>(),
          .NB = tables.size(1),
          .H = H,
          .Hkv = Hkv,
          .G = H / Hkv,
          .D = D,
          .block_size = block_size,
          .sc = static_cast<float>(scale),
          .window = window,
          .tm = tm,
          .tmw = tmw,
          .tree = tree};
}

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
         const torch::Tensor& ctx, const torch::Tensor& qstart, const torch::Tensor& qlen,
         int64_t block_size, double scale, int64_t window, torch::Tensor& out, const uint8_t* tm,
         int64_t tmw, AttnPath path, AttnPath numerics_of) {
  const int64_t B = tables.size(0), D = q.size(2);
  const std::vector<char> tree =
      tree_requests(tm, tmw, qstart.data_ptr<int64_t>(), qlen.data_ptr<int64_t>(), B);
  const AttnCall<T> c = call_of<T>(q, kv, tables, ctx, qstart, qlen, out, block_size, scale, window,
                                   tm, tmw, tree.data());
  if (path == AttnPath::Scalar) {
    const bool any_tree = std::any_of(tree.begin(), tree.end(), [](char t) { return t != 0; });
    attend_reference(c.qp, c.qstride, c.kp, c.vp, c.op, c.tb, c.NB, c.cl, c.qs, c.ql, B, c.H, c.Hkv,
                     D, block_size, c.sc, window, any_tree ? tm : nullptr, tmw,
                     numerics<T>(numerics_of, D, block_size));
    return;
  }
  // Which rows share an item never changes a row's arithmetic, only who converts K/V to fp32.
  // (Splitting a batch-1 decode's Hkv items further by query head measured slower: K/V converted
  // per item outweighed the idle thread.)
  const AttnTiles tiles = attn_tiles(c.ql, B, c.Hkv, QUERY_TILE);
  if constexpr (kAvx2Type<T>) {
    if (path == AttnPath::Avx2 && avx2_rows<T>(D)) return schedule<Avx2Item>(c, tiles);
  }
  // The AVX-512 intrinsics of the value sums (and the bf16 probabilities) run on the AVX-512 paths.
  const bool v512 = kAvx512Build && path >= AttnPath::Avx512;
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (path == AttnPath::Avx512Bf16 && D % 32 == 0) {
      // Value sums with bf16 probabilities where they have a register layout (a pair of keys
      // never straddles a block); a tree's rows take them too (a chain and a tree in one step, or
      // a path verified as a tree and as a chain, must give the same bits).
      const bool pairs = v512 && (D == 64 || D == 128) && block_size % 2 == 0;
      return pairs ? schedule<PairsItem>(c, tiles) : schedule<Bf16Item>(c, tiles);
    }
  }
  return v512 ? schedule<Fp32Item<true>>(c, tiles) : schedule<Fp32Item<false>>(c, tiles);
}

}  // namespace

// q: [T, H, D] (heads contiguous within a token); kv: [2, S, Hkv, D]; tables: [B, NB] long;
// ctx, qstart, qlen: [B] long. Writes rows qstart[b] .. qstart[b] + qlen[b] of out ([T, H, D],
// same dtype as q).
// window > 0: a query at position p sees keys max(0, p - window + 1) .. p (sliding window).
// tree_mask: token trees, [T, W] uint8 over each request's rows (row j sees row k of its step
// where tree_mask[qstart + j, k]); absent or empty: every step causal.
// path: an AttnPath to force (-1: the selected one); a path set_cpu_paths did not allow is an
// error (Python refuses it first, naming the missing CPU flags). numerics_of: with path 0 (the
// reference), the path whose numerics it reproduces (-1: its own).
void paged_decode(torch::Tensor q, torch::Tensor kv, torch::Tensor tables, torch::Tensor ctx,
                  torch::Tensor qstart, torch::Tensor qlen, int64_t block_size, double scale,
                  torch::Tensor out, int64_t window, c10::optional<torch::Tensor> tree_mask,
                  int64_t path, int64_t numerics_of) {
  const CpuPaths& allowed = cpu_paths();
  if (path < 0) path = allowed.attn;
  TORCH_CHECK(path < kNumAttnPaths, "paged_decode: no path ", path, " (0-", kNumAttnPaths - 1, ")");
  TORCH_CHECK(allowed.attn_ok[path], "paged_decode: path ", kAttnPaths[path],
              " is not one this CPU can run");
  TORCH_CHECK(numerics_of < 0 || (path == 0 && numerics_of < kNumAttnPaths),
              "paged_decode: numerics_of is for the reference (path 0), one of paths 0-",
              kNumAttnPaths - 1);
  if (numerics_of < 0) numerics_of = path;
  // q may be a view of the fused qkv rows (its tokens strided, each token's heads contiguous).
  TORCH_CHECK(q.dim() == 3, "q: [T, H, D] expected");
  TORCH_CHECK(q.is_contiguous() || (q.stride(2) == 1 && q.stride(1) == q.size(2) &&
                                    q.stride(0) >= q.size(1) * q.size(2)),
              "q: each token's heads must be contiguous ([T, H, D], any token stride)");
  TORCH_CHECK(kv.is_contiguous() && out.is_contiguous(), "contiguous kv and out expected");
  TORCH_CHECK(q.scalar_type() == kv.scalar_type() && q.scalar_type() == out.scalar_type(),
              "dtype mismatch");
  TORCH_CHECK(tables.scalar_type() == torch::kLong && ctx.scalar_type() == torch::kLong,
              "long metadata expected");
  TORCH_CHECK(q.size(1) % kv.size(2) == 0, "query heads must be a multiple of KV heads");
  auto t = tables.contiguous(), c = ctx.contiguous(), s = qstart.contiguous(),
       l = qlen.contiguous();
  torch::Tensor m;
  if (tree_mask.has_value() && tree_mask->numel() > 0) {
    m = tree_mask->to(torch::kUInt8).contiguous();
    TORCH_CHECK(m.dim() == 2 && m.size(0) == q.size(0), "tree_mask: [T, W] expected");
    for (int64_t b = 0; b < l.size(0); ++b)
      TORCH_CHECK(l.data_ptr<int64_t>()[b] <= m.size(1),
                  "tree_mask narrower than a request's rows");
  }
  const uint8_t* tm = m.defined() ? m.data_ptr<uint8_t>() : nullptr;
  const int64_t tmw = m.defined() ? m.size(1) : 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_decode", [&] {
    run<scalar_t>(q, kv, t, c, s, l, block_size, scale, window, out, tm, tmw,
                  static_cast<AttnPath>(path), static_cast<AttnPath>(numerics_of));
  });
}
