// Each op on 4,000 random input sets (any bits, scaled values, denormals, small multiples of
// 1/8): prints one line per op and exits 1 if any op's emulation differs from the hardware. Two
// NaN lanes count as equal: which NaN comes out where several meet (an add tree, a fused
// multiply-add) follows the compiler's operand order, which the native build does not fix.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

extern "C" void native_op(int, const float*, const float*, const float*, uint16_t, float*);
extern "C" void emulated_op(int, const float*, const float*, const float*, uint16_t, float*);
extern "C" int n_ops();
extern "C" const char* op_name(int);

static float draw(std::mt19937& g, int kind) {
  const uint32_t u = static_cast<uint32_t>(g());
  float f;
  if (kind == 0) {  // any bits: NaNs, infinities, denormals
    std::memcpy(&f, &u, 4);
  } else if (kind == 1) {
    f = std::ldexp(static_cast<float>(static_cast<int32_t>(u)) / 2147483648.f,
                   static_cast<int>(g() % 20) - 10);
  } else if (kind == 2) {  // denormal or just above
    const uint32_t d = (u & 0x807FFFFFu) | ((g() % 3) << 23);
    std::memcpy(&f, &d, 4);
  } else {
    f = static_cast<float>(static_cast<int>(u % 2000) - 1000) / 8.f;
  }
  return f;
}

int main() {
  std::mt19937 g(1);
  int failed = 0;
  for (int i = 0; i < n_ops(); ++i) {
    int bad = 0;
    for (int t = 0; t < 4000; ++t) {
      alignas(64) float a[16], b[16], c[16], x[16], y[16];
      for (int j = 0; j < 16; ++j) a[j] = draw(g, t % 4), b[j] = draw(g, t % 4), c[j] = draw(g, t % 4);
      const uint16_t k = static_cast<uint16_t>(g());
      native_op(i, a, b, c, k, x);
      emulated_op(i, a, b, c, k, y);
      bool same = true;
      for (int j = 0; j < 16; ++j)
        same &= std::memcmp(&x[j], &y[j], 4) == 0 || (std::isnan(x[j]) && std::isnan(y[j]));
      if (!same && bad++ == 0) {
        uint32_t xb[16], yb[16];
        std::memcpy(xb, x, 64), std::memcpy(yb, y, 64);
        for (int j = 0; j < 16; ++j)
          if (xb[j] != yb[j]) {
            std::printf("  %s: lane %d native %08x emulated %08x\n", op_name(i), j, xb[j], yb[j]);
            break;
          }
      }
    }
    std::printf("%-18s %s (%d of 4000 differ)\n", op_name(i), bad ? "DIFFERS" : "same", bad);
    failed += bad > 0;
  }
  return failed ? 1 : 0;
}
