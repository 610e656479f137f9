// y = x W^T with W kept in its GGUF groups (4-bit or 8-bit integers, a float scale and minimum per
// group) and x quantized once per call to int8 in blocks of 32 (llama.cpp's Q8_1 idea: the block
// sums make a group minimum exact). Every weight is read once per call for all rows of x, and
// the per-row arithmetic is int8 dot products (VNNI vpdpbusd on AVX-512 / AVX-VNNI, the
// maddubs+madd pair on plain AVX2, a scalar loop otherwise).
//
// Row invariance: a row's result is a fixed sequence of operations on that row alone, whatever
// the number of rows in the call, their order, the ISA path or the thread split:
//   acc = 0; for each weight group g in K order:
//     acc = fma(float(idot_g), d_w[g] * d_x[g], acc);  acc = fma(mn_w[g], s_x[g], acc)
// where idot_g is an exact integer dot product. The scalar reference below computes the same
// sequence, so tests compare the vector paths to it bit for bit.
//
// Packed weight layout, per tile of 16 output columns and per group of G (16 or 32) inputs:
// the group's G/4 "steps" each hold 4 consecutive inputs for each of the 16 columns (64 bytes,
// column-major in the step: byte 4c+t = u[col c][4s+t]). 4-bit weights hold two steps per 64
// bytes: step s in the low nibbles, step s + G/8 in the high ones. 8-bit weights are stored as
// u = q + 128 (unsigned), and the 128 * sum(q_x) they add is subtracted exactly in int32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "simd.h"

#include "cpu_paths.h"
#include "int8_quant.h"
#include "int8_tiles.h"
#include "vec_exp.h"

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

// ---- AVX-512 VNNI ---------------------------------------------------------------------------

// acc += w (u8) . broadcast(*x) (4 s8): the activations as the instruction's embedded
// broadcast, which GCC does not fold from _mm512_set1_epi32 (a separate broadcast per row and
// step cost issue slots the dot products needed).
AVX512_TARGET inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const int32_t* x) {
#if defined(DYNASPEC_EMULATED)  // the instruction's operation, through the intrinsic
  return _mm512_dpbusd_epi32(acc, w, _mm512_set1_epi32(*x));
#else
  asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*x));
  return acc;
#endif
}

// 16 scales (or minima) from i on as fp32: the conversion from fp16 is exact.
AVX512_TARGET inline __m512 scales16(const Packed& p, const void* a, int64_t i) {
  if (!p.half) return _mm512_loadu_ps(static_cast<const float*>(a) + i);
  return _mm512_cvtph_ps(
      _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(a) + i)));
}

// The weights of step s of a group as 64 unsigned bytes (4-bit: steps s and s + STEPS/2 share
// bytes, low and high nibbles). Loaded per step rather than held for the group: the registers go
// to the rows' accumulators.
template <int BITS, int G>
AVX512_TARGET inline __m512i step_weights(const uint8_t* grp, int s, __m512i lo) {
  constexpr int STEPS = G / 4;
  if (BITS == 8) return _mm512_loadu_si512(grp + s * 64);
  if (s < STEPS / 2) return _mm512_and_si512(_mm512_loadu_si512(grp + s * 64), lo);
  return _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(grp + (s - STEPS / 2) * 64), 4), lo);
}

// pf: also prefetch the next tile's groups (the first pass over this tile's weights only). MN:
// the weights have a minimum term; a template argument so the accumulators stay in registers
// (a runtime branch made GCC store them to the stack every group). Every loop over rows is
// unrolled, the first and last too: one rolled loop indexing facc keeps the array in memory, and
// GCC then stored all RB accumulators every group (measured: 0.92x the 16-row body time unrolled).
template <int RB, int BITS, int G, bool MN>
AVX512_TARGET void tile_avx512(const Packed& p, const QuantX& qx, int64_t m0, int64_t tile,
                               float* acc, bool pf) {
  constexpr int STEPS = G / 4;
  const int64_t ng = p.K / G;
  __m512 facc[RB];
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) facc[r] = _mm512_setzero_ps();
  const __m512i lo = _mm512_set1_epi8(0x0F);
  // The block's rows interleaved (quantize_blocks): one pointer, a constant offset per row.
  const int32_t* xq = qx.qv + m0 * p.K / 4;  // [K/4][RB]
  const float* xd = qx.dv + m0 * ng;         // [ng][RB]
  const float* xs = qx.sv + m0 * ng;
  const int32_t* xsum = qx.sumv + m0 * ng;
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t gi = tile * ng + g;
    const uint8_t* grp = p.w + gi * p.group_bytes();
    if (pf) prefetch_group(p, gi + ng);
    // Steps outer, rows inner: RB independent dependency chains (integer sums: order-free).
    __m512i idot[RB];
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) idot[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int s = 0; s < STEPS; ++s) {
      const __m512i w = step_weights<BITS, G>(grp, s, lo);
#pragma GCC unroll 16
      // 4 int8 activations to every lane from memory (a load, not a shuffle)
      for (int r = 0; r < RB; ++r)
        idot[r] = dpbusd_bcast(idot[r], w, xq + (g * STEPS + s) * RB + r);
    }
    const __m512 dw = scales16(p, p.d, gi * TILE);
    __m512 mw = _mm512_setzero_ps();
    if (MN) mw = scales16(p, p.mn, gi * TILE);
