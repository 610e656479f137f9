// The intrinsics as this CPU's instructions (built with the AVX-512 flags of a Zen 4).
#include <immintrin.h>

#include <cstdint>

// No AVX-VNNI on an AVX-512 VNNI CPU such as Zen 4: its EVEX twin is the same operation.
#define _mm256_dpbusd_avx_epi32 _mm256_dpbusd_epi32
#include "ops.inc"

extern "C" void native_op(int i, const float* a, const float* b, const float* c, uint16_t k,
                          float* o) {
  run_op(i, a, b, c, k, o);
}
extern "C" int n_ops() { return kN; }
extern "C" const char* op_name(int i) { return kNames[i]; }
