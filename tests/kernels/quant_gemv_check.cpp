// Torch-free check of the packed-weight kernels on one ISA path, one part of packed_check.cpp (which
// tests/kernels/test_quant_gemv_isas.py compiles for the scalar path natively, for the x86 paths where the CPU has them, and for NEON with
// the aarch64 cross compiler under qemu, with and without dotprod): the decode GEMV (quant_dot.h's
// integer dot products for group 32, quant_gemv.h's float path for group 64) and the dequantisation,
// against a float64 sum over the blocks decoded element by element. For group 32 the reference uses the
// activations quantised to int8 per 32-block as the kernel does (so the two agree to float32 rounding),
// and the kernel must also stay within the activation-rounding bound of the exact float product. Each group-32
// kernel (quant_rows forced to the streaming and weight-stationary VNNI orders, and AMX where it runs) is
// checked the same way, for batching invariance (each row alone gives the same bits as in the batch) and
// for bfloat16 activations (the same bits as their float32 values). The AMX-BF16 kernel (where it runs) is
// checked against its own arithmetic: the dequantised weights and the activations each rounded to bfloat16,
// multiplied exactly and summed (float32 rounding), and within the two roundings' bound of the exact product;
// batching invariance and float32 = bfloat16 activations as the others. MXFP4 (E8M0 scales, e2m1 nibbles)
// goes through the same group-32 kernels, the prefill GEMM and the dequantisation.
#include "quant_amx_bf16.h"
#include "quant_kept.h"
#include <cstdio>
#include <cstring>
#include <random>
namespace quant_gemv_check {
using namespace servescope_quant;

// the activation value the group-32 kernel multiplies with: x rounded to its block's int8 grid
static double act_value(const std::vector<float>& x, int64_t m, int64_t kp, int64_t k, double* step) {
  const float* xb = x.data() + m * kp + (k / 32) * 32;
  float amax = 0.f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::abs(xb[j]));
  const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
  *step = d;
  return (double)d * (double)std::max(-127L, std::min(127L, std::lrint(x[m * kp + k] * id)));
}

// AVX512-BF16's conversion (VCVTNEPS2BF16, what the vector store uses where the CPU has it) flushes subnormal
// floats to a signed zero: MXFP4 blocks with the subnormal E8M0 scales hold such values
static bool flushed(float v, bf16 h) {
  return std::fpclassify(v) == FP_SUBNORMAL && (h.bits & 0x7FFF) == 0;
}