#pragma GCC unroll 16
    for (int r = 0; r < RB; ++r) {
      if (BITS == 8) idot[r] = _mm512_sub_epi32(idot[r], _mm512_set1_epi32(128 * xsum[g * RB + r]));
      const __m512 scale = _mm512_mul_ps(dw, _mm512_set1_ps(xd[g * RB + r]));
      facc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(idot[r]), scale, facc[r]);
      if (MN) facc[r] = _mm512_fmadd_ps(mw, _mm512_set1_ps(xs[g * RB + r]), facc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < RB; ++r) _mm512_storeu_ps(acc + r * TILE, facc[r]);
}

template <int RB, int BITS, int G>
AVX512_TARGET void tile_avx512(const Packed& p, const QuantX& qx, int64_t m0, int64_t tile,
                               float* acc, bool pf) {
  if (p.mn) return tile_avx512<RB, BITS, G, true>(p, qx, m0, tile, acc, pf);
  tile_avx512<RB, BITS, G, false>(p, qx, m0, tile, acc, pf);
}

template <int BITS, int G>
AVX512_TARGET void rows_avx512(const Packed& p, const QuantX& qx, int64_t m0, int64_t M,
                               int64_t tile, float* acc) {
  const bool pf = m0 == 0 && tile + 1 < p.N / TILE;  // later passes find the tile in cache
  int64_t r = 0;
  for (; r + MAX_RB <= M; r += MAX_RB)
    tile_avx512<MAX_RB, BITS, G>(p, qx, m0 + r, tile, acc + r * TILE, pf && r == 0);
  const bool rest_pf = pf && r == 0;
  const int64_t m = m0 + r;
  acc += r * TILE;
  switch (M - r) {
    case 11: tile_avx512<11, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 10: tile_avx512<10, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 9: tile_avx512<9, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 8: tile_avx512<8, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 7: tile_avx512<7, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 6: tile_avx512<6, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 5: tile_avx512<5, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 4: tile_avx512<4, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 3: tile_avx512<3, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 2: tile_avx512<2, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    case 1: tile_avx512<1, BITS, G>(p, qx, m, tile, acc, rest_pf); break;
    default: break;
  }
}

enum class Isa { Scalar = 0, Avx2 = 1, AvxVnni = 2, Avx512Vnni = 3 };

// The paths dynaspec/cpu_features.py allows (cpu_paths.h), each needing a set of CPU flags, not
// a rung of a ladder: Zen 4, Ice Lake and Cascade Lake have AVX-512 VNNI without the VEX-encoded
// AVX-VNNI, and "the best path or anything below it" ran vpdpbusd (VEX) there and died of SIGILL.
Isa selected_isa() { return static_cast<Isa>(cpu_paths().gemm); }

// A forced path runs only where it is allowed; otherwise a Python error (RuntimeError) names it,
// never a signal. (Int8DotLinear refuses it first, naming the CPU flags it lacks.)
Isa checked_isa(int64_t isa) {
  if (isa < 0) return selected_isa();
  TORCH_CHECK(isa <= static_cast<int64_t>(Isa::Avx512Vnni), "int8_gemm: no path ", isa, " (0-3)");
  TORCH_CHECK(cpu_paths().gemm_ok[isa], "int8_gemm: path ", kGemmPaths[isa],
              " is not one this CPU can run (dynaspec.cpu_features names the flags it needs)");
  return static_cast<Isa>(isa);
}

