// Torch-free check of csrc/quant_gemv.h on one ISA path (tests/kernels/test_quant_gemv_isas.py compiles it
// for the scalar path natively and for NEON with the aarch64 cross compiler under qemu): the GEMV and
// the dequantisation against a float64 sum over the blocks decoded element by element.
#include "quant_gemv.h"
#include <cstdio>
#include <random>
using namespace servescope_quant;
int main() {
  std::mt19937 g(1);
  int bad = 0;
  for (int i4 = 0; i4 < 2; ++i4)
    for (int asym = 0; asym < 2; ++asym) {
      const int64_t N = 7, kp = 128, group = 64, G = kp / group, M = 3;
      std::vector<uint8_t> w(N * (i4 ? kp / 2 : kp));
      for (auto& b : w) b = g() & 0xFF;
      std::vector<uint16_t> s(N * G * (asym ? 2 : 1));
      for (auto& h : s) h = 0x3000 + (g() & 0x3FF);  // small positive halves
      std::vector<float> x(M * kp), y(M * N);
      for (auto& v : x) v = (float)((int)(g() % 200) - 100) / 50.f;
      QMatrix q{w.data(), N, kp, group, (bool)i4, (bool)asym, s.data()};
      quant_gemv_rows(q, x.data(), M, nullptr, y.data());
      std::vector<float> deq(N * kp);
      dequantize_rows(q, kp, deq.data());
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = 0; n < N; ++n) {
          double ref = 0;
          for (int64_t k = 0; k < kp; ++k) {
            int64_t gi = k / group, b = k / 32, j = k % 32;
            const uint16_t* sp = s.data() + (n * G + gi) * (asym ? 2 : 1);
            double d = half_to_float(sp[0]);
            double u = i4 ? (double)((w[n * kp / 2 + b * 16 + (j % 16)] >> (j < 16 ? 0 : 4)) & 15)
                          : (double)(int8_t)w[n * kp + k];
            double val = asym ? d * u + half_to_float(sp[1]) : (i4 ? d * (u - 8) : d * u);
            if (m == 0 && std::abs(deq[n * kp + k] - val) > 1e-5) ++bad;
            ref += val * x[m * kp + k];
          }
          if (std::abs(ref - y[m * N + n]) > 1e-3 * (1 + std::abs(ref))) ++bad;
        }
    }
  printf("%s bad=%d\n", kIsa, bad);
  return bad != 0;
}
