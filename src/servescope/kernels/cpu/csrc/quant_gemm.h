// The prefill GEMM over packed group-32 weights with integer dot products: the same arithmetic as the
// decode GEMV of quant_dot.h (activations rounded to int8 per 32-block, one float scale each; a weight
// block meets an activation block in int8 x int8 -> int32 sums; only the block's int32 is scaled in
// float), laid out for many rows of x instead of a few. llama.cpp runs its Q4_0 / Q8_0 prefill the same
// way (activations as Q8_0); before this, our prefill dequantised the weights to float32 and ran a
// float32 GEMM, 0.82x llama-bench pp512 on the Xeon (docs/BENCHMARKS.md, issue 15).
//
// Result, for every (m, n): y = sum over blocks b of dw[n,b] dx[m,b] (sum_k u[n,k] q[m,k] + c[m,b])
// (+ mw[n,b] dx[m,b] sum_k q[m,k] when asymmetric), c = -8 sum q for symmetric int4's u - 8 and
// -kS8Bias sum q for int8 on VNNI (simd.h's dot_s8_biased): the dequantised weight times the
// dequantised int8 activations, as the GEMV computes it, up to float32 summation order.
//
// Layout: the vector runs along N, not K. A panel is NP = NR * W output columns; it is re-laid once per
// call (per thread, into a buffer that stays in L1/L2) so that for each k-quad (4 consecutive k) the
// NR vectors hold, lane i, the 4 weight bytes of column i: vpdpbusd (simd.h's dot_u4 / dot_s8_biased)
// of such a vector with the 4 activation bytes of one row broadcast to every lane adds 4 products to
// each column's int32 sum. A tile of MR rows x NP columns keeps MR * NR int32 sums for the block and
// MR * NR float totals in registers; per block the panel's scales are one float vector per NR. The
// re-layout costs O(N K) per call against the GEMM's O(M N K), about as much as 16 rows' products at the 1B
// shape: where the engine can, it lays the weights out in these panels once at load instead (quant_kept.h),
// and this per-call form serves the weights it cannot (the experts, MXFP4, rows not whole panels).
#pragma once

#include "quant_dot.h"

namespace servescope_quant {

using namespace servescope_simd;

// Register tiles per ISA: AVX-512 and NEON have 32 vector registers, AVX2 16 (the scalar path's
// "registers" are arrays; the tile is only its loop shape)
#if defined(SERVESCOPE_ISA_AVX2)
constexpr int GEMM_MR = 2, GEMM_NR = 2;
#else
constexpr int GEMM_MR = 4, GEMM_NR = 2;
#endif
constexpr int64_t GEMM_NP = GEMM_NR * W;

// The activation rows for the GEMM: int8 [M, kp] in plain order, per (row, block) the scale dx, the
// int32 start c of the block's sum and dx * sum(q) (the asymmetric offset's factor)
struct GemmActs {
  int64_t nb = 0;
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> corr;
};

// x [M, kp] float32 | bfloat16 (zeros past K) -> a; off: 8 (symmetric int4), kS8Bias (int8) or 0 (asymmetric
// int4). The rounding is quant_dot.h's (quantize_block), so every kernel sees the same int8 rows.
template <typename T>
inline void quantize_gemm_acts(const T* x, int64_t M, int64_t kp, int32_t off, GemmActs& a) {
  a.nb = kp / QBLOCK;
  a.q.resize(M * kp);
  a.dx.resize(M * a.nb);
  a.sx.resize(M * a.nb);
  a.corr.resize(M * a.nb);
  parallel_for(0, M, grain_for(kp), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t b = 0; b < a.nb; ++b) {
        float d;
        const int32_t sum = quantize_block(x + m * kp + b * QBLOCK, a.q.data() + m * kp + b * QBLOCK, &d);
        a.dx[m * a.nb + b] = d;
        a.sx[m * a.nb + b] = d * (float)sum;
        a.corr[m * a.nb + b] = -off * sum;
      }
  });
}

