// Attention that reads the paged KV cache in place (no gather into a padded copy), for decode,
// verify and prefill rows alike: a row's result is the same sequence of operations whatever the
// width of its request's step, its tile or the batch, so chunking, batching and speculation
// cannot change a request's tokens.
//
// One work item is (request, tile of <= 32 query tokens, KV head): its G query heads x tokens are
// scored against the request's context block by block, straight from the cache. With bf16 KV on
// an AVX512-BF16 CPU the scores are bf16 dot products on the cached keys as they are (exact
// products, fp32 sums), and the value sums take bf16 probabilities two keys at a time
// (attn_pairs.h: FlashAttention's numerics). Otherwise the keys are converted to fp32 and
// transposed, V of each block is converted to fp32 once per work item, and softmax and
// accumulation are in fp32. The next blocks are prefetched (they sit at random places in the
// pool). Causal within the step: query j of a request with W queries and context C sits at
// absolute position C - W + j and sees keys 0..C-W+j.
//
// Paths (AttnPath, cpu_paths.h; chosen once by dynaspec/cpu_features.py, or forced per call):
// scalar, the plain-loop reference (attn_reference.h); fp32, the work items as loops the compiler
// vectorises for the build's ISA, the reference's bits; avx2 (any build, an AVX2 + FMA CPU), the
// same rows in 8-lane intrinsics (attn_avx2_item.h), the reference's bits with fused value sums;
// avx512 (an AVX-512 build), the fp32 rows with the value sums in registers by fma, the
// reference's bits with fused value sums; avx512_bf16, bf16 dot-product scores (the reference's
// bits with its vdpbf16ps emulation) and, for bf16 KV at D = 64 / 128, bf16 probabilities
// (attn_pairs.h, within a stated bound of the reference). Softmax, key transposes and conversions
// give the same bits on every path (exact, or the same operations in the same order), so they
// follow the build rather than the path.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "attn_avx2_item.h"
#include "attn_call.h"
#include "attn_fp32.h"
#include "attn_pairs.h"
#include "attn_prefetch.h"
#include "attn_reference.h"
#include "attn_rows.h"
#include "attn_schedule.h"
#include "cpu_paths.h"
#include "vec_exp.h"

#include "simd.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// Query tokens per work item: long prefill chunks split into tiles so both threads get work and
// the score buffer stays in L2 (96 rows x 800 keys: 300 KB). 32 against 16 measured 0.92-0.95x
// on prefill chunks (the key transposes and value conversions shared by twice the rows); 8 was
// 1.09x. A row's arithmetic does not depend on its tile (see below).
constexpr int64_t QUERY_TILE = 32;

// Rows from which a work item's key groups are transposed once for all its rows (scores_rows_bf16)
// rather than each row reducing its own 16 lanes per key group. A prefill tile has 96; a batch-1
// verify item of 9 rows measured 1.03-1.06x slower transposed, one of 27 0.94x.
constexpr int64_t MANY_ROWS = 16;

// Blocks of values a many-row item converts to fp32 at a time (8 of 16 slots at D = 64:
// 32 KB, in L1).
constexpr int64_t V_CHUNK = 8;

