// The integer panel GEMM of quant_gemm.h over weights kept in its panel layout: the per-call re-layout done
// once at load time instead (model/linears/packed.py's QuantLinear.keep_panels), for every row count.
//
// Why: quant_gemm.h re-lays each panel of NP columns on every call, a pass over the whole weight plus register
// transposes that cost about as much as the products of 16 rows (benchmarks/quant_rows.py on a Zen 4), which is
// why it only took over from the VNNI orders at 4 rows (int4). Kept panels cost nothing per call, so one kernel
// serves a decode step of any batch: at one row it streams each panel's bytes front to back (one contiguous
// stream per thread, where the VNNI orders read W rows at a stride), and a row's result does not depend on how
// many rows share the call (the same operations per row, in the same order, at every M).
//
// Layout (QMatrix::panel == GEMM_NP): the weight's dwords transposed per panel of NP rows,
// [N / NP][row_bytes / 4][NP][4]: dword d of every row of the panel is one run of NP dwords. int4 keeps its packed
// bytes as they are stored: quad j < 4 of a block holds elements 4j .. 4j + 3 in its low nibbles and 16 + 4j ..
// in its high ones (quant_gemm.h's quads j and j + 4), split in registers. float16 scales [N / NP][nb][S][NP]
// (S = 2 when asymmetric: d, then m). The same bytes as the row layout, permuted: the weight bytes the model
// reports do not change. The arithmetic is quant_gemm.h's gemm_tile's, operation for operation, so the
// results equal its re-laid panels' bit for bit (tests/kernels/test_quant_kept.py).
#pragma once

#include "quant_gemm.h"

namespace servescope_quant {

#if SERVESCOPE_VECTOR_PANELS
constexpr int64_t KEPT_PANEL = GEMM_NP;

// W float16 scales as floats
inline vf load_halves(const uint16_t* h) {
#if defined(SERVESCOPE_ISA_AVX512)
  return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));
#else
  return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
#endif
}

// Whether int8 weights are kept: where the CPU has int8 dot products (VNNI). Without them an int8 product is a
// sign fix-up, maddubs and madd per vector and row, and one row over kept panels ran 1.5x the K-major streaming
// order's time on the AVX2 build (benchmarks/quant_rows.py, docs/BENCHMARKS.md); int4's unsigned nibbles need
// no fix-up and were level at one row, ahead at 2-8.
constexpr bool KEPT_INT8 = SERVESCOPE_HAS_INT8_DOT;

// out[m * ldo + c] for rows m0 .. m0 + MR of a against the NR vectors of columns from vector s0 of kept panel p
// (AVX2, 16 registers: its 2-row int4 tile spills over both vectors of a panel, so it takes one at a time)
template <bool I4, bool ASYM, int MR, int NR>
inline void kept_tile(const GemmActs& a, const QMatrix& q, int64_t p, int64_t s0, int64_t m0, float* out,
                      int64_t ldo) {
  constexpr int64_t S = ASYM ? 2 : 1, NP = GEMM_NP;
  const int64_t nb = a.nb, kp = q.kp;
  const uint8_t* pw = q.w + p * q.row_bytes() * NP + s0 * W * 4;
  const uint16_t* ps = q.scales + p * nb * S * NP + s0 * W;
  out += s0 * W;
  const int8_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = a.q.data() + (m0 + m) * kp;
  vf tot[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) tot[m][s] = zero();
  for (int64_t b = 0; b < nb; ++b) {
    vi acc[MR][NR];
    tile_block_start<I4, ASYM>(a, m0, b, acc);
    if constexpr (I4) {
      const uint8_t* pb = pw + b * 16 * NP;  // the block's 4 quads of packed bytes
      for (int j = 0; j < 4; ++j) {
        vb lo[NR], hi[NR];
        for (int s = 0; s < NR; ++s) {
          const vb raw = loadb(pb + (j * NP + s * W) * 4);
          lo[s] = low_nibbles(raw), hi[s] = high_nibbles(raw);
        }
        for (int m = 0; m < MR; ++m) {
          const vb xl = bcast4(xq[m] + b * QBLOCK + 4 * j), xh = bcast4(xq[m] + b * QBLOCK + 16 + 4 * j);
          for (int s = 0; s < NR; ++s) acc[m][s] = dot_u4x2(acc[m][s], lo[s], xl, hi[s], xh);
        }
      }
    } else {
      const uint8_t* pb = pw + b * QBLOCK * NP;
      for (int j = 0; j < 8; ++j) {
        vb w[NR];
        for (int s = 0; s < NR; ++s) w[s] = loadb(pb + (j * NP + s * W) * 4);
        for (int m = 0; m < MR; ++m) {
          const vb x4 = bcast4(xq[m] + b * QBLOCK + 4 * j);
          for (int s = 0; s < NR; ++s) acc[m][s] = dot_s8_biased(acc[m][s], w[s], x4);
        }
      }
    }
    vf dv[NR], mv[NR];
    for (int s = 0; s < NR; ++s) {
      dv[s] = load_halves(ps + b * S * NP + s * W);
      if constexpr (ASYM) mv[s] = load_halves(ps + (b * S + 1) * NP + s * W);
    }
    tile_block_end<ASYM>(a, m0, b, acc, dv, mv, tot);
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) store(out + m * ldo + s * W, tot[m][s]);
}