#if defined(SERVESCOPE_ISA_AVX512) || defined(SERVESCOPE_ISA_AVX2)
#define SERVESCOPE_VECTOR_PANELS 1
#if defined(SERVESCOPE_ISA_AVX512)
// r[c] lane i <- r[i] lane c: 16 rows of 16 dwords transposed in registers (unpack by 32 and 64 bits within
// the 128-bit lanes, then two rounds of 128-bit lane shuffles)
inline void transpose_dwords(__m512i (&r)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);  // per lane: r[i][0] r[i+1][0] r[i][1] r[i+1][1]
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // u[g + e], lane l: rows g .. g + 3 at dword 4 l + e
    u[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0x88), v1 = _mm512_shuffle_i32x4(u[e], u[4 + e], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + e], u[12 + e], 0xDD);
    r[e] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[8 + e] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[12 + e] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

// row i's float16 scales of blocks b0 .. b0 + n (interleaved (d, m) pairs when asym) as floats: d[i], m[i]
inline void load_scales(const uint16_t* h, int64_t n, bool asym, __m512i& d, __m512i& m) {
  alignas(64) static constexpr int16_t kSplit[32] = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                                     1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
  const __m512i raw = loadbn(h, n * (asym ? 4 : 2));
  const __m512i hs = asym ? _mm512_permutexvar_epi16(_mm512_load_si512(kSplit), raw) : raw;
  d = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_castsi512_si256(hs)));
  if (asym) m = _mm512_castps_si512(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(hs, 1)));
}
#else
// r[c] lane i <- r[i] lane c: 8 rows of 8 dwords (unpack by 32 and 64 bits within the 128-bit lanes, then
// one round of lane permutes)
inline void transpose_dwords(__m256i (&r)[8]) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 8; g += 4) {  // u[g + e], lane l: rows g .. g + 3 at dword 4 l + e
    u[g] = _mm256_unpacklo_epi64(t[g], t[g + 2]);
    u[g + 1] = _mm256_unpackhi_epi64(t[g], t[g + 2]);
    u[g + 2] = _mm256_unpacklo_epi64(t[g + 1], t[g + 3]);
    u[g + 3] = _mm256_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x20);
    r[4 + e] = _mm256_permute2x128_si256(u[e], u[4 + e], 0x31);
  }
}

inline void load_scales(const uint16_t* h, int64_t n, bool asym, __m256i& d, __m256i& m) {
  if (!asym) {
    alignas(16) uint16_t t[8] = {};
    std::memcpy(t, h, n * 2);
    d = _mm256_castps_si256(_mm256_cvtph_ps(_mm_load_si128((const __m128i*)t)));
    return;
  }
  alignas(32) uint16_t t[16] = {}, dm[16];
  std::memcpy(t, h, n * 4);
  for (int i = 0; i < 8; ++i) dm[i] = t[2 * i], dm[8 + i] = t[2 * i + 1];
  d = _mm256_castps_si256(_mm256_cvtph_ps(_mm_load_si128((const __m128i*)dm)));
  m = _mm256_castps_si256(_mm256_cvtph_ps(_mm_load_si128((const __m128i*)(dm + 8))));
}
#endif

// build_panel's scales for the W columns of vector s: W blocks of each of the W rows at a time, transposed
inline void build_panel_scales(const QMatrix& q, int64_t n0, int64_t s, float* pd, float* pm) {
  const int64_t nb = q.kp / QBLOCK;
  if (q.mx()) {
    for (int64_t c = 0; c < W; ++c)
      for (int64_t b = 0; b < nb; ++b) pd[b * GEMM_NP + s * W + c] = e8m0_half(q.e8m0[(n0 + s * W + c) * nb + b]);
    return;
  }
  const int64_t sc = q.asym ? 2 : 1;
  for (int64_t b0 = 0; b0 < nb; b0 += W) {
    const int64_t n = std::min<int64_t>(W, nb - b0);
    vb dm[2][W] = {};
    for (int i = 0; i < W; ++i) load_scales(q.scales + ((n0 + s * W + i) * nb + b0) * sc, n, q.asym, dm[0][i], dm[1][i]);
    for (int t = 0; t < sc; ++t) {
      transpose_dwords(dm[t]);
      float* out = t ? pm : pd;
      for (int64_t c = 0; c < n; ++c) storeb(out + (b0 + c) * GEMM_NP + s * W, dm[t][c]);
    }
  }
}

