// The x86 intrinsics every kernel source uses, and the guards of its ISA paths, in one place so
// the same source builds two ways (docs/design.md §6f):
// - natively (the engine's module, setup.py / cpu_kernels.py): <immintrin.h>; an ISA path's code
//   is compiled where the build's -m flags enable it (DYNASPEC_AVX512) or behind a function
//   target attribute (DYNASPEC_TARGET) and chosen at run time. These only rename
//   `#if defined(__AVX512F__)` and `__attribute__((target(...)))`: the same instructions.
// - emulated (-DDYNASPEC_EMULATED, a test-only module, dynaspec/kernel_emulation.py): SIMDe's
//   portable intrinsics under their native names, every path compiled in and none target-
//   attributed, so a CPU without AVX-512 (or AVX-VNNI) runs each path's operations in the same
//   order through plain code and its bit-exactness tests run everywhere.
#pragma once

#if defined(DYNASPEC_EMULATED)
#include "simd_emulated.h"
#define DYNASPEC_AVX512 1
// Nothing to enable: the build's baseline flags run SIMDe's code (an AVX-512 target here would
// let the compiler emit the very instructions the CPU lacks).
#define DYNASPEC_TARGET(isa)
#else
#include <immintrin.h>
#if defined(__AVX512F__)
#define DYNASPEC_AVX512 1
#endif
#define DYNASPEC_TARGET(isa) __attribute__((target(isa)))
#endif

#if defined(__AVX2__) || defined(DYNASPEC_EMULATED)
#define DYNASPEC_AVX2 1  // an AVX2 build's loops (fused_ops.cpp); DYNASPEC_AVX512 wins where both
#endif