static int check(std::mt19937& g, bool i4, bool asym, int64_t N, int64_t kp, int64_t group, int64_t M,
                 bool mx = false) {
  int bad = 0;
  const int64_t G = kp / group;
  std::vector<uint8_t> w(N * (i4 ? kp / 2 : kp));
  for (auto& b : w) b = g() & 0xFF;
  std::vector<uint16_t> s(N * G * (asym ? 2 : 1));
  for (auto& h : s) h = 0x3000 + (g() & 0x3FF);  // small positive halves
  std::vector<float> x(M * kp), y(M * N), bias(N);
  for (auto& v : x) v = (float)((int)(g() % 200) - 100) / 50.f;
  for (auto& v : bias) v = (float)((int)(g() % 200) - 100) / 10.f;
  QMatrix q{w.data(), N, kp, group, i4, asym, s.data()};
  std::vector<uint8_t> e(N * G);  // MXFP4: E8M0 scales 2^-10 .. 2^1, and the two subnormal halves' bytes
  for (auto& v : e) v = g() % 16 == 0 ? g() % 2 : 117 + g() % 12;
  if (mx) q.e8m0 = e.data(), q.scales = nullptr;
  quant_matvec(q, x.data(), M, bias.data(), y.data());
  std::vector<float> yg(M * N, 0.f);  // the prefill GEMM (group 32 only): the same values as the GEMV
  if (group == 32) quant_gemm_rows(q, x.data(), M, bias.data(), yg.data());
  std::vector<std::vector<float>> yk;  // the group-32 kernels by order
  if (group == 32)
    for (QOrder o : {QOrder::Stream, QOrder::Tiled, QOrder::Amx}) {
      if (o == QOrder::Amx && !amx_available()) continue;
      yk.emplace_back(M * N);
      quant_rows(q, x.data(), M, bias.data(), yk.back().data(), o);
      std::vector<float> one(N);
      for (int64_t m = 0; m < M; ++m) {
        quant_rows(q, x.data() + m * kp, 1, bias.data(), one.data(), o);
        if (std::memcmp(one.data(), yk.back().data() + m * N, N * sizeof(float))) ++bad;
      }
      std::vector<bf16> xb(M * kp);
      std::vector<float> xw(M * kp), yb(M * N), yw(M * N);
      for (int64_t i = 0; i < M * kp; ++i) xb[i] = float_to_bf16(x[i]), xw[i] = bf16_to_float(xb[i]);
      quant_rows(q, xb.data(), M, bias.data(), yb.data(), o);
      quant_rows(q, xw.data(), M, bias.data(), yw.data(), o);
      if (std::memcmp(yb.data(), yw.data(), M * N * sizeof(float))) ++bad;
    }
  std::vector<float> ybf;  // the AMX-BF16 kernel, and its batching invariance and float32 = bfloat16 activations
  std::vector<bf16> xr(M * kp);
  for (int64_t i = 0; i < M * kp; ++i) xr[i] = float_to_bf16(x[i]);
  if (group == 32 && amx_bf16_available()) {
    ybf.resize(M * N);
    quant_rows(q, xr.data(), M, bias.data(), ybf.data(), QOrder::AmxBf16);
    std::vector<float> one(N), yf(M * N);
    for (int64_t m = 0; m < M; ++m) {
      quant_rows(q, xr.data() + m * kp, 1, bias.data(), one.data(), QOrder::AmxBf16);
      if (std::memcmp(one.data(), ybf.data() + m * N, N * sizeof(float))) ++bad;
    }
    quant_rows(q, x.data(), M, bias.data(), yf.data(), QOrder::AmxBf16);
    if (std::memcmp(yf.data(), ybf.data(), M * N * sizeof(float))) ++bad;
  }
  // the whole matrix in float32, and rows 1.. of it cut at k = kp - 5 (a K that is not a whole block) in
  // bfloat16, which must be the float32 values rounded once
  std::vector<float> deq(N * kp);
  dequantize_rows(q, 0, N, kp, deq.data());
  const int64_t kc = kp - 5;
  std::vector<bf16> deqb((N - 1) * kc + 1, bf16{0x1234});  // one guard element past the end
  dequantize_rows(q, 1, N - 1, kc, deqb.data());
  for (int64_t n = 1; n < N; ++n)
    for (int64_t k = 0; k < kc; ++k)
      if (const bf16 h = deqb[(n - 1) * kc + k]; h.bits != float_to_bf16(deq[n * kp + k]).bits && !flushed(deq[n * kp + k], h))
        ++bad;
  if (deqb.back().bits != 0x1234) ++bad;
  // the reference's factors, each computed once (the float64 sums below take them in the same order):
  // the decoded weights, the activations on their int8 grid with the grid's step, and the bfloat16 roundings
  std::vector<double> vals(N * kp), deq_bf(N * kp), xs(M * kp), steps(M * kp, 0.0), xr_f(M * kp);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < kp; ++k) {
      int64_t gi = k / group, b = k / 32, j = k % 32;
      const uint16_t* sp = s.data() + (n * G + gi) * (asym ? 2 : 1);
      double d = half_to_float(sp[0]);
      double u = i4 ? (double)((w[n * kp / 2 + b * 16 + (j % 16)] >> (j < 16 ? 0 : 4)) & 15)
                    : (double)(int8_t)w[n * kp + k];
      double val = asym ? d * u + half_to_float(sp[1]) : (i4 ? d * (u - 8) : d * u);
      if (mx) val = (double)e8m0_half(e[n * G + b]) * MXFP4_VALUES[(int)u];
      if (std::abs(deq[n * kp + k] - val) > 1e-5) ++bad;
      vals[n * kp + k] = val;
      deq_bf[n * kp + k] = bf16_to_float(float_to_bf16(deq[n * kp + k]));
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < kp; ++k) {
      const int64_t i = m * kp + k;
      xs[i] = group == 32 ? act_value(x, m, kp, k, &steps[i]) : x[i];
      xr_f[i] = bf16_to_float(xr[i]);
    }
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double ref = bias[n], exact = bias[n], bound = 0, ref_bf = bias[n], bound_bf = 0;
      const double* vn = vals.data() + n * kp;
      for (int64_t k = 0; k < kp; ++k) {
        const double val = vn[k], xa = xs[m * kp + k], xe = x[m * kp + k];
        ref += val * xa;
        exact += val * xe;
        ref_bf += deq_bf[n * kp + k] * xr_f[m * kp + k];
        bound_bf += std::abs(val * xe) / 128;  // two roundings of 2^-9 each, and their product
        bound += std::abs(val) * steps[m * kp + k] / 2;
      }
      if (std::abs(ref - y[m * N + n]) > 1e-3 * (1 + std::abs(ref))) ++bad;
      if (group == 32 && std::abs(ref - yg[m * N + n]) > 1e-3 * (1 + std::abs(ref))) ++bad;
      for (const auto& v : yk)
        if (std::abs(ref - v[m * N + n]) > 1e-3 * (1 + std::abs(ref))) ++bad;
      if (std::abs(exact - y[m * N + n]) > bound + 1e-3 * (1 + std::abs(exact))) ++bad;
      if (!ybf.empty() && std::abs(ref_bf - ybf[m * N + n]) > 1e-3 * (1 + std::abs(ref_bf))) ++bad;
      if (!ybf.empty() && std::abs(exact - ybf[m * N + n]) > bound_bf + 1e-3 * (1 + std::abs(exact))) ++bad;
    }
  return bad;
}