// build_panel's bytes for a whole panel (all NP columns present): 4W bytes of each of W rows at a time (one
// vector each: int4 W / 4 blocks, int8 W / 8), transposed so that dword c of every row lands in one vector: one
// pass over the rows' bytes in registers where the scalar re-layout moves 4 bytes at a time. The panel's vectors
// s = 0 .. NR - 1 of a chunk are built together, so that its quads' cache lines are written whole, in order.
// Then the scales, the same way.
inline void build_panel_vector(const QMatrix& q, int64_t n0, int8_t* panel, float* pd, float* pm) {
  constexpr int64_t CHUNK = 4 * W;
  const int64_t nb = q.kp / QBLOCK, rb = q.row_bytes(), block_bytes = q.int4 ? 16 : 32, per = CHUNK / block_bytes;
  const int8_t* table = q.mx() ? MXFP4_UNSIGNED : nullptr;
  // W row streams at a stride (and the scales, a separate array) wait on memory unless the panel's reads were
  // started earlier: each panel prefetches the next one's weights and scales
  const bool next = n0 + 2 * GEMM_NP <= q.n;
  if (next && !q.mx()) {
    const int64_t scale_bytes = nb * (q.asym ? 4 : 2);
    const uint8_t* ns = (const uint8_t*)(q.scales) + (n0 + GEMM_NP) * scale_bytes;
    for (int64_t o = 0; o < GEMM_NP * scale_bytes; o += 64) _mm_prefetch((const char*)(ns + o), _MM_HINT_T1);
  }
  vb r[W];
  // dword c of the chunk's rows (r[c] after the transpose) to its quad of the panel: a loop the compiler unrolls
  // for whole chunks, so that r stays in registers (a runtime index would put it on the stack)
  auto put = [&](int64_t b0, int64_t s, int64_t c) {
    const int64_t quad = q.int4 ? (b0 + c / 4) * 8 + c % 4 : b0 * 8 + c;  // int4: + 4 for the high nibbles
    int8_t* p = panel + (quad * GEMM_NP + s * W) * 4;
    if (!q.int4) return storeb(p, r[c]);
    const vb lo = low_nibbles(r[c]), hi = high_nibbles(r[c]);
    storeb(p, table ? lut16(lo, table) : lo);
    storeb(p + 4 * GEMM_NP * 4, table ? lut16(hi, table) : hi);
  };
  for (int64_t b0 = 0; b0 < nb; b0 += per) {
    const int64_t bytes = std::min(per, nb - b0) * block_bytes;
    for (int64_t s = 0; s < GEMM_NR; ++s) {
      const uint8_t* w = q.w + (n0 + s * W) * rb + b0 * block_bytes;
      for (int i = 0; i < W; ++i) r[i] = loadbn(w + i * rb, bytes);
      if (next)  // the next panel's bytes into L2 while this one is built and multiplied
        for (int i = 0; i < W; ++i) _mm_prefetch((const char*)(w + (GEMM_NP + i) * rb), _MM_HINT_T1);
      transpose_dwords(r);
      if (bytes == CHUNK) {
#pragma GCC unroll 16
        for (int64_t c = 0; c < W; ++c) put(b0, s, c);
      } else {
        for (int64_t c = 0; c < bytes / 4; ++c) put(b0, s, c);
      }
    }
  }
  for (int64_t s = 0; s < GEMM_NR; ++s) build_panel_scales(q, n0, s, pd, pm);
}
#endif

