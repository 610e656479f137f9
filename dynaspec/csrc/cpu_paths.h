// Which of the kernels' run-time paths may run, as dynaspec/cpu_features.py chose them from the
// CPU's flags: set once through set_cpu_paths when the module is loaded, and until then every
// choice is the scalar one. Nothing here asks the CPU itself: one selection, made in Python from
// sets of flags (never a ladder of ISAs), decides every path. Paths compiled only into an
// AVX-512 build (#if defined(DYNASPEC_AVX512)) are not switched here: a module built with flags the
// CPU lacks is refused before it is imported (cpu_kernels.py), and set_cpu_paths checks that
// the build paths it is told of are the ones compiled in.
#pragma once

#include <torch/extension.h>

#include "simd.h"

#include <cstdint>
#include <string>
#include <vector>

struct CpuPaths {
  int64_t gemm = 0;  // int8_gemm's selected path: an index into kGemmPaths
  bool gemm_ok[4] = {true, false, false, false};  // the int8_gemm paths that may run (or be forced)
  // bf16_convert.avx512: fp32 -> bf16 rounding in integer ops on 16 lanes
  bool bf16_avx512 = false;
  bool bf16_cvt = false;  // bf16_convert.avx512_bf16: the same bits through vcvtneps2bf16
  bool attn_ok[5] = {true, true, false, false,
                     false};  // the attention paths (kAttnPaths) that may run
  // attention's selected path: the last allowed of kAttnPaths (their preference order)
  int64_t attn = 1;
};

// One object for the whole module (an inline variable: every translation unit shares it).
inline CpuPaths g_cpu_paths;

inline const CpuPaths& cpu_paths() { return g_cpu_paths; }

inline constexpr const char* kGemmPaths[] = {"scalar", "avx2", "avx_vnni", "avx512_vnni"};

// paged_decode.cpp's paths, least preferred first (cpu_features.KERNELS["attention"] reversed):
// the plain-loop reference, the fp32 rows as loops the compiler vectorises for the build, the
// fp32 rows with AVX2 + FMA intrinsics (target-attributed: any build), the fp32 rows with
// AVX-512 intrinsics (an AVX-512 build only), bf16 dot products.
enum class AttnPath : int64_t { Scalar = 0, Fp32 = 1, Avx2 = 2, Avx512 = 3, Avx512Bf16 = 4 };
inline constexpr const char* kAttnPaths[] = {"scalar", "fp32", "avx2", "avx512", "avx512_bf16"};
inline constexpr int kNumAttnPaths = 5;

#if defined(DYNASPEC_AVX512)
inline constexpr bool kAvx512Build = true;
#else
inline constexpr bool kAvx512Build = false;
#endif

// allowed: every "kernel.path" this CPU can run (cpu_features.Selection.allowed); gemm: the
// int8_gemm path to run when none is forced, one of the allowed ones. Unknown names and build
// paths that disagree with this build are errors: Python and C++ must describe the same paths.
inline void set_cpu_paths(const std::vector<std::string>& allowed, const std::string& gemm) {
  CpuPaths p;
  for (bool& ok : p.attn_ok) ok = false;  // only what `allowed` names
  int build_paths = 0;  // of the 2 compiled only into an AVX-512 build, never switched off
  for (const std::string& name : allowed) {
    bool known = false;
    for (int i = 0; i < 4; ++i) {
      if (name == std::string("int8_gemm.") + kGemmPaths[i]) p.gemm_ok[i] = known = true;
    }
    if (name == "bf16_convert.avx512") p.bf16_avx512 = known = true;
    if (name == "bf16_convert.avx512_bf16") p.bf16_cvt = known = true;
    for (int i = 0; i < kNumAttnPaths; ++i) {
      if (name == std::string("attention.") + kAttnPaths[i]) p.attn_ok[i] = known = true;
    }
    // The attention's AVX-512 rows are switched at run time, but exist only in an AVX-512 build.
    TORCH_CHECK(kAvx512Build || name != "attention.avx512", "set_cpu_paths: ", name,
                " is not compiled into this build");
    if (name == "exp.avx512" || name == "row_max.avx512") {
      TORCH_CHECK(kAvx512Build, "set_cpu_paths: ", name, " is not compiled into this build");
      ++build_paths;
      known = true;
    }
    if (name == "int8_gemm.scalar" || name == "bf16_convert.scalar" || name == "exp.scalar" ||
        name == "row_max.scalar")
      known = true;
    TORCH_CHECK(known, "set_cpu_paths: no kernel path ", name);
  }
  TORCH_CHECK(
      build_paths == (kAvx512Build ? 2 : 0),
      "set_cpu_paths: this build's AVX-512 paths are compiled in, but not all allowed on this CPU");
  p.gemm = -1;
  for (int i = 0; i < 4; ++i)
    if (gemm == kGemmPaths[i]) p.gemm = i;
  TORCH_CHECK(p.gemm >= 0 && p.gemm_ok[p.gemm], "set_cpu_paths: int8_gemm path ", gemm,
              " is not allowed");
  // The AVX-512 GEMM stores bf16 through these; its flags imply theirs (cpu_features.KERNELS).
  TORCH_CHECK(!p.gemm_ok[3] || p.bf16_avx512,
              "set_cpu_paths: int8_gemm.avx512_vnni needs bf16_convert.avx512");
  TORCH_CHECK(p.attn_ok[0], "set_cpu_paths: attention.scalar (the reference) must be allowed");
  for (int i = 0; i < kNumAttnPaths; ++i)
    if (p.attn_ok[i]) p.attn = i;
  g_cpu_paths = p;
}

inline std::vector<std::string> allowed_cpu_paths() {  // what set_cpu_paths was told, as names
  const CpuPaths& p = g_cpu_paths;
  std::vector<std::string> out;
  for (int i = 0; i < 4; ++i)
    if (p.gemm_ok[i]) out.push_back(std::string("int8_gemm.") + kGemmPaths[i]);
  if (p.bf16_avx512) out.push_back("bf16_convert.avx512");
  if (p.bf16_cvt) out.push_back("bf16_convert.avx512_bf16");
  for (int i = 0; i < kNumAttnPaths; ++i)
    if (p.attn_ok[i]) out.push_back(std::string("attention.") + kAttnPaths[i]);
  return out;
}