// quant_kept.h's kernel over the kept panel layout (each panel's dwords and float16 scales transposed, as
// model/linears/packed.py's to_panels lays them) against quant_gemm.h's per-call re-laid panels on the row layout:
// the same bits for every row count (tiles and their remainders), and each row alone the same bits as in the batch
static int check_kept(std::mt19937& g, bool i4, bool asym, int64_t kp) {
  int bad = 0;
#if SERVESCOPE_VECTOR_PANELS
  constexpr int64_t NP = KEPT_PANEL;
  const int64_t N = 2 * NP, rb = i4 ? kp / 2 : kp, nb = kp / 32, S = asym ? 2 : 1;
  std::vector<uint8_t> w(N * rb), wk(N * rb);
  for (auto& b : w) b = g() & 0xFF;
  std::vector<uint16_t> s(N * nb * S), sk(N * nb * S);
  for (auto& h : s) h = 0x3000 + (g() & 0x3FF);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t p = n / NP, c = n % NP;
    for (int64_t d = 0; d < rb / 4; ++d) std::memcpy(&wk[((p * (rb / 4) + d) * NP + c) * 4], &w[n * rb + d * 4], 4);
    for (int64_t b = 0; b < nb; ++b)
      for (int64_t t = 0; t < S; ++t) sk[((p * nb + b) * S + t) * NP + c] = s[(n * nb + b) * S + t];
  }
  const QMatrix q{w.data(), N, kp, 32, i4, asym, s.data()};
  QMatrix qk{wk.data(), N, kp, 32, i4, asym, sk.data()};
  qk.panel = NP;
  for (int64_t M : {1, 2, 3, 4, 5, 9}) {
    std::vector<float> x(M * kp), bias(N), ref(M * N), got(M * N), one(N);
    for (auto& v : x) v = (float)((int)(g() % 200) - 100) / 50.f;
    for (auto& v : bias) v = (float)((int)(g() % 200) - 100) / 10.f;
    quant_gemm_rows(q, x.data(), M, bias.data(), ref.data());
    quant_rows(qk, x.data(), M, bias.data(), got.data(), QOrder::Auto);
    if (std::memcmp(ref.data(), got.data(), M * N * sizeof(float))) ++bad;
    for (int64_t m = 0; m < M; ++m) {
      quant_rows(qk, x.data() + m * kp, 1, bias.data(), one.data(), QOrder::Auto);
      if (std::memcmp(one.data(), got.data() + m * N, N * sizeof(float))) ++bad;
    }
  }
  if (bad) printf("kept panels i4=%d asym=%d kp=%ld: bad=%d\n", (int)i4, (int)asym, (long)kp, bad);