// Columns n0 .. n0 + NP of q re-laid for the tile: bytes [kp / 4][NP][4] (int4 as its 0..15 values, MXFP4 as
// MXFP4_UNSIGNED's,
// int8 as stored) and float scales [nb][NP] (d, then m when asymmetric); columns past N are zeros.
inline void build_panel(const QMatrix& q, int64_t n0, int8_t* panel, float* pd, float* pm) {
  const int64_t nb = q.kp / QBLOCK, rb = q.row_bytes(), sc = q.asym ? 2 : 1, quads = q.kp / 4;
  const int64_t cols = std::min<int64_t>(GEMM_NP, q.n - n0);
#if SERVESCOPE_VECTOR_PANELS
  if (cols == GEMM_NP) return build_panel_vector(q, n0, panel, pd, pm);
#endif
  for (int64_t c = 0; c < GEMM_NP; ++c) {
    if (c >= cols) {
      for (int64_t j = 0; j < quads; ++j) std::memset(panel + (j * GEMM_NP + c) * 4, 0, 4);
      for (int64_t b = 0; b < nb; ++b) pd[b * GEMM_NP + c] = pm[b * GEMM_NP + c] = 0.f;
      continue;
    }
    const uint8_t* w = q.w + (n0 + c) * rb;
    const uint16_t* s = q.mx() ? nullptr : q.scales + (n0 + c) * nb * sc;
    for (int64_t b = 0; b < nb; ++b) {
      if (q.int4)  // the packed quad pairs, unpacked below: byte i holds element i and i + 16
        for (int j = 0; j < 4; ++j) std::memcpy(panel + ((b * 8 + j) * GEMM_NP + c) * 4, w + b * 16 + 4 * j, 4);
      else
        for (int j = 0; j < 8; ++j) std::memcpy(panel + ((b * 8 + j) * GEMM_NP + c) * 4, w + b * QBLOCK + 4 * j, 4);
      pd[b * GEMM_NP + c] = q.mx() ? e8m0_half(q.e8m0[(n0 + c) * nb + b]) : half_to_float(s[b * sc]);
      pm[b * GEMM_NP + c] = q.asym ? half_to_float(s[b * sc + 1]) : 0.f;
    }
  }
  if (q.int4)  // quads j < 4 of each block hold both nibbles: the high ones are quad j + 4 (in vectors)
    for (int64_t b = 0; b < nb; ++b)
      for (int j = 0; j < 4; ++j)
        for (int64_t v = 0; v < GEMM_NP * 4; v += 4 * W) {
          int8_t* p = panel + (b * 8 + j) * GEMM_NP * 4 + v;
          const vb raw = loadb(p);
          // (MXFP4: the nibbles' table values plus MXFP4_OFFSET, the activations' offset)
          storeb(p + 4 * GEMM_NP * 4, q.mx() ? lut16(high_nibbles(raw), MXFP4_UNSIGNED) : high_nibbles(raw));
          storeb(p, q.mx() ? lut16(low_nibbles(raw), MXFP4_UNSIGNED) : low_nibbles(raw));
        }
}

// The pieces of a tile of MR rows x NR column vectors that every layout shares (gemm_tile here, quant_kept.h's
// kept_tile): the block's int32 sums start at the row's correction; the block's sums, rescaled, join the float
// totals (per column the block's scale dv, and offset mv when asymmetric, times the row's dx / sx)
template <bool I4, bool ASYM, int MR, int NR>
inline void tile_block_start(const GemmActs& a, int64_t m0, int64_t b, vi (&acc)[MR][NR]) {
  for (int m = 0; m < MR; ++m) {
    const vi c = (I4 ? !ASYM : kS8Bias != 0) ? seti(a.corr[(m0 + m) * a.nb + b]) : zeroi();
    for (int s = 0; s < NR; ++s) acc[m][s] = c;
  }
}

template <bool ASYM, int MR, int NR>
inline void tile_block_end(const GemmActs& a, int64_t m0, int64_t b, const vi (&acc)[MR][NR], const vf* dv,
                           const vf* mv, vf (&tot)[MR][NR]) {
  for (int m = 0; m < MR; ++m) {
    const vf dx = set1(a.dx[(m0 + m) * a.nb + b]);
    for (int s = 0; s < NR; ++s) tot[m][s] = fmadd(to_float(acc[m][s]), mul(dv[s], dx), tot[m][s]);
    if constexpr (ASYM) {
      const vf sx = set1(a.sx[(m0 + m) * a.nb + b]);
      for (int s = 0; s < NR; ++s) tot[m][s] = fmadd(mv[s], sx, tot[m][s]);
    }
  }
}

// the activations' offset for q's format (quantize_gemm_acts' off)
inline int32_t gemm_offset(const QMatrix& q) { return q.mx() ? MXFP4_OFFSET : q.int4 ? (q.asym ? 0 : 8) : kS8Bias; }

