// The float32 GEMM for a few to a few dozen rows (decode steps of a batch, short prefill chunks) on
// weights packed once into column panels, written once against the vector layer (simd.h).
//
// Why: at M = 8..64 rows neither the decode GEMV nor oneDNN's prepacked GEMM is near the machine. The
// GEMV reads each weight once but does one dot product per (row, output) with a horizontal sum each;
// oneDNN's blocked kernel stays well below the machine's peak at these rows, and a batch-8 float32
// decode step took several times its weight-read time (docs/BENCHMARKS.md).
//
// Layout: w [N, K] becomes panels [ceil(N / NB)][K][NB], NB = NR vectors of output columns (zeros past
// N). For each k the kernel loads the panel's NR weight vectors once and multiplies them with x[m, k]
// broadcast for each of MR rows: MR x NR accumulators stay in registers for a whole k range, no
// horizontal sums, NR loads and MR broadcasts per MR * NR fused multiply-adds. Each output is summed
// in k order in float32 (one rounding per product and add, as a dot product).
//
// Blocking: a thread takes (row block, panel) items; K is cut into chunks of at most PANEL_KC (a panel
// chunk is <= PANEL_KC * NB * 4 bytes, 24 KiB for AVX-512: it stays in L1 while each row tile of the
// block passes over it, so the first tile's stream from memory continues into the next chunk while the
// others compute). Up to PANEL_MC rows (a decode batch, a short chunk) the weights are read from memory
// once per call; above, once per row block.
#pragma once

#include "simd.h"

namespace servescope_kernels {

using namespace servescope_simd;

// Register tiles per ISA: AVX2 has 16 vector registers (6 x 2 accumulators + 2 weight vectors + the
// broadcast), AVX-512 and NEON 32 (8 x 2 + 3; a decode batch of 8 is one tile); the scalar path's
// "registers" are arrays and the tile is only its loop shape.
#if defined(SERVESCOPE_ISA_AVX2)
constexpr int PANEL_MR = 6;
#else
constexpr int PANEL_MR = 8;
#endif
constexpr int PANEL_NR = 2;
constexpr int64_t PANEL_NB = PANEL_NR * W;  // output columns per panel
// The panel is prefetched 8 KiB ahead of the k step: the hardware prefetcher alone left a core's
// stream at about half its bandwidth once each step had a dozen FMAs to do (docs/BENCHMARKS.md has the
// distances tried)
constexpr int64_t PANEL_PF = 8192 / (PANEL_NB * 4);
// the most k per chunk: the best of the sizes tried on the AVX-512 path, and close to it on AVX2
constexpr int64_t PANEL_KC = 192;
constexpr int64_t PANEL_MC = 256;  // rows per block: a block's x chunk (256 x 192 floats) stays in L2

inline int64_t panel_count(int64_t n) { return (n + PANEL_NB - 1) / PANEL_NB; }

// w [N, K] (row stride K) -> out [panel_count(N)][K][PANEL_NB], columns past N zero
template <typename WT>
void pack_panels(const WT* w, int64_t N, int64_t K, float* out) {
  parallel_for(0, panel_count(N), grain_for(K * PANEL_NB), [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* dst = out + p * K * PANEL_NB;
      for (int64_t c = 0; c < PANEL_NB; ++c) {
        const int64_t n = p * PANEL_NB + c;
        if (n >= N) {
          for (int64_t k = 0; k < K; ++k) dst[k * PANEL_NB + c] = 0.f;
          continue;
        }
        const WT* src = w + n * K;
        for (int64_t k = 0; k < K; ++k) {
          if constexpr (std::is_same_v<WT, float>)
            dst[k * PANEL_NB + c] = src[k];
          else
            dst[k * PANEL_NB + c] = bf16_to_float(src[k]);
        }
      }
    }
  });
}

