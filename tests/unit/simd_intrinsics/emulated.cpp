// The intrinsics as the emulated kernel build compiles them (no -m flags: SIMDe + simd_emulated.h).
#include <cstdint>
#define DYNASPEC_EMULATED
#include "simd.h"
#include "ops.inc"

extern "C" void emulated_op(int i, const float* a, const float* b, const float* c, uint16_t k,
                            float* o) {
  run_op(i, a, b, c, k, o);
}