// out[m * ldo + c] for rows m0 .. m0 + MR of a against the panel's NP columns
template <bool I4, bool ASYM, int MR>
inline void gemm_tile(const GemmActs& a, int64_t kp, int64_t m0, const int8_t* panel, const float* pd,
                      const float* pm, float* out, int64_t ldo) {
  constexpr int NR = GEMM_NR;
  const int64_t nb = a.nb;
  const int8_t* xq[MR];
  for (int m = 0; m < MR; ++m) xq[m] = a.q.data() + (m0 + m) * kp;
  vf tot[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) tot[m][s] = zero();
  for (int64_t b = 0; b < nb; ++b) {
    vi acc[MR][NR];
    tile_block_start<I4, ASYM>(a, m0, b, acc);
    const int8_t* pb = panel + b * 8 * GEMM_NP * 4;
    for (int j = 0; j < 8; ++j) {
      vb w[NR];
      for (int s = 0; s < NR; ++s) w[s] = loadb(pb + (j * GEMM_NP + s * W) * 4);
      for (int m = 0; m < MR; ++m) {
        const vb x4 = bcast4(xq[m] + b * QBLOCK + 4 * j);
        for (int s = 0; s < NR; ++s) acc[m][s] = I4 ? dot_u4(acc[m][s], w[s], x4) : dot_s8_biased(acc[m][s], w[s], x4);
      }
    }
    vf dv[NR], mv[NR];
    for (int s = 0; s < NR; ++s) {
      dv[s] = load(pd + b * GEMM_NP + s * W);
      if constexpr (ASYM) mv[s] = load(pm + b * GEMM_NP + s * W);
    }
    tile_block_end<ASYM>(a, m0, b, acc, dv, mv, tot);
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) store(out + m * ldo + s * W, tot[m][s]);
}

template <bool I4, bool ASYM>
inline void gemm_panel_rows(const GemmActs& a, int64_t M, int64_t kp, const int8_t* panel, const float* pd,
                            const float* pm, float* out, int64_t ldo) {
  int64_t m = 0;
  for (; m + GEMM_MR <= M; m += GEMM_MR) gemm_tile<I4, ASYM, GEMM_MR>(a, kp, m, panel, pd, pm, out + m * ldo, ldo);
  for (; m < M; ++m) gemm_tile<I4, ASYM, 1>(a, kp, m, panel, pd, pm, out + m * ldo, ldo);
}

// x [M, kp] float32 | bfloat16 (zeros past K), group-32 packed q, bias [N] or null -> y [M, N] float32. The
// panels of NP columns are split over the threads; each thread re-lays its panel, then runs every row of x
// over it. A partial last panel goes through a scratch tile so nothing past column N is written.
template <typename T>
inline void quant_gemm_rows(const QMatrix& q, const T* x, int64_t M, const float* bias, float* y) {
  static thread_local GemmActs tls;  // the calling thread's; the workers read it through `a`
  GemmActs& a = tls;
  quantize_gemm_acts(x, M, q.kp, gemm_offset(q), a);
  const int64_t panels = (q.n + GEMM_NP - 1) / GEMM_NP, nb = a.nb;
  parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    std::vector<int8_t> panel(q.kp * GEMM_NP);
    std::vector<float> pd(nb * GEMM_NP), pm(nb * GEMM_NP), part;
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * GEMM_NP, cols = std::min<int64_t>(GEMM_NP, q.n - n0);
      build_panel(q, n0, panel.data(), pd.data(), pm.data());
      float* out = y + n0;
      int64_t ldo = q.n;
      if (cols < GEMM_NP) part.assign(M * GEMM_NP, 0.f), out = part.data(), ldo = GEMM_NP;
      if (q.int4 && q.asym)
        gemm_panel_rows<true, true>(a, M, q.kp, panel.data(), pd.data(), pm.data(), out, ldo);
      else if (q.int4)
        gemm_panel_rows<true, false>(a, M, q.kp, panel.data(), pd.data(), pm.data(), out, ldo);
      else if (q.asym)
        gemm_panel_rows<false, true>(a, M, q.kp, panel.data(), pd.data(), pm.data(), out, ldo);
      else
        gemm_panel_rows<false, false>(a, M, q.kp, panel.data(), pd.data(), pm.data(), out, ldo);
      if (cols == GEMM_NP && !bias) continue;
      for (int64_t m = 0; m < M; ++m)
        for (int64_t c = 0; c < cols; ++c) {
          float& v = y[m * q.n + n0 + c];
          if (cols < GEMM_NP) v = part[m * GEMM_NP + c];
          if (bias) v += bias[n0 + c];
        }
    }
  });
}

}  // namespace servescope_quant