template <typename T>
void run(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& tables,
         const torch::Tensor& ctx, const torch::Tensor& qstart, const torch::Tensor& qlen,
         int64_t block_size, double scale, int64_t window, torch::Tensor& out, const uint8_t* tm,
         int64_t tmw, AttnPath path, AttnPath numerics_of) {
  const int64_t B = tables.size(0), NB = tables.size(1);
  const int64_t H = q.size(1), D = q.size(2), Hkv = kv.size(2), G = H / Hkv;
  const int64_t slots = kv.size(1);
  const T* qp = q.data_ptr<T>();
  // A token's queries: contiguous heads, any token stride (is_contiguous ignores the strides of
  // size-1 dimensions, so a contiguous q's own stride(0) may not be H * D).
  const int64_t qstride = q.is_contiguous() ? H * D : q.stride(0);
  const T* kp = kv.data_ptr<T>();
  const T* vp = kp + slots * Hkv * D;
  T* op = out.data_ptr<T>();
  const int64_t* tb = tables.data_ptr<int64_t>();
  const int64_t* cl = ctx.data_ptr<int64_t>();
  const int64_t* qs = qstart.data_ptr<int64_t>();
  const int64_t* ql = qlen.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  // Token trees: tm[(qs[b] + j) * tmw + k] says whether request b's row j sees its row k; a
  // request is a tree where some row does not see every earlier row of its step.
  std::vector<char> tree(B, 0);
  bool any_tree = false;
  for (int64_t b = 0; tm != nullptr && b < B; ++b)
    for (int64_t j = 0; j < ql[b] && !tree[b]; ++j)
      for (int64_t k = 0; k <= j && !tree[b]; ++k) tree[b] = !tm[(qs[b] + j) * tmw + k];
  for (int64_t b = 0; b < B; ++b) any_tree = any_tree || tree[b];
  if (path == AttnPath::Scalar) {
    attend_reference(qp, qstride, kp, vp, op, tb, NB, cl, qs, ql, B, H, Hkv, D, block_size, sc,
                     window, any_tree ? tm : nullptr, tmw, numerics<T>(numerics_of, D, block_size));
    return;
  }
  // The AVX-512 intrinsics of the value sums (and the bf16 probabilities) run on the AVX-512 paths.
  const bool v512 = kAvx512Build && path >= AttnPath::Avx512;
  const bool bf16dot =
      std::is_same_v<T, c10::BFloat16> && D % 32 == 0 && path == AttnPath::Avx512Bf16;
  // Value sums with bf16 probabilities (attn_pairs.h); a pair of keys never straddles a block.
  // A tree's rows take them too (tree_rows_in_pairs): a chain and a tree in the same step, or a
  // path verified as a tree and as a chain, must give the same bits.
  const bool pairs_pv = bf16dot && v512 && (D == 64 || D == 128) && block_size % 2 == 0;
  // Work items: (request, first query token of the tile, KV head). Which rows share an item never
  // changes a row's arithmetic, only who converts K/V to fp32. (Splitting a batch-1 decode's Hkv
  // items further by query head measured slower: K/V converted per item outweighed the
  // idle thread.)
  std::vector<std::array<int64_t, 3>> tiles;  // (request, first query token, end token)
  // A small verify step (batch 1: 3 KV heads on 2 threads) left one thread twice the other's
  // rows; its queries then split in two tiles, so each thread gets half of every head's rows.
  bool short_queries = true;  // decode and verify steps: every request fits one tile
  for (int64_t b = 0; b < B; ++b) short_queries = short_queries && ql[b] <= QUERY_TILE;
  const bool split = short_queries && B * Hkv < 2 * at::get_num_threads();
  for (int64_t b = 0; b < B; ++b) {
    const int64_t tile = split && ql[b] > 1 ? (ql[b] + 1) / 2 : QUERY_TILE;
    for (int64_t j0 = 0; j0 < ql[b]; j0 += tile)
      tiles.push_back({b, j0, std::min(ql[b], j0 + tile)});
  }
  // Request b's rows of KV head h in block blk of a cache: the first, and how many lie before Ct.
  auto head_rows = [&](const T* cache, int64_t b, int64_t h, int64_t blk, int64_t Ct) {
    return std::make_pair(cache + (tb[b * NB + blk] * block_size * Hkv + h) * D,
                          std::min(block_size, Ct - blk * block_size));
  };
  // The first key a query at position pos sees (later than 0 in a sliding window).
  auto first_key = [&](int64_t pos) {
    return window > 0 ? std::max<int64_t>(0, pos - window + 1) : int64_t{0};
  };
  // One thread's share of the items (attn_schedule.h: `next()` its next item, -1: none left;
  // `ahead(item)` the request whose KV to bring into L2 while that item runs, -1: none).
  auto run_items = [&](auto&& next, auto&& ahead) {
    std::vector<float> qf, sf, accf, packed;
    std::vector<float> kf(KEY_LANES * D), kt(KEY_LANES * D), vf(block_size * D);
    std::vector<float> part;  // scores_rows_bf16's block sums: [4][R][16], sized when first used
    std::vector<const T*> qptr;
#if defined(DYNASPEC_AVX512)
    std::vector<c10::BFloat16> pb;  // bf16 probabilities: [R][Ct rounded up to a pair]
    std::vector<float> inv;         // [R]: 1 / each row's sum of exps
    std::vector<int32_t> vpairs;    // V_CHUNK blocks of value pairs: [pairs][D / 16][16]
    // Pass 2 and the output of an item with bf16 probabilities (attn_pairs.h): a decode's few
    // rows take the value pairs straight from the cache, more rows from V_CHUNK blocks
    // interleaved once for them all. Every row gets the same operations either way.
    auto values_in_pairs = [&](auto nv, int64_t b, int64_t h, int64_t j0, int64_t R, int64_t Ct,
                               int64_t last, auto& pre) {
      constexpr int NV = decltype(nv)::value;
      const int64_t first = cl[b] - ql[b] + j0;  // the item's first token's position
      const int64_t ne = Ct + (Ct & 1), rs = Hkv * D;
      if (static_cast<int64_t>(pb.size()) < R * ne) pb.resize(R * ne);
      inv.resize(R);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t pos = first + r / G;
        inv[r] = exp_row_bf16(sf.data() + r * Ct, first_key(pos), pos, ne, pb.data() + r * ne);
      }
      auto acc = [&](int64_t r) { return accf.data() + r * D; };
      const bool direct = R <= 4;
      const int64_t span = direct ? 1 : V_CHUNK;
      if (!direct && static_cast<int64_t>(vpairs.size()) < span * block_size / 2 * NV * 16)
        vpairs.resize(span * block_size / 2 * NV * 16);
      for (int64_t c0 = 0; c0 <= last; c0 += span) {
        const int64_t c1 = std::min(last + 1, c0 + span);
        const int64_t k0 = c0 * block_size, n = std::min(Ct, c1 * block_size) - k0;
        for (int64_t blk = c0; blk < c1; ++blk) {
          pre.step();
          if (blk + AHEAD <= last) {
            const auto [next, rows] = head_rows(vp, b, h, blk + AHEAD, Ct);
            prefetch_rows(next, rs, rows, D);
          }
          if (direct) continue;
          const auto [v, rows] = head_rows(vp, b, h, blk, Ct);
          int32_t* dst = vpairs.data() + (blk - c0) * block_size / 2 * NV * 16;
          for (int64_t t = 0; t < rows; t += 2) {
            __m512i x[NV];
            value_pairs<NV>(v + t * rs, t + 1 < rows ? v + (t + 1) * rs : nullptr, x);
            for (int i = 0; i < NV; ++i) _mm512_storeu_si512(dst + (t / 2 * NV + i) * 16, x[i]);
          }
        }
        auto prob = [&](int64_t r) { return pb.data() + r * ne + k0; };
        auto pairs = [&](int64_t r) {
          return (std::max<int64_t>(0, std::min(n, first + r / G + 1 - k0)) + 1) / 2;
        };
        if (direct) {
          const T* v = head_rows(vp, b, h, c0, Ct).first;
          accumulate_pairs<NV>(R, acc, prob, pairs, [&](int64_t j, __m512i* x) {
            value_pairs<NV>(v + 2 * j * rs, 2 * j + 1 < n ? v + (2 * j + 1) * rs : nullptr, x);
          });
        } else {
          accumulate_pairs<NV>(R, acc, prob, pairs, [&](int64_t j, __m512i* x) {
            for (int i = 0; i < NV; ++i)
              x[i] = _mm512_loadu_si512(vpairs.data() + (j * NV + i) * 16);
          });
        }
      }
      for (int64_t r = 0; r < R; ++r)
        store_pairs_row<NV>(acc(r), inv[r], op + ((qs[b] + j0 + r / G) * H + h * G + r % G) * D);
    };
    // The same for the rows of a token tree, one row at a time: a row's keys are the context
    // and then its root path, laid out as that path verified as a chain lays them out (the path's
    // node of depth d at C - W + d), so its exps, sums and value pairs, which pair keys by their
    // position, are the chain row's operations on the chain row's operands: the same bits.
    // (Scores do not depend on a key's position, so they are read where pass 1 wrote them.)
    std::vector<float> vs;      // the row's scores in chain order
    std::vector<int64_t> keys;  // chain position -> the key's position in this step's cache
    auto tree_rows_in_pairs = [&](auto nv, int64_t b, int64_t h, int64_t j0, int64_t R,
                                  int64_t Ct) {
      constexpr int NV = decltype(nv)::value;
      const int64_t step0 = cl[b] - ql[b], rs = Hkv * D;
      const int64_t ne = Ct + (Ct & 1);
      if (static_cast<int64_t>(pb.size()) < ne) pb.resize(ne);
      vs.resize(Ct);
      keys.resize(Ct);
      for (int64_t r = 0; r < R; ++r) {
        const int64_t j = j0 + r / G;
        const uint8_t* visible = tm + (qs[b] + j) * tmw;
        int64_t n = step0;
        for (int64_t k = 0; k < step0; ++k) keys[k] = k;
        for (int64_t k = 0; k <= j; ++k)
          if (visible[k]) keys[n++] = step0 + k;
        for (int64_t t = 0; t < n; ++t) vs[t] = sf[r * Ct + keys[t]];
        // n - 1: the row's chain position (its window counts in those)
        const float row_inv =
            exp_row_bf16(vs.data(), first_key(n - 1), n - 1, n + (n & 1), pb.data());
        auto value = [&](int64_t t) {
          const int64_t k = keys[t];
          return head_rows(vp, b, h, k / block_size, Ct).first + (k % block_size) * rs;
        };
        float* a = accf.data() + r * D;
        accumulate_pairs<NV>(
            1, [&](int64_t) { return a; }, [&](int64_t) { return pb.data(); },
            [&](int64_t) { return (n + 1) / 2; },
            [&](int64_t p, __m512i* x) {
              value_pairs<NV>(value(2 * p), 2 * p + 1 < n ? value(2 * p + 1) : nullptr, x);
            });
        store_pairs_row<NV>(a, row_inv, op + ((qs[b] + j) * H + h * G + r % G) * D);
      }
    };
#endif
    for (int64_t item = next(); item >= 0; item = next()) {
      const auto [b, j0, j1] = tiles[item / Hkv];
      const int64_t h = item % Hkv;
      const int64_t W = ql[b], C = cl[b];
      const int64_t R = (j1 - j0) * G;  // query rows: (token j, head g)
      const int64_t Ct = C - W + j1;    // keys the tile's last row sees
      // Not zeroed: pass 1 writes every key of every row and softmax_row then every probability.
      if (static_cast<int64_t>(sf.size()) < R * Ct) sf.resize(R * Ct);
      accf.assign(R * D, 0.f);
      // Query row r is (token j0 + r / G, head h * G + r % G): its address computed once per item
      // (the divisions cost as much as a row's scores for a key group).
      qptr.resize(R);
      for (int64_t r = 0; r < R; ++r)
        qptr[r] = qp + (qs[b] + j0 + r / G) * qstride + (h * G + r % G) * D;
      auto qrow = [&](int64_t r) { return qptr[r]; };
      if (!bf16dot) {
        qf.assign(R * D, 0.f);
        for (int64_t r = 0; r < R; ++r)
          for (int64_t d = 0; d < D; ++d) qf[r * D + d] = static_cast<float>(qrow(r)[d]) * sc;
      }
      const int64_t nblk = (Ct + block_size - 1) / block_size;
      const int64_t last = std::min(nblk, NB) - 1;
      // One step() per block of each pass.
      NextRequest pre(kp, vp, tb, NB, block_size * Hkv * D, ahead(item), cl, h, Hkv, block_size,
                      2 * (last + 1));
      // Pass 1: scores, 16 keys at a time. Keys past a row's position are masked below.
      auto block_rows = [&](const T* cache, int64_t blk) {
        return head_rows(cache, b, h, blk, Ct);
      };
      for (int64_t blk = 0; blk <= last; ++blk) {
        const int64_t base = tb[b * NB + blk] * block_size;
        const int64_t n_blk = std::min(block_size, Ct - blk * block_size);
        pre.step();
        // Keys AHEAD blocks on; in the last blocks, pass 2's first values instead.
        const int64_t want = blk + AHEAD;
        if (want <= last) {
          const auto [next, rows] = block_rows(kp, want);
          prefetch_rows(next, Hkv * D, rows, D);
        } else if (want - last - 1 <= last) {
          const auto [next, rows] = block_rows(vp, want - last - 1);
          prefetch_rows(next, Hkv * D, rows, D);
        }
        for (int64_t t0 = 0; t0 < n_blk; t0 += KEY_LANES) {
          const int64_t n = std::min<int64_t>(KEY_LANES, n_blk - t0);
          const T* keys = kp + ((base + t0) * Hkv + h) * D;
          float* s0 = sf.data() + blk * block_size + t0;
          if constexpr (std::is_same_v<T, c10::BFloat16>) {
            if (bf16dot) {
              if (R >= MANY_ROWS && (D == 64 || D == 128)) {
                if (static_cast<int64_t>(part.size()) < 4 * R * KEY_LANES)
                  part.resize(4 * R * KEY_LANES);
                transpose_key_pairs(keys, Hkv * D, n, kt.data(), D);
                if (D == 64) scores_rows_bf16<2>(kt.data(), R, qrow, s0, Ct, n, sc, part.data());
                else scores_rows_bf16<4>(kt.data(), R, qrow, s0, Ct, n, sc, part.data());
                continue;
              }
              for (int64_t r = 0; r < R; ++r)
                scores_bf16(qrow(r), keys, Hkv * D, n, D, sc, s0 + r * Ct);
              continue;
            }
          }
          load_keys(keys, Hkv * D, n, kf.data(), kt.data(), D);
          for (int64_t r = 0; r < R; ++r) scores16(qf.data() + r * D, kt.data(), s0 + r * Ct, n, D);
        }
      }
      auto acc = [&](int64_t r) { return accf.data() + r * D; };
#if defined(DYNASPEC_AVX512)
      if constexpr (std::is_same_v<T, c10::BFloat16>) {
        if (pairs_pv && tree[b]) {
          if (D == 64) tree_rows_in_pairs(std::integral_constant<int, 4>{}, b, h, j0, R, Ct);
          else tree_rows_in_pairs(std::integral_constant<int, 8>{}, b, h, j0, R, Ct);
          continue;
        }
        if (pairs_pv) {
          if (D == 64)
            values_in_pairs(std::integral_constant<int, 4>{}, b, h, j0, R, Ct, last, pre);
          else values_in_pairs(std::integral_constant<int, 8>{}, b, h, j0, R, Ct, last, pre);
          continue;
        }
      }
#endif
      // Softmax per row over its visible keys [lo, pos]; everything else gets probability 0.
      for (int64_t r = 0; r < R; ++r) {
        const int64_t pos = C - W + j0 + r / G;
        if (tree[b])
          softmax_row_tree(sf.data() + r * Ct, Ct, pos, C - W, tm + (qs[b] + j0 + r / G) * tmw,
                           window, packed);
        else softmax_row(sf.data() + r * Ct, Ct, first_key(pos), pos);
      }
      // Pass 2: weighted sum of V, in key order (a zero weight adds exactly nothing), a span of
      // blocks at a time. One group of query rows (a decode step's G heads) reads the bf16 values
      // straight from the cache, widened as they are loaded (the same fp32 values as converting
      // first; the conversion's stores and reloads were a fifth of a decode item's instructions).
      // More rows convert V_CHUNK blocks to fp32 once and run each group of rows over all of their
      // keys with its sums in registers (per block, loading, storing and setting up the groups'
      // sums cost ~a third of the multiply-adds). Each row adds its keys in order: the same bits.
      const bool vec_rows = v512 && (D == 64 || D == 128);  // accumulate_v_rows' paths
      const bool direct = std::is_same_v<T, c10::BFloat16> && R <= 4 && vec_rows;
      const int64_t span = R > 4 && vec_rows ? V_CHUNK : 1;
      if (static_cast<int64_t>(vf.size()) < span * block_size * D) vf.resize(span * block_size * D);
      for (int64_t c0 = 0; c0 <= last; c0 += span) {
        const int64_t c1 = std::min(last + 1, c0 + span);
        const int64_t k0 = c0 * block_size, n = std::min(Ct, c1 * block_size) - k0;
        for (int64_t blk = c0; blk < c1; ++blk) {
          pre.step();
          if (blk + AHEAD <= last) {
            const auto [next, rows] = block_rows(vp, blk + AHEAD);
            prefetch_rows(next, Hkv * D, rows, D);
          }
          if (direct) continue;
          const T* vrows = vp + (tb[b * NB + blk] * block_size * Hkv + h) * D;
          float* dst = vf.data() + (blk - c0) * block_size * D;
          for (int64_t t = 0; t < std::min(block_size, Ct - blk * block_size); ++t)
            row_to_float(vrows + t * Hkv * D, dst + t * D, D);
        }
        auto seen = [&](int64_t r) {
          return std::max<int64_t>(0, std::min(n, C - W + j0 + r / G + 1 - k0));
        };
        auto prob = [&](int64_t r) { return sf.data() + r * Ct + k0; };
        if constexpr (std::is_same_v<T, c10::BFloat16>) {
          if (direct) {  // span 1: block c0's values in the cache
            accumulate_v_rows(R, acc, prob, seen, vp + (tb[b * NB + c0] * block_size * Hkv + h) * D,
                              Hkv * D, D);
            continue;
          }
        }
        if (vec_rows && accumulate_v_rows(R, acc, prob, seen, vf.data(), D, D)) continue;
        for (int64_t r = 0; r < R; ++r)
          if (seen(r) > 0) accumulate_v(acc(r), prob(r), vf.data(), seen(r), D, v512);
      }
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t g = 0; g < G; ++g) {
          T* dst = op + ((qs[b] + j) * H + h * G + g) * D;
          const float* src = accf.data() + ((j - j0) * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(src[d]);
        }
    }
  };
  if constexpr (kAvx2Type<T>) {
    if (path == AttnPath::Avx2 && avx2_rows<T>(D)) {
      const AttnCall<T> call{qp, qstride, kp, vp, op,         tb, cl,     qs, ql,  NB,
                             H,  Hkv,     G,  D,  block_size, sc, window, tm, tmw, tree.data()};
      schedule_items(tiles, Hkv, short_queries, split, cl, ql,
                     [&](auto&& next, auto&& ahead) { run_items_avx2(call, tiles, next, ahead); });
      return;
    }
  }
  schedule_items(tiles, Hkv, short_queries, split, cl, ql, run_items);
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