// rows mb .. me of a against kept panel p (out: row 0's first column of the panel): tiles of GEMM_MR rows, then
// one tile of the rest
template <bool I4, bool ASYM>
inline void kept_panel_rows(const GemmActs& a, const QMatrix& q, int64_t p, int64_t mb, int64_t me, float* out,
                            int64_t ldo) {
#if defined(SERVESCOPE_ISA_AVX2)  // 2-row tiles one vector of columns at a time; a last row over both
  const int64_t whole = me - (me - mb) % GEMM_MR;
  for (int64_t s0 = 0; s0 < GEMM_NR; ++s0)
    for (int64_t m = mb; m < whole; m += GEMM_MR) kept_tile<I4, ASYM, GEMM_MR, 1>(a, q, p, s0, m, out + m * ldo, ldo);
  if (whole < me) kept_tile<I4, ASYM, 1, GEMM_NR>(a, q, p, 0, whole, out + whole * ldo, ldo);
#else
  constexpr int NR = GEMM_NR;
  int64_t m = mb;
  for (; m + GEMM_MR <= me; m += GEMM_MR) kept_tile<I4, ASYM, GEMM_MR, NR>(a, q, p, 0, m, out + m * ldo, ldo);
  const int64_t rest = me - m;
  if (rest == 1) kept_tile<I4, ASYM, 1, NR>(a, q, p, 0, m, out + m * ldo, ldo);
  if (rest == 2) kept_tile<I4, ASYM, 2, NR>(a, q, p, 0, m, out + m * ldo, ldo);
  if (rest == 3) kept_tile<I4, ASYM, 3, NR>(a, q, p, 0, m, out + m * ldo, ldo);
#endif
}

// kept_panel_rows for q's format; out [*, q.n] at panel p's first column
inline void kept_rows(const GemmActs& a, const QMatrix& q, int64_t p, int64_t mb, int64_t me, float* out) {
  if (q.int4 && q.asym)
    kept_panel_rows<true, true>(a, q, p, mb, me, out, q.n);
  else if (q.int4)
    kept_panel_rows<true, false>(a, q, p, mb, me, out, q.n);
  else if (q.asym)
    kept_panel_rows<false, true>(a, q, p, mb, me, out, q.n);
  else
    kept_panel_rows<false, false>(a, q, p, mb, me, out, q.n);
}

// x [M, kp] float32 | bfloat16 (zeros past K), kept-panel q (group 32, int4 or int8, not MXFP4), bias [N] or
// null -> y [M, N]: the panels split over the threads, each run against every row of x
template <typename T>
inline void quant_gemm_kept(const QMatrix& q, const T* x, int64_t M, const float* bias, float* y) {
  static thread_local GemmActs tls;  // the calling thread's; the workers read it through `a`
  GemmActs& a = tls;
  quantize_gemm_acts(x, M, q.kp, gemm_offset(q), a);
  parallel_for(0, q.n / GEMM_NP, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      float* out = y + p * GEMM_NP;
      kept_rows(a, q, p, 0, M, out);
      if (bias)
        for (int64_t m = 0; m < M; ++m)
          for (int64_t c = 0; c < GEMM_NP; ++c) out[m * q.n + c] += bias[p * GEMM_NP + c];
    }
  });
}
#else
constexpr int64_t KEPT_PANEL = 0;  // no kept panels on this path (its GEMM re-lays a scalar 4 bytes at a time)
constexpr bool KEPT_INT8 = false;

template <typename T>
inline void quant_gemm_kept(const QMatrix&, const T*, int64_t, const float*, float*) {}
#endif

}  // namespace servescope_quant