template <int BITS, int G>
void run_tile(Isa isa, const Packed& p, const QuantX& qx, int64_t m0, int64_t M, int64_t tile,
              float* acc) {
  switch (isa) {
    case Isa::Avx512Vnni: rows_avx512<BITS, G>(p, qx, m0, M, tile, acc); return;
    case Isa::AvxVnni: tile_avxvnni<BITS, G>(p, qx, m0, M, tile, acc); return;
    case Isa::Avx2: tile_avx2<BITS, G>(p, qx, m0, M, tile, acc); return;
    default: break;
  }
  tile_scalar(p, qx, m0, M, tile, acc);
}

void dispatch_tile(Isa isa, const Packed& p, const QuantX& qx, int64_t m0, int64_t M, int64_t tile,
                   float* acc) {
  if (p.bits == 4 && p.G == 32) return run_tile<4, 32>(isa, p, qx, m0, M, tile, acc);
  if (p.bits == 4 && p.G == 16) return run_tile<4, 16>(isa, p, qx, m0, M, tile, acc);
  if (p.bits == 8 && p.G == 32) return run_tile<8, 32>(isa, p, qx, m0, M, tile, acc);
  return run_tile<8, 16>(isa, p, qx, m0, M, tile, acc);
}

// 16 fp32 to bf16 as to_bf16_bits rounds them; the AVX-512 boundary for store_rows, which an
// AVX2-only build also compiles.
AVX512_TARGET inline void store16_bf16(const float* src, c10::BFloat16* dst) {
  bf16x16_store(dst, _mm512_loadu_ps(src));
}

// store16_bf16 for M rows of a tile, through vcvtneps2bf16 (bf16x16_store_cvt: the same bits).
BF16CVT_TARGET void store_tile_bf16_cvt(const float* acc, int64_t M, c10::BFloat16* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m) bf16x16_store_cvt(y + m * N, _mm512_loadu_ps(acc + m * TILE));
}

// M rows of a tile as they are (fp32 output: the logits). The scalar loop below ran ~3% of a
// c64 decode step on the 49,152-column head.
AVX512_TARGET void store_tile_f32(const float* acc, int64_t M, float* y, int64_t N) {
  for (int64_t m = 0; m < M; ++m) _mm512_storeu_ps(y + m * N, _mm512_loadu_ps(acc + m * TILE));
}

template <typename T>
void store_rows(const float* acc, int64_t M, int64_t tile, int64_t N, T* y, bool vec) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (vec) {
      if (cpu_paths().bf16_cvt) return store_tile_bf16_cvt(acc, M, y + tile * TILE, N);
      for (int64_t m = 0; m < M; ++m) store16_bf16(acc + m * TILE, y + m * N + tile * TILE);
      return;
    }
  } else {
    if (vec) return store_tile_f32(acc, M, y + tile * TILE, N);
  }
  for (int64_t m = 0; m < M; ++m)
    for (int c = 0; c < TILE; ++c) {
      const float v = acc[m * TILE + c];
      if constexpr (std::is_same_v<T, float>) {
        y[m * N + tile * TILE + c] = v;
      } else {
        const uint16_t bits = to_bf16_bits(v);
        std::memcpy(&y[m * N + tile * TILE + c], &bits, 2);
      }
    }
}

#if defined(DYNASPEC_AVX512)
// Output tile `tile` of silu(gate) * up from a gate tile's and its up tile's accumulators: each
// rounded to bf16 as int8_gemm stores them, then silu_mul16 as silu_mul runs on those stores.
BF16CVT_TARGET void store_silu_rows_cvt(const float* g, const float* u, int64_t M, int64_t tile,
                                        int64_t N, c10::BFloat16* y) {
  for (int64_t m = 0; m < M; ++m)
    bf16x16_store_cvt(y + m * N + tile * TILE,
                      silu_mul16_cvt(bf16x16_round_cvt(_mm512_loadu_ps(g + m * TILE)),
                                     bf16x16_round_cvt(_mm512_loadu_ps(u + m * TILE))));
}

void store_silu_rows(const float* g, const float* u, int64_t M, int64_t tile, int64_t N,
                     c10::BFloat16* y) {
  if (cpu_paths().bf16_cvt) return store_silu_rows_cvt(g, u, M, tile, N, y);
  for (int64_t m = 0; m < M; ++m)
    bf16x16_store(y + m * N + tile * TILE,
                  silu_mul16(bf16x16_round(_mm512_loadu_ps(g + m * TILE)),
                             bf16x16_round(_mm512_loadu_ps(u + m * TILE))));
}
#endif

