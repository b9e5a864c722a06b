// The CPU kernels on raw pointers, written once against the vector layer (simd.h): rms_norm /
// add_rms_norm, rotary, silu_mul, the KV-cache store, the decode GEMV and paged decode attention.
// Torch-free: cpu_ops.cpp binds them for the extension, test_kernels.cpp checks them against float64
// references on every ISA (natively, and for aarch64 under qemu).
//
// Numerics follow the torch references in fused_ops.py / attention/torch_ref.py: math in float32,
// intermediate roundings to the tensor dtype (bfloat16) where the reference has them. Built with
// -ffp-contract=off so that the element-wise ops round like the eager ones (explicit FMAs only in
// reductions). Rows are split over the thread pool only when there is enough work to pay for waking it.
#pragma once

#include "simd.h"

namespace servescope_kernels {

using namespace servescope_simd;

// ---------------------------------------------------------------------------------------------
// rms_norm / add_rms_norm. Reference: xf = x.float(); xf *= rsqrt(mean(xf^2) + eps);
// y = w * xf.to(dtype); with a residual r (r != nullptr), h := x + r (in dtype) first, also written.
template <typename T>
void norm_rows(const T* x, int64_t xs, const T* r, int64_t rs, T* h, T* y, const T* w, int64_t rows, int64_t n,
               float eps) {
  parallel_for(0, rows, grain_for(n), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const T* xi = x + i * xs;
      T* yi = y + i * n;
      vf acc = zero();
      if (r) {
        const T* ri = r + i * rs;
        T* hi = h + i * n;
        for (int64_t k = 0; k < n; k += W) {
          vf v = rnd<T>(add(loadn(xi + k, n - k), loadn(ri + k, n - k)));
          storen(hi + k, v, n - k);
          acc = fmadd(v, v, acc);
        }
        xi = hi;
      } else {
        for (int64_t k = 0; k < n; k += W) {
          vf v = loadn(xi + k, n - k);
          acc = fmadd(v, v, acc);
        }
      }
      const vf iv = set1(1.0f / std::sqrt(reduce_add(acc) / (float)n + eps));
      for (int64_t k = 0; k < n; k += W) {
        vf v = rnd<T>(mul(loadn(xi + k, n - k), iv));
        storen(yi + k, mul(loadn(w + k, n - k), v), n - k);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// rotary, rotate-half: out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin), float32 math.
// q [T, Hq, D] at strides (qs0, qs1), k [T, Hk, D] at (ks0, ks1) -> qo, ko contiguous;
// cos, sin [T, D/2] float32 at row stride cs.
template <typename T>
void rotary_rows(const T* qp, int64_t qs0, int64_t qs1, const T* kp, int64_t ks0, int64_t ks1, T* qop, T* kop,
                 int64_t t, int64_t hq, int64_t hk, int64_t d, const float* cos, const float* sin, int64_t cs) {
  const int64_t half = d / 2, heads = hq + hk;
  parallel_for(0, t * heads, grain_for(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t ti = r / heads, hi = r % heads;
      const T* src = hi < hq ? qp + ti * qs0 + hi * qs1 : kp + ti * ks0 + (hi - hq) * ks1;
      T* dst = hi < hq ? qop + (ti * hq + hi) * d : kop + (ti * hk + hi - hq) * d;
      const float* c = cos + ti * cs;
      const float* s = sin + ti * cs;
      for (int64_t j = 0; j < half; j += W) {
        const int64_t m = half - j;
        vf x1 = loadn(src + j, m), x2 = loadn(src + half + j, m);
        vf cv = loadn(c + j, m), sv = loadn(s + j, m);
        storen(dst + j, sub(mul(x1, cv), mul(x2, sv)), m);
        storen(dst + half + j, add(mul(x2, cv), mul(x1, sv)), m);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// silu_mul: [rows, 2I] (row stride xs) -> [rows, I], silu(g) = g / (1 + exp(-g)), then * up (each
// rounded to the dtype).
template <typename T>
void silu_mul_rows(const T* x, int64_t xs, T* y, int64_t rows, int64_t inner) {
  parallel_for(0, rows, grain_for(inner), [&](int64_t r0, int64_t r1) {
    const vf one = set1(1.0f);
    for (int64_t i = r0; i < r1; ++i) {
      const T* g = x + i * xs;
      const T* u = g + inner;
      T* o = y + i * inner;
      for (int64_t j = 0; j < inner; j += W) {
        const int64_t m = inner - j;
        vf gv = loadn(g + j, m);
        vf s = rnd<T>(div(gv, add(one, vexp(sub(zero(), gv)))));
        storen(o + j, mul(s, loadn(u + j, m)), m);
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// store_kv: cache.view(N*S, Hkv, D)[slot[t]] = src[t] (converted to the cache dtype)
template <typename S, typename C>
void copy_rows(const S* src, int64_t s0, int64_t s1, C* cache, const int64_t* slots, int64_t t, int64_t hkv,
               int64_t d) {
  parallel_for(0, t, grain_for(hkv * d, 65536), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      C* dst = cache + slots[i] * hkv * d;
      for (int64_t h = 0; h < hkv; ++h) {
        const S* sp = src + i * s0 + h * s1;
        C* dp = dst + h * d;
        if constexpr (std::is_same_v<S, C>) {
          std::memcpy(dp, sp, d * sizeof(C));
        } else {
          for (int64_t j = 0; j < d; j += W) storen(dp + j, loadn(sp + j, d - j), d - j);
        }
      }
    }
  });
}

// ---------------------------------------------------------------------------------------------
// Decode-time matrix-vector products: y[m, n] = sum_k x[m, k] * Wt[n, k] for a few rows m (decode at
// small batch), with the weight in float32, bfloat16 or int8 (per-row scale).
//
// Why: at batch 1 decode reads every weight once per step, so its speed is memory bandwidth.
// Eager PyTorch's kernels reach about half of it for float32 and much less for bfloat16; these loops
// stream the weight once, widen it to float32 in registers, and keep M x U accumulators, so the only
// traffic is the weights. Work is split over rows of the weight.
constexpr int U = 4;  // W-wide chunks of K per loop iteration (independent accumulators)

template <typename WT, int M>
inline void row_dot(const float* x, int64_t K, const WT* wr, float* out, int64_t ldo) {
  // out[m * ldo] = dot(x[m], wr) for m < M. The weight row is read front to back once.
  vf acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = zero();
  int64_t k = 0;
  for (; k + W * U <= K; k += W * U) {
    vf wv[U];
    for (int u = 0; u < U; ++u) wv[u] = load(wr + k + W * u);
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = fmadd(load(x + m * K + k + W * u), wv[u], acc[m][u]);
  }
  for (; k < K; k += W) {
    const vf wv = loadn(wr + k, K - k);
    for (int m = 0; m < M; ++m) acc[m][0] = fmadd(loadn(x + m * K + k, K - k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    vf s = acc[m][0];
    for (int u = 1; u < U; ++u) s = add(s, acc[m][u]);
    out[m * ldo] = reduce_add(s);
  }
}

// One row of x against four rows of the weight read in lockstep: four memory streams per thread (one
// stream per thread left a core at ~70% of what a streaming sum reads on one core), each x vector
// loaded once for the four rows.
template <typename WT>
inline void rows4_dot(const float* x, int64_t K, const WT* const* wr, float* const* out) {
  vf a[4][2];
  for (int s = 0; s < 4; ++s) a[s][0] = a[s][1] = zero();
  int64_t k = 0;
  for (; k + 2 * W <= K; k += 2 * W) {
    const vf x0 = load(x + k), x1 = load(x + k + W);
    for (int s = 0; s < 4; ++s) {
      a[s][0] = fmadd(x0, load(wr[s] + k), a[s][0]);
      a[s][1] = fmadd(x1, load(wr[s] + k + W), a[s][1]);
    }
  }
  for (; k < K; k += W) {
    const vf x0 = loadn(x + k, K - k);
    for (int s = 0; s < 4; ++s) a[s][0] = fmadd(x0, loadn(wr[s] + k, K - k), a[s][0]);
  }
  for (int s = 0; s < 4; ++s) *out[s] = reduce_add(add(a[s][0], a[s][1]));
}

// MB rows of x against four rows of the weight read in lockstep, one accumulator per (x row, weight
// row): MB * 4 = W accumulators (AVX-512: 4 x 4, AVX2: 2 x 4; NEON: 1 x 4) summed across their lanes
// together by one transpose_sum instead of MB * 4 horizontal sums, which for K = 576 would cost half
// as much as the products. Per W-wide step: 4 weight loads and MB x loads for 4 * MB products.
constexpr int GEMV_MB = W / 4;
static_assert(GEMV_MB >= 1 && GEMV_MB * 4 == W, "rows4_block: one transpose_sum of W accumulators");

template <typename WT, int MB>
inline void rows4_block(const float* x, int64_t K, const WT* const* wr, float* y, int64_t N, const int64_t* cols) {
  static_assert(MB >= 1 && MB <= GEMV_MB, "rows4_block: MB x rows of x");
  vf a[W];
  for (int i = 0; i < W; ++i) a[i] = zero();
  // one W-wide step at k: full (load) or the row's last, partial one (loadn of n lanes)
  auto step = [&](int64_t k, auto ld) {
    vf wv[4];
    for (int s = 0; s < 4; ++s) wv[s] = ld(wr[s] + k);
    for (int m = 0; m < MB; ++m) {
      const vf xv = ld(x + m * K + k);
      for (int s = 0; s < 4; ++s) a[m * 4 + s] = fmadd(xv, wv[s], a[m * 4 + s]);
    }
  };
  int64_t k = 0;
  for (; k + W <= K; k += W) step(k, [](const auto* p) { return load(p); });
  if (k < K) step(k, [n = K - k](const auto* p) { return loadn(p, n); });
  float sums[W];
  store(sums, transpose_sum(a));
  for (int m = 0; m < MB; ++m)
    for (int s = 0; s < 4; ++s) y[m * N + cols[s]] = sums[m * 4 + s];
}

// x [M, K] float32, w [N, K], scale [N] or null, bias [N] or null -> y [M, N]. Each task owns a
// contiguous range of the weight's rows, read as four quarters in lockstep: over SmolLM2's 121 matrices
// that reads at 94% of a streaming sum against 77-81% for one stream per thread (AVX-512, 2 threads).
// With one row of x (decode at batch 1) each quarter's row is dotted with it (rows4_dot); with more,
// every block of GEMV_MB rows of x is multiplied with the four rows while they sit in L1 (rows4_block),
// so the weights still cross memory once per step. (Four consecutive rows, one stream per thread, read
// at half the one-row path's rate at K = 576 on a Zen 4: bfloat16 15 against 29-33 GB/s, so 2-4 rows
// of x took 1.8-2.2x one row's time; docs/BENCHMARKS.md.) The rows left over (fewer than 4 at the end
// of a task) go one at a time (row_dot).
template <typename WT, int MB = GEMV_MB>
void rows4_blocks(const float* x, int64_t M, int64_t K, const WT* const* wr, float* y, int64_t N,
                  const int64_t* cols) {
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) rows4_block<WT, MB>(x + m0 * K, K, wr, y + m0 * N, N, cols);
  if constexpr (MB > 1)
    if (m0 < M) rows4_blocks<WT, MB - 1>(x + m0 * K, M - m0, K, wr, y + m0 * N, N, cols);
}

// The weight rows [n0, n1) of a thread's range as four quarters read in lockstep: fn(wr, cols) for each i of the
// q = (n1 - n0) / 4 rows of a quarter (wr[s], cols[s]: row n0 + s q + i of each quarter). Returns the first row left
// over (n0 + 4 q): the caller takes those one at a time.
template <typename WT, typename Fn>
inline int64_t for_each_quarter_row(int64_t n0, int64_t n1, const WT* w, int64_t K, Fn&& fn) {
  const int64_t q = (n1 - n0) / 4;
  for (int64_t i = 0; i < q; ++i) {
    const WT* wr[4];
    int64_t cols[4];
    for (int s = 0; s < 4; ++s) {
      cols[s] = n0 + s * q + i;
      wr[s] = w + cols[s] * K;
    }
    fn(wr, cols);
  }
  return n0 + 4 * q;
}

template <typename WT>
void gemv_rows(const float* x, int64_t M, int64_t K, const WT* w, int64_t N, const float* scale, const float* bias,
               float* y) {
  parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const int64_t rest = for_each_quarter_row(n0, n1, w, K, [&](const WT* const* wr, const int64_t* cols) {
      if (M == 1) {
        float* out[4] = {y + cols[0], y + cols[1], y + cols[2], y + cols[3]};
        rows4_dot<WT>(x, K, wr, out);
      } else {
        rows4_blocks<WT>(x, M, K, wr, y, N, cols);
      }
    });
    for (int64_t n = rest; n < n1; ++n) {
      const WT* wr = w + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = x + m0 * K;
        float* out = y + m0 * N + n;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: row_dot<WT, 1>(xm, K, wr, out, N); break;
          case 2: row_dot<WT, 2>(xm, K, wr, out, N); break;
          case 3: row_dot<WT, 3>(xm, K, wr, out, N); break;
          default: row_dot<WT, 4>(xm, K, wr, out, N); break;
        }
      }
    }
    if (scale || bias)
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m) {
          float& v = y[m * N + n];
          if (scale) v *= scale[n];
          if (bias) v += bias[n];
        }
  });
}

#if SERVESCOPE_HAS_BF16_DOT
// ---------------------------------------------------------------------------------------------
// bfloat16 rows of x against a bfloat16 weight with VDPBF16PS (AVX512-BF16): 2-16 rows (decode batches). The
// float32 path above widens every weight element and multiplies it once per row of x, so from 3-4 rows on its
// arithmetic, not the weight read, sets its time (SmolLM2's K = 576 matrices on a Zen 4: 4 rows took 1.5x one
// row's time). Here a bfloat16 pair of x and of the weight is multiplied exactly and summed in float32 by one
// instruction, 32 products of 64 bytes of weight, no widening: four weight rows (the quarters of gemv_rows, read
// in lockstep) against MB rows of x in MB x 4 accumulators, summed across lanes by one transpose_sum. x must be
// bfloat16 already (a bfloat16 model's activations are), so nothing is rounded that was not; the sum's order and
// rounding differ from the float32 path's (each pair's two products summed before the accumulation).
__attribute__((always_inline)) inline __m512bh bf16_chunk(const bf16* p, int64_t n) {  // 32, or the first n and 0s
  return (__m512bh)(n >= 32 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16((__mmask32)((1u << n) - 1), p));
}

template <int MB>
inline void rows4_block_dot(const bf16* x, int64_t K, const bf16* const* wr, float* y, int64_t N,
                            const int64_t* cols) {
  static_assert(MB >= 1 && MB * 4 <= W, "rows4_block_dot: MB x rows of x");
  vf a[W];
  for (int i = 0; i < W; ++i) a[i] = zero();
  // one 32-wide step at k: full (n = 32) or the rows' last, partial one
  auto step = [&](int64_t k, int64_t n) __attribute__((always_inline)) {
    __m512bh wv[4];
    for (int s = 0; s < 4; ++s) wv[s] = bf16_chunk(wr[s] + k, n);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = bf16_chunk(x + m * K + k, n);
      for (int s = 0; s < 4; ++s) a[m * 4 + s] = _mm512_dpbf16_ps(a[m * 4 + s], xv, wv[s]);
    }
  };
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, 32);
  if (k < K) step(k, K - k);
  float sums[W];
  store(sums, transpose_sum(a));
  for (int m = 0; m < MB; ++m)
    for (int s = 0; s < 4; ++s) y[m * N + cols[s]] = sums[m * 4 + s];
}

template <int MB = W / 4>
void rows4_blocks_dot(const bf16* x, int64_t M, int64_t K, const bf16* const* wr, float* y, int64_t N,
                      const int64_t* cols) {
  int64_t m0 = 0;
  for (; m0 + MB <= M; m0 += MB) rows4_block_dot<MB>(x + m0 * K, K, wr, y + m0 * N, N, cols);
  if constexpr (MB > 1)
    if (m0 < M) rows4_blocks_dot<MB - 1>(x + m0 * K, M - m0, K, wr, y + m0 * N, N, cols);
}

// x [M, K] bfloat16, w [N, K] bfloat16, bias [N] or null -> y [M, N] float32: gemv_rows' split of the weight's
// rows over the threads and into quarters; the rows left at a range's end (fewer than 4) one at a time.
inline void gemv_rows_bf16_dot(const bf16* x, int64_t M, int64_t K, const bf16* w, int64_t N, const float* bias,
                               float* y) {
  parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    const int64_t rest = for_each_quarter_row(n0, n1, w, K, [&](const bf16* const* wr, const int64_t* cols) {
      rows4_blocks_dot(x, M, K, wr, y, N, cols);
    });
    for (int64_t n = rest; n < n1; ++n)
      for (int64_t m = 0; m < M; ++m) {
        __m512 a = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 32)
          a = _mm512_dpbf16_ps(a, bf16_chunk(x + m * K + k, K - k), bf16_chunk(w + n * K + k, K - k));
        y[m * N + n] = reduce_add(a);
      }
    if (bias)
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m) y[m * N + n] += bias[n];
  });
}
#endif

}  // namespace servescope_kernels

#include "decode_attention.h"
#include "panel_gemm.h"
