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

template <typename W, int M>
void rows4(const float* x, int64_t K, const W* w, int64_t ldw, int64_t n, int64_t nrows, float* acc_out) {
  // acc_out[m * 4 + r] = dot(x[m], w[n + r]) for r < nrows (nrows <= 4)
  __m512 acc[M][4];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_setzero_ps();
  const W* wr[4];
  for (int r = 0; r < 4; ++r) wr[r] = w + (n + (r < nrows ? r : 0)) * ldw;
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load_w(wr[r] + k, (__mmask16)0xFFFF);
    for (int m = 0; m < M; ++m) {
      __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  if (k < K) {
    __mmask16 mask = (__mmask16)((1u << (K - k)) - 1);
    __m512 wv[4];
    for (int r = 0; r < 4; ++r) wv[r] = load_w(wr[r] + k, mask);
    for (int m = 0; m < M; ++m) {
      __m512 xv = _mm512_maskz_loadu_ps(mask, x + m * K + k);
      for (int r = 0; r < 4; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < 4; ++r) acc_out[m * 4 + r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <typename W>
void gemv_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale, const float* bias,
               float* y) {
  // y [M, N]. Each task owns blocks of 4 rows of W and runs every group of up to 4 rows of x
  // against them: the 4 weight rows stream from memory once and stay in L1 for the later groups.
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t b0, int64_t b1) {
    float acc[16];
    for (int64_t b = b0; b < b1; ++b) {
      int64_t n = b * 4;
      int64_t nrows = std::min<int64_t>(4, N - n);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        int64_t mm = std::min<int64_t>(4, M - m0);
        const float* xm = x + m0 * K;
        switch (mm) {
          case 1: rows4<W, 1>(xm, K, w, K, n, nrows, acc); break;
          case 2: rows4<W, 2>(xm, K, w, K, n, nrows, acc); break;
          case 3: rows4<W, 3>(xm, K, w, K, n, nrows, acc); break;
          default: rows4<W, 4>(xm, K, w, K, n, nrows, acc); break;
        }
        for (int64_t m = 0; m < mm; ++m)
          for (int64_t r = 0; r < nrows; ++r) {
            float v = acc[m * 4 + r];
            if (scale) v *= scale[n + r];
            if (bias) v += bias[n + r];
            y[(m0 + m) * N + n + r] = v;
          }
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