// Rows are processed in chunks so one tile's weights (<= K/2 bytes at 4 bits) stay in L1/L2
// while every chunk reads them: prefill reads each weight from memory about once as well.
constexpr int64_t ROW_CHUNK = 8 * MAX_RB;  // whole register blocks: quantize_blocks' blocks

// Work units a worker takes per claim (see gemm).
constexpr int64_t CLAIM = 4;

// silu: W stacks a gate's rows over an up's (N = 2 * inter) and y gets silu(gate) * up, [M, N / 2]:
// output tile t from tiles t and t + N / 32, so the [M, N] product never goes to memory.
template <typename T>
void gemm(const T* x, const Packed& p, int64_t M, T* y, Isa isa, bool silu = false) {
  QuantX qx;
  const bool vec = isa == Isa::Avx512Vnni;  // the scalar reference keeps the scalar loops
  if (vec) {
    quantize_blocks(x, M, p.K, p.G, MAX_RB, qx);
  } else {  // the AVX2 and AVX-VNNI tiles' rows in AVX2 (the same bytes); the reference's scalar
    quantize_rows(x, M, p.K, p.G, qx, isa == Isa::Avx2 || isa == Isa::AvxVnni);
  }
  const int64_t tiles = p.N / TILE, outs = silu ? tiles / 2 : tiles;
  const int64_t chunks = (M + ROW_CHUNK - 1) / ROW_CHUNK;
  const int64_t chunk = std::min<int64_t>(M, ROW_CHUNK) * TILE;
  // Work is (row chunk, output tile), and worker w owns tiles [w, w + 1) * outs / workers, done
  // chunk by chunk, each chunk's tiles in order: neighbouring tiles write the two halves of each
  // output cache line one after the other (tiles outer wrote a line's halves a whole pass over
  // the rows apart, each partial write missing), a chunk's activations stay in cache across the
  // tiles, and the worker's weights (a few hundred KB) stay in its L2 across chunks; the first
  // chunk streams them from memory (with the prefetch of rows_avx512). A worker that finishes
  // its own range takes the rest of the others' from where they are: the two vCPUs of this VM
  // do not run at one speed, and with fixed halves the faster waited ~4% of its time in GEMMs.
  // ~8 tiles per worker keeps both threads busy on the 576-wide matrices (36 tiles). Below one
  // register block of rows a unit is a few hundred ns of streaming weights, and taking others'
  // units measured 0.95-1.06x at one row: such calls keep to their own ranges.
  const int64_t per = silu ? 4 : 8;
  const int64_t workers =
      std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), (outs + per - 1) / per));
  struct alignas(64) Next {
    std::atomic<int64_t> unit{0};
  };
  const int64_t ranges = M >= MAX_RB ? workers : 1;  // ranges a worker works through
  std::unique_ptr<Next[]> next(ranges > 1 ? new Next[workers] : nullptr);
  at::parallel_for(0, workers, 1, [&](int64_t wb, int64_t we) {
    std::vector<float> acc((silu ? 2 : 1) * chunk);
    for (int64_t w = wb; w < we; ++w) {
      for (int64_t k = 0; k < ranges; ++k) {  // its own range first, then the others'
        const int64_t r = (w + k) % workers;
        const int64_t t0 = r * outs / workers, nt = (r + 1) * outs / workers - t0;
        int64_t own = 0;  // a range nobody else takes from needs no shared counter
        // CLAIM units at a time: the locked add waits for the tile's stores to drain, and one
        // per unit was ~1% of a c64 code_edit run.
        auto claim = [&] {
          return ranges > 1 ? next[r].unit.fetch_add(CLAIM) : (own += CLAIM) - CLAIM;
        };
        const int64_t units = chunks * nt;
        for (int64_t u0 = claim(); u0 < units; u0 = claim()) {
          for (int64_t u = u0; u < std::min(u0 + CLAIM, units); ++u) {
            const int64_t m0 = u / nt * ROW_CHUNK, tile = t0 + u % nt;
            const int64_t rows = std::min<int64_t>(ROW_CHUNK, M - m0);
            dispatch_tile(isa, p, qx, m0, rows, tile, acc.data());
#if defined(DYNASPEC_AVX512)
            if constexpr (std::is_same_v<T, c10::BFloat16>) {
              if (silu) {
                dispatch_tile(isa, p, qx, m0, rows, tile + outs, acc.data() + chunk);
                store_silu_rows(acc.data(), acc.data() + chunk, rows, tile, outs * TILE,
                                y + m0 * outs * TILE);
                continue;
              }
            }
#endif
            store_rows(acc.data(), rows, tile, p.N, y + m0 * p.N, vec);
          }
        }
      }
    }
  });
}