#else
  (void)g, (void)i4, (void)asym, (void)kp;
#endif
  return bad;
}

// The activation rounding itself: ties go to even (as std::lrint, torch.round and the kernel's reference
// in quant/packed.py gemv_activations), values clamp to +-127, and the sum is the int8 values' sum.
static int check_rounding() {
  const float vals[8] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 3.5f, 130.f};  // 130: clamps to 127
  const int expect[8] = {0, 2, 2, 0, -2, -2, 4, 127};
  float x[32];
  int8_t q[32];
  int bad = 0, ref = 0;
  for (int k = 0; k < 32; ++k) x[k] = vals[k % 8] * (k >= 16 && k % 8 == 7 ? -1.f : 1.f);
  const int32_t sum = round_i8x32(x, 1.f, q);
  for (int k = 0; k < 32; ++k) {
    const int e = expect[k % 8] * (k >= 16 && k % 8 == 7 ? -1 : 1);
    ref += e;
    if (q[k] != e) ++bad;
  }
  if (sum != ref || absmax32(x) != 130.f) ++bad;
  if (bad) printf("rounding: bad=%d\n", bad);
  return bad;
}

// the number of failed checks
int run() {
  std::mt19937 g(1);
  int bad = check_rounding();
  // (rows, padded K, rows of x): whole and partial chunks of every ISA's vector, 1..4 and 5 (two tiles) rows of x
  // and many rows: partial tiles of every kernel, activation blocks that exceed a kernel's L2 budget (8192 x 60
  // for the weight-stationary order, x 140 for AMX: only in the AMX build, the others' orders split it as they do
  // 60 rows, and under qemu it alone took 13 of the NEON builds' 28 s)
  const int64_t shapes[][3] = {{7, 128, 3},  {5, 96, 1},  {9, 32, 5},     {6, 576, 2},    {13, 1536, 1},
                               {10, 160, 4}, {37, 288, 11}, {19, 96, 37}, {5, 8192, 60}, {3, 8192, 140}};
#if defined(__AMX_INT8__)
  const int num_shapes = 10;
#else
  const int num_shapes = 9;
#endif
  for (int i4 = 0; i4 < 2; ++i4)
    for (int asym = 0; asym < 2; ++asym)
      for (int s = 0; s < num_shapes; ++s)
        for (int64_t group : {32, 64})
          if (shapes[s][1] % group == 0) bad += check(g, i4, asym, shapes[s][0], shapes[s][1], group, shapes[s][2]);
  for (int i4 = 0; i4 < 2; ++i4)
    for (int asym = 0; asym < 2; ++asym)
      for (int64_t kp : {96, 288}) bad += check_kept(g, i4, asym, kp);
  for (int s = 0; s < num_shapes; ++s)  // MXFP4
    bad += check(g, true, false, shapes[s][0], shapes[s][1], 32, shapes[s][2], true);
  return bad;
}

}  // namespace quant_gemv_check