// Rows x[0 .. MR) (row stride ldx, k from k0 to k1) against one panel (pan: row k at pan + k * NB):
// y[m, 0 .. cols) (row stride ldy) = (first ? 0 : y) + the partial sums, + bias on the last chunk.
// Every loop over the tile is unrolled: an accumulator indexed at run time would live in memory.
template <int MR>
inline void panel_tile(const float* x, int64_t ldx, int64_t k0, int64_t k1, const float* pan, float* y, int64_t ldy,
                       int64_t cols, const float* bias, bool first, bool last) {
  constexpr int NR = PANEL_NR;
  vf acc[MR][NR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 8
    for (int s = 0; s < NR; ++s) acc[m][s] = zero();
  for (int64_t k = k0; k < k1; ++k) {
    const float* pk = pan + k * PANEL_NB;
#pragma GCC unroll 8
    for (int64_t b = 0; b < PANEL_NB; b += 16) prefetch_l2(pk + PANEL_PF * PANEL_NB + b);
    vf w[NR];
#pragma GCC unroll 8
    for (int s = 0; s < NR; ++s) w[s] = load(pk + s * W);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const vf xb = set1(x[m * ldx + k]);
#pragma GCC unroll 8
      for (int s = 0; s < NR; ++s) acc[m][s] = fmadd(xb, w[s], acc[m][s]);
    }
  }
#pragma GCC unroll 8
  for (int s = 0; s < NR; ++s) {
    const int64_t n = std::min<int64_t>(W, cols - s * W);
    const vf b = last && bias && n > 0 ? loadn(bias + s * W, n) : zero();
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      float* out = y + m * ldy + s * W;
      if (n == W) {
        const vf v = first ? acc[m][s] : add(load(out), acc[m][s]);
        store(out, last && bias ? add(v, b) : v);
      } else if (n > 0) {
        const vf v = first ? acc[m][s] : add(loadn(out, n), acc[m][s]);
        storen(out, last && bias ? add(v, b) : v, n);
      }
    }
  }
}

// x [M, K] float32 (row stride K), panels from pack_panels of w [N, K], bias [N] or null -> y [M, N] = x w^T + bias.
// Work items are (block of PANEL_MC rows, panel), row block major: a thread's items share their x rows.
inline void panel_gemm(const float* x, int64_t M, int64_t K, const float* panels, int64_t N, const float* bias,
                       float* y) {
  const int64_t chunks = std::max<int64_t>(1, (K + PANEL_KC - 1) / PANEL_KC), kc = (K + chunks - 1) / chunks;
  const int64_t np = panel_count(N), mb = (M + PANEL_MC - 1) / PANEL_MC;
  const int64_t block = std::min<int64_t>(M, PANEL_MC);
  parallel_for(0, mb * np, grain_for(block * K * PANEL_NB, 1 << 17), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t p = i % np, r0 = i / np * PANEL_MC, rows = std::min(M, r0 + PANEL_MC) - r0;
      const float* pan = panels + p * K * PANEL_NB;
      const int64_t cols = std::min<int64_t>(PANEL_NB, N - p * PANEL_NB);
      float* yp = y + r0 * N + p * PANEL_NB;
      const float* xp = x + r0 * K;
      const float* bp = bias ? bias + p * PANEL_NB : nullptr;
      // tiles of equal height (8 rows on AVX2: 4 + 4, not 6 + 2: a short tile passes over the panel at a
      // fraction of the FMA rate)
      const int64_t tiles = (rows + PANEL_MR - 1) / PANEL_MR;
      for (int64_t k0 = 0; k0 < K; k0 += kc) {
        const int64_t k1 = std::min(K, k0 + kc);
        const bool first = k0 == 0, last = k1 == K;
        for (int64_t t = 0, m = 0; t < tiles; ++t) {
          const int64_t h = (rows - m) / (tiles - t);
          with_count<PANEL_MR>(h, [&](auto r) {
            panel_tile<decltype(r)::value>(xp + m * K, K, k0, k1, pan, yp + m * N, N, cols, bp, first, last);
          });
          m += h;
        }
      }
    }
  });
}

}  // namespace servescope_kernels