Packed make_packed(const torch::Tensor& w, const torch::Tensor& d,
                   const c10::optional<torch::Tensor>& mn, int64_t N, int64_t K, int64_t G,
                   int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "bits must be 4 or 8");
  TORCH_CHECK(G == 16 || G == 32, "group size must be 16 or 32");
  TORCH_CHECK(N % TILE == 0 && K % QBLK == 0, "int8 gemm needs N % 16 == 0 and K % 32 == 0");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kUInt8,
              "packed weights: contiguous uint8");
  const auto st = d.scalar_type();
  TORCH_CHECK(d.is_contiguous() && (st == torch::kFloat || st == torch::kHalf),
              "scales: contiguous float32 or float16");
  Packed p{w.data_ptr<uint8_t>(), d.data_ptr(),           nullptr,           N, K,
           static_cast<int>(G),   static_cast<int>(bits), st == torch::kHalf};
  TORCH_CHECK(w.numel() == (N / TILE) * (K / G) * p.group_bytes(), "packed weight size mismatch");
  TORCH_CHECK(d.numel() == N * (K / G), "scale size mismatch");
  if (mn.has_value()) {
    TORCH_CHECK(mn->is_contiguous() && mn->scalar_type() == st && mn->numel() == d.numel(),
                "minimum terms: contiguous, the scales' dtype and shape");
    p.mn = mn->data_ptr();
  }
  return p;
}

}  // namespace

// x: [M, K] bf16 or fp32 contiguous. Returns [M, N] in x's dtype. isa: -1 = the selected path,
// 0 = the scalar reference (tests), 1 = AVX2, 2 = AVX-VNNI, 3 = AVX-512 VNNI (an error where the
// CPU lacks a flag the path needs).
torch::Tensor int8_gemm(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                        c10::optional<torch::Tensor> mn, int64_t N, int64_t G, int64_t bits,
                        int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [M, K] matrix");
  const int64_t M = x.size(0), K = x.size(1);
  Packed p = make_packed(w, d, mn, N, K, G, bits);
  const Isa use = checked_isa(isa);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
  if (x.scalar_type() == torch::kFloat) {
    gemm<float>(x.data_ptr<float>(), p, M, y.data_ptr<float>(), use);
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "x must be bf16 or fp32");
    gemm<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), p, M, y.data_ptr<c10::BFloat16>(), use);
  }
  return y;
}

torch::Tensor silu_mul(torch::Tensor gate_up);  // fused_ops.cpp

// silu_mul(int8_gemm(x, ...)) for W = gate's rows over up's (N = 2 * inter), the same bits, but
// the [M, N] product is never stored: at a 2,048-token prefill it was 12.6 MB a layer written to
// memory and read back, and the GEMM's stores plus silu_mul's pass were ~8% of a served-like step.
// Fused where silu_mul's vector path and the AVX-512 GEMM both run; composed otherwise.
torch::Tensor int8_gemm_silu(torch::Tensor x, torch::Tensor w, torch::Tensor d,
                             c10::optional<torch::Tensor> mn, int64_t N, int64_t G, int64_t bits) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: a contiguous [M, K] matrix");
  TORCH_CHECK(N % 2 == 0, "int8_gemm_silu: N must stack gate and up rows (even)");
  bool fused = false;
#if defined(DYNASPEC_AVX512)
  fused = selected_isa() == Isa::Avx512Vnni && x.scalar_type() == torch::kBFloat16 &&
          N % (2 * TILE) == 0;
#endif
  if (!fused) return silu_mul(int8_gemm(x, w, d, mn, N, G, bits, -1));
  const int64_t M = x.size(0);
  Packed p = make_packed(w, d, mn, N, x.size(1), G, bits);
  auto y = torch::empty({M, N / 2}, x.options());
  if (M > 0)
    gemm<c10::BFloat16>(x.data_ptr<c10::BFloat16>(), p, M, y.data_ptr<c10::BFloat16>(),
                        Isa::Avx512Vnni, true);
  return y;
}

int64_t int8_gemm_isa() { return cpu_paths().gemm; }
