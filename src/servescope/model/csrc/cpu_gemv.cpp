// Decode-time matrix-vector products for the CPU: y[m, n] = sum_k x[m, k] * W[n, k] for a few rows
// m (decode at small batch), with W in float32, bfloat16 or int8 (per-row scale).
//
// Why: at batch 1 decode reads every weight once per step, so its speed is memory bandwidth.
// Eager PyTorch's kernels reach about half of it for float32 on this CPU and much less for bfloat16;
// these loops stream W once, widen it to float32 in registers, and keep M x 4 accumulators, so the
// only traffic is the weights. Work is split over rows of W with at::parallel_for (torch's pool).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

namespace {


// Load 16 weights starting at p as float32, with a mask for the tail.
inline __m512 load_w(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_w(const uint16_t* p, __mmask16 m) {  // bfloat16: the high half of a float32
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_w(const int8_t* p, __mmask16 m) {
  __m128i b = _mm_maskz_loadu_epi8(m, p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

constexpr int U = 4;  // 16-wide chunks of K per loop iteration (independent accumulators)

template <typename W, int M>
inline void row_dot(const float* x, int64_t K, const W* wr, float* out, int64_t ldo) {
  // out[m * ldo] = dot(x[m], wr) for m < M. The weight row is read front to back once.
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    __m512 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = load_w(wr + k + 16 * u, (__mmask16)0xFFFF);
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wv[u], acc[m][u]);
  }
  for (; k < K; k += 16) {
    __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv = load_w(wr + k, mask);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    __m512 s = acc[m][0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[m][u]);
    out[m * ldo] = _mm512_reduce_add_ps(s);
  }
}

template <typename W>
void gemv_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale, const float* bias,
               float* y) {
  // y [M, N]. Each task owns a contiguous range of W's rows and reads it front to back, one row at
  // a time (a single sequential stream per thread is what the hardware prefetcher follows best:
  // interleaving 4 rows measured ~15% slower here); every group of up to 4 rows of x runs against
  // the row while it sits in L1.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      const W* wr = w + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = x + m0 * K;
        float* out = y + m0 * N + n;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: row_dot<W, 1>(xm, K, wr, out, N); break;
          case 2: row_dot<W, 2>(xm, K, wr, out, N); break;
          case 3: row_dot<W, 3>(xm, K, wr, out, N); break;
          default: row_dot<W, 4>(xm, K, wr, out, N); break;
        }
      }
      if (scale || bias)
        for (int64_t m = 0; m < M; ++m) {
          float& v = y[m * N + n];
          if (scale) v *= scale[n];
          if (bias) v += bias[n];
        }
    }
  });
}

template <typename W>
void dispatch_m(int64_t M, const float* x, int64_t K, const W* w, int64_t N, const float* s, const float* b, float* y) {
  gemv_impl<W>(x, M, K, w, N, s, b, y);
}

}  // namespace

// x [M, K] (any float dtype; widened to float32), w [N, K] float32 | bfloat16 | int8,
// scale [N] float32 (int8 only, else empty), bias [N] float32 or empty -> y [M, N] float32.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: shapes");
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous");
  auto xf = x.to(torch::kFloat32).contiguous();
  int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, xf.options());
  const float* s = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (w.scalar_type() == torch::kFloat32) {
    dispatch_m<float>(M, xf.data_ptr<float>(), K, w.data_ptr<float>(), N, s, b, y.data_ptr<float>());
  } else if (w.scalar_type() == torch::kBFloat16) {
    dispatch_m<uint16_t>(M, xf.data_ptr<float>(), K, reinterpret_cast<const uint16_t*>(w.data_ptr()), N, s, b,
                         y.data_ptr<float>());
  } else if (w.scalar_type() == torch::kInt8) {
    TORCH_CHECK(s != nullptr, "gemv: int8 weights need a scale");
    dispatch_m<int8_t>(M, xf.data_ptr<float>(), K, w.data_ptr<int8_t>(), N, s, b, y.data_ptr<float>());
  } else {
    TORCH_CHECK(false, "gemv: unsupported weight dtype");
  }
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gemv", &gemv, "decode GEMV (float32/bfloat16/int8 weights)"); }
