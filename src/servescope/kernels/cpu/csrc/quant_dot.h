// The decode GEMV over packed weights with integer dot products, the llama.cpp way
// (ggml's vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0): the activation rows are quantised once per
// call to int8 in blocks of 32 (one float scale per block, like Q8_0), then each weight block meets
// its activation block in int8 x int8 -> int32 dot products (simd.h's dot_u4 / dot_s8: VNNI vpdpbusd,
// AVX-VNNI, NEON sdot, or their widening fallbacks), and only the block's int32 sum is scaled in float.
// Per weight that is a fraction of an instruction instead of the float path's widen + convert + FMA
// (quant_gemv.h), which was compute-bound at 2 threads; this one is bound by the bytes it reads.
//
// Result: y[m, n] = sum over blocks b of  dw[n, b] * dx[m, b] * (sum_k u[n, k] q[m, k]  - 8 sum_k q[m, k])
// (symmetric int4; asymmetric adds m[n, b] * dx[m, b] * sum_k q[m, k]; int8 has no offset term beyond
// the -128 sum_k q[m, k] that undoes the VNNI path's unsigned weights), i.e.
// exactly the dequantised weight times the dequantised int8 activations, up to float32 rounding. The
// activations' own rounding, at most dx / 2 per element, is the only error beside the weights'.
//
// Layout (one chunk = 4W packed bytes, the bytes one vb holds, and the int32 lanes they sum into):
//  - int4: a chunk is W / 4 blocks of 16 bytes; its low nibbles (elements 0..15 of each block) and high
//    nibbles (16..31) are two vb, so the activation chunk is stored as [low halves][high halves] of the
//    same blocks; lane i belongs to block i / 4 (LPB = 4 lanes per block).
//  - int8: a chunk is 4W consecutive weights, stored in plain order; lane i covers k = 4i..4i+3 of the
//    chunk, block (c * 4W + 4i) / 32 (LPB = 8; on NEON, W = 4, a block spans two chunks).
// Only group-32 scales (every GGUF block type, int4 / int8-g32) come here; other groups take quant_gemv.h.
//
// Memory, not arithmetic, bounds it at decode sizes (benchmarks/quant_gemv_profile.py): with its weights
// hot it runs 1.5-3x faster than over a step's cold weights. So one row of x reads 4 weight rows from
// the four quarters of the thread's range (four long sequential streams the prefetchers follow, helped by
// a software prefetch), the sums stay in registers for a row's chunks, and every whole chunk is read
// with constant masks (only a row's last chunk may be partial).
#pragma once

#include "quant_gemv.h"

namespace servescope_quant {

using namespace servescope_simd;

// The weight formats of the kernels' FMT parameter: symmetric (int4 u - 8, int8 q), asymmetric (d u + m),
// MXFP4 (int4 only: the nibble's doubled e2m1 value, MXFP4_VALUES, times the halved E8M0 scale)
constexpr int FMT_SYM = 0, FMT_ASYM = 1, FMT_MX = 2;

template <bool I4>
struct Chunk {
  static constexpr int64_t BYTES = 4 * W;               // packed weight bytes per chunk
  static constexpr int64_t K = I4 ? 8 * W : 4 * W;      // weights per chunk
  static constexpr int LPB = I4 ? 4 : 8;                // int32 lanes per 32-block
  static constexpr int64_t QBYTES = I4 ? 2 * BYTES : BYTES;  // activation bytes per chunk
};

// The activation rows quantised for one call: per row m and chunk c, the int8 values (in the chunk's
// layout), and per int32 lane the block's scale dx, dx * sum(q) / LPB (asymmetric offsets) and the
// offset folded into the lane's int32 sum over its own bytes: -8 * sum(q) for symmetric int4's u - 8,
// -kS8Bias * sum(q) for int8, whose dot product adds kS8Bias * sum(q) where it runs on VNNI (simd.h).
// Per lane, so that each lane's int32 is the exact sum of its products and the float sums that
// follow see the same magnitudes as without an offset.
struct QActs {
  int64_t chunks = 0;
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> corr;
};

// One activation row's 32-block (float32 or bfloat16, widened exactly) -> its int8 values at qb, its scale
// d and the values' sum (bfloat16 rows are rounded straight to int8: no float32 copy of the rows)
template <typename T>
inline int32_t quantize_block(const T* xb, int8_t* qb, float* d) {
  const float* xf;
  alignas(64) float wide[32];
  if constexpr (std::is_same_v<T, float>) {
    xf = xb;
  } else {
    for (int i = 0; i < 32; i += W) store(wide + i, load(xb + i));
    xf = wide;
  }
  *d = absmax32(xf) / 127.f;
  return round_i8x32(xf, *d > 0.f ? 1.f / *d : 0.f, qb);
}

// Row m of the activations (x: its kp values) into a, in the chunks' layout
template <bool I4, typename T>
inline void quantize_act_row(const T* x, int64_t m, int64_t nb, int64_t nc, QActs& a, int32_t i4_off) {
  using C = Chunk<I4>;
  for (int64_t b = 0; b < nb; ++b) {
    int8_t qb[32];
    float d;
    const int32_t sum = quantize_block(x + b * 32, qb, &d);
    int64_t first;  // the block's first lane (flat over rows and chunks)
    if constexpr (I4) {
      const int64_t c = b / (W / 4);
      int8_t* dst = a.q.data() + (m * nc + c) * C::QBYTES + (b % (W / 4)) * 16;
      std::memcpy(dst, qb, 16);
      std::memcpy(dst + C::BYTES, qb + 16, 16);
      first = (m * nc + c) * W + (b % (W / 4)) * 4;
    } else {
      std::memcpy(a.q.data() + m * nc * C::QBYTES + b * 32, qb, 32);
      first = m * nc * W + b * 8;  // 8 lanes, on NEON (W = 4) over two chunks
    }
    for (int64_t l = first; l < first + C::LPB; ++l) {
      a.dx[l] = d;
      a.sx[l] = d * (float)sum / C::LPB;
    }
  }
  const int32_t off = I4 ? i4_off : kS8Bias;
  if (off == 0) return;
  // lane l of chunk l / W: bytes 4 (l % W).. of each of its halves
  for (int64_t l = m * nc * W; l < (m + 1) * nc * W; ++l) {
    const int8_t* p = a.q.data() + (l / W) * C::QBYTES + (l % W) * 4;
    int32_t s = p[0] + p[1] + p[2] + p[3];
    if constexpr (I4) s += p[C::BYTES] + p[C::BYTES + 1] + p[C::BYTES + 2] + p[C::BYTES + 3];
    a.corr[l] = -off * s;
  }
}

// x [M, kp] float32 | bfloat16 (kp a multiple of 32, zeros past K) -> a (its buffers keep their capacity
// between calls); rows in parallel (a batched decode step quantises up to a few hundred). i4_off: the
// unsigned 4-bit operand's offset (8 for symmetric int4, MXFP4_OFFSET for MXFP4's table values)
template <bool I4, typename T>
inline void quantize_acts(const T* x, int64_t M, int64_t kp, QActs& a, int32_t i4_off = 8) {
  using C = Chunk<I4>;
  const int64_t nb = kp / 32, nc = (kp + C::K - 1) / C::K;
  a.chunks = nc;
  a.q.assign(M * nc * C::QBYTES, 0);
  a.dx.assign(M * nc * W, 0.f);
  a.sx.assign(M * nc * W, 0.f);
  a.corr.assign(M * nc * W, 0);
  parallel_for(0, M, grain_for(kp), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_act_row<I4>(x + m * kp, m, nb, nc, a, i4_off);
  });
}

// One weight row's chunk c (w, sc: the row's bytes and scales): its bytes as the dot products' operands
// (lo, and hi for int4) and its block scales spread over the lanes. FULL: the chunk lies wholly inside
// the row (constant masks), else the row's last, partial chunk.
template <bool I4, int FMT, bool FULL>
inline void weight_chunk(const uint8_t* w, const void* sc, int64_t rb, int64_t nb, int64_t c, vb& lo, vb& hi,
                         vf* out) {
  using C = Chunk<I4>;
  constexpr bool ASYM = FMT == FMT_ASYM;
  constexpr int B = W / C::LPB > 0 ? W / C::LPB : 1;  // blocks per chunk (NEON int8: half a block, B unused)
  const int64_t b0 = c * C::K / 32;
  const vb raw = FULL ? loadb(w + c * C::BYTES) : loadbn(w + c * C::BYTES, rb - c * C::BYTES);
  if constexpr (FMT == FMT_MX) {
    static_assert(I4, "MXFP4 is a 4-bit format");
    lo = lut16(low_nibbles(raw), MXFP4_UNSIGNED);
    hi = lut16(high_nibbles(raw), MXFP4_UNSIGNED);
    e8m0_lanes<C::LPB>((const uint8_t*)sc + b0, FULL ? B : nb - b0, out);
    return;
  }
  if constexpr (I4) {
    lo = low_nibbles(raw);
    hi = high_nibbles(raw);
  } else {
    lo = hi = raw;  // (hi unused)
  }
  half_lanes<C::LPB, ASYM ? 2 : 1>((const uint16_t*)sc + b0 * (ASYM ? 2 : 1), FULL ? B : nb - b0, out);
}

// Pointers to one activation row's quantised chunks
struct ActRow {
  const int8_t* q;
  const float *dx, *sx;
  const int32_t* corr;
};

// tot + the chunk c's products of one weight row (lo, hi, scales sc) with activation row x
template <bool I4, int FMT>
inline vf chunk_dot(const ActRow& x, int64_t c, vb lo, vb hi, const vf* sc, vf tot) {
  using C = Chunk<I4>;
  constexpr bool ASYM = FMT == FMT_ASYM;
  const int8_t* qa = x.q + c * C::QBYTES;
  const vi init = (I4 ? !ASYM : kS8Bias != 0) ? loadi(x.corr + c * W) : zeroi();
  vi acc;
  if constexpr (I4)
    acc = dot_u4x2(init, lo, loadb(qa), hi, loadb(qa + C::BYTES));
  else
    acc = dot_s8_biased(init, lo, loadb(qa));
  tot = fmadd(to_float(acc), mul(sc[0], load(x.dx + c * W)), tot);
  if constexpr (ASYM) tot = fmadd(sc[1], load(x.sx + c * W), tot);
  return tot;
}

// acc[m][s] += chunks c0 .. c1 of activation rows m0 + m against weight rows r0 + s * rs. MR = 1 takes the
// weight rows one at a time (the fewest live registers: AVX2 has 16); more rows of x hold the NR rows'
// operands while every row of x meets them. The sums stay in locals (registers) for the whole loop.
template <bool I4, int FMT, int MR, int NR, bool FULL>
inline void qdot_chunks(const QMatrix& q, const QActs& a, int64_t m0, int64_t r0, int64_t rs, int64_t c0, int64_t c1,
                        vf (&acc)[MR][NR]) {
  using C = Chunk<I4>;
  constexpr bool ASYM = FMT == FMT_ASYM;
  constexpr int S = ASYM ? 2 : 1;
  constexpr int64_t SB = FMT == FMT_MX ? 1 : 2 * S;  // scale bytes per block
  const int64_t nb = q.kp / 32, rb = I4 ? q.kp / 2 : q.kp, nc = a.chunks;
  const uint8_t* wr[NR];
  const uint8_t* sr[NR];
  const uint8_t* scales = FMT == FMT_MX ? q.e8m0 : (const uint8_t*)q.scales;
  for (int s = 0; s < NR; ++s) wr[s] = q.w + (r0 + s * rs) * rb, sr[s] = scales + (r0 + s * rs) * nb * SB;
  ActRow x[MR];
  for (int m = 0; m < MR; ++m) {
    const int64_t at = (m0 + m) * nc;
    x[m] = {a.q.data() + at * C::QBYTES, a.dx.data() + at * W, a.sx.data() + at * W, a.corr.data() + at * W};
  }
  vf tot[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) tot[m][s] = acc[m][s];
  // Software prefetch: each weight stream 512 bytes ahead, and the scales of each stream's next row when
  // a row starts (5-8% off the step's GEMVs at 2 threads in medians of 7 interleaved runs, shared machine)
  const int64_t next = (rs == 1 ? NR : 1) * nb * SB;
  if (c0 == 0)
    for (int s = 0; s < NR; ++s) {
      __builtin_prefetch(sr[s] + next, 0, 3);
      __builtin_prefetch(sr[s] + next + 64, 0, 3);
    }
  for (int64_t c = c0; c < c1; ++c) {
    for (int s = 0; s < NR; ++s) __builtin_prefetch(wr[s] + c * C::BYTES + 512, 0, 3);
    if constexpr (MR == 1) {
      for (int s = 0; s < NR; ++s) {
        vb lo, hi;
        vf sc[S];
        weight_chunk<I4, FMT, FULL>(wr[s], sr[s], rb, nb, c, lo, hi, sc);
        tot[0][s] = chunk_dot<I4, FMT>(x[0], c, lo, hi, sc, tot[0][s]);
      }
    } else {
      vb lo[NR], hi[NR];
      vf sc[NR][S];
      for (int s = 0; s < NR; ++s) weight_chunk<I4, FMT, FULL>(wr[s], sr[s], rb, nb, c, lo[s], hi[s], sc[s]);
      for (int m = 0; m < MR; ++m)
        for (int s = 0; s < NR; ++s) tot[m][s] = chunk_dot<I4, FMT>(x[m], c, lo[s], hi[s], sc[s], tot[m][s]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) acc[m][s] = tot[m][s];
}

// y[m * ldy + r] for activation rows m0 .. m0 + MR of a against NR weight rows r = r0 + s * rs (group-32
// scales): the row's whole chunks, then its partial last one
template <bool I4, int FMT, int MR, int NR>
inline void qdot_rows(const QMatrix& q, const QActs& a, int64_t m0, int64_t r0, int64_t rs, float* y, int64_t ldy) {
  const int64_t full = (q.int4 ? q.kp / 2 : q.kp) / Chunk<I4>::BYTES;
  vf tot[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) tot[m][s] = zero();
  qdot_chunks<I4, FMT, MR, NR, true>(q, a, m0, r0, rs, 0, full, tot);
  if (full < a.chunks) qdot_chunks<I4, FMT, MR, NR, false>(q, a, m0, r0, rs, full, a.chunks, tot);
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) y[m * ldy + r0 + s * rs] = reduce_add(tot[m][s]);
}

// Rows n0 .. n1 of y for every row of x. One row of x reads 4 weight rows at a time from the four
// quarters of the range, as the float GEMV does: four long sequential streams for the prefetchers
// (4 neighbouring rows, a few cache lines each, read in turn, left them behind the loads).
// (rows mb .. me of x: a call over a slice of the quantised rows, as the fused experts' op runs each expert
// over its own rows of one quantised batch)
template <bool I4, int FMT>
inline void qdot_range(const QMatrix& q, const QActs& a, int64_t mb, int64_t me, int64_t n0, int64_t n1,
                       float* y) {
  for (int64_t m0 = mb; m0 < me; m0 += 4) {
    float* ym = y + m0 * q.n;
    int64_t r = n0;
    switch (std::min<int64_t>(4, me - m0)) {
      case 1: {
        const int64_t quarter = (n1 - n0) / 4;
        for (int64_t i = 0; i < quarter; ++i) qdot_rows<I4, FMT, 1, 4>(q, a, m0, n0 + i, quarter, ym, q.n);
        for (r = n0 + 4 * quarter; r < n1; ++r) qdot_rows<I4, FMT, 1, 1>(q, a, m0, r, 1, ym, q.n);
        break;
      }
      case 2:
        for (; r + 2 <= n1; r += 2) qdot_rows<I4, FMT, 2, 2>(q, a, m0, r, 1, ym, q.n);
        for (; r < n1; ++r) qdot_rows<I4, FMT, 2, 1>(q, a, m0, r, 1, ym, q.n);
        break;
      case 3:
        for (; r < n1; ++r) qdot_rows<I4, FMT, 3, 1>(q, a, m0, r, 1, ym, q.n);
        break;
      default:  // 4 x 2: 8 accumulators, the most that stay in registers beside the weights
        for (; r + 2 <= n1; r += 2) qdot_rows<I4, FMT, 4, 2>(q, a, m0, r, 1, ym, q.n);
        for (; r < n1; ++r) qdot_rows<I4, FMT, 4, 1>(q, a, m0, r, 1, ym, q.n);
        break;
    }
  }
}

// The weight-stationary order, for many rows of x (a batched decode step): a tile of TILED_NR weight
// rows meets TILED_MR rows of x at a time, and every row of a block of x passes over the tile while its
// bytes sit in L1, so the weights are read from memory once per block of x (the streaming order above
// reads them once per 4 rows of x). A block of x is as many rows as keep their quantised chunks within
// TILED_ACT_BYTES (L2). Per (row of x, weight row) the arithmetic is qdot_rows', the same chunks in the
// same order into the same sums, so a row's result does not depend on the order, the tile or how many
// rows share the call: both orders give the same bits.
#if defined(SERVESCOPE_ISA_AVX2)
constexpr int TILED_MR = 2, TILED_NR = 2;  // 16 vector registers
#else
constexpr int TILED_MR = 4, TILED_NR = 2;
#endif
constexpr int64_t TILED_ACT_BYTES = 1 << 20;

template <bool I4, int FMT, int NR>
inline void qdot_tiled_rows(const QMatrix& q, const QActs& a, int64_t mb, int64_t me, int64_t r, float* y) {
  int64_t m = mb;
  for (; m + TILED_MR <= me; m += TILED_MR) qdot_rows<I4, FMT, TILED_MR, NR>(q, a, m, r, 1, y + m * q.n, q.n);
  if (m < me)
    with_count<TILED_MR>(me - m, [&](auto rows) {
      qdot_rows<I4, FMT, decltype(rows)::value, NR>(q, a, m, r, 1, y + m * q.n, q.n);
    });
}

template <bool I4, int FMT>
inline void qdot_tiled_range(const QMatrix& q, const QActs& a, int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                             float* y) {
  using C = Chunk<I4>;
  const int64_t row_bytes = a.chunks * (C::QBYTES + 3 * W * 4);  // int8 values, dx, sx, corr
  const int64_t block = std::max<int64_t>(TILED_MR, TILED_ACT_BYTES / row_bytes);
  for (int64_t mb = m0; mb < m1; mb += block) {
    const int64_t me = std::min(m1, mb + block);
    int64_t r = n0;
    for (; r + TILED_NR <= n1; r += TILED_NR) qdot_tiled_rows<I4, FMT, TILED_NR>(q, a, mb, me, r, y);
    for (; r < n1; ++r) qdot_tiled_rows<I4, FMT, 1>(q, a, mb, me, r, y);
  }
}

// Which kernel runs: Auto picks by rows (QDOT_TILED_ROWS here, QDOT_AMX_ROWS_* in quant_amx.h,
// QDOT_AMX_BF16_ROWS_* and QGEMM_ROWS_* in quant_amx_bf16.h); the others force one (the tests and benchmarks/quant_rows.py,
// which measured the crossovers)
enum class QOrder : int64_t { Auto = 0, Stream = 1, Tiled = 2, Amx = 3, AmxBf16 = 4, Gemm = 5 };
// From this many rows of x on, the weight-stationary order (docs/BENCHMARKS.md, issue 35 section: it is
// ahead from 2 rows on the Xeon; at 1 row the streaming order's four quarter streams win)
constexpr int64_t QDOT_TILED_ROWS = 2;

template <bool I4, int FMT>
inline void qdot_any_range(const QMatrix& q, const QActs& a, int64_t mb, int64_t me, int64_t n0, int64_t n1,
                           float* y, bool tiled) {
  if (tiled)
    qdot_tiled_range<I4, FMT>(q, a, mb, me, n0, n1, y);
  else
    qdot_range<I4, FMT>(q, a, mb, me, n0, n1, y);
}

// x [M, kp] float32 | bfloat16 (zeros past K), group-32 packed q, bias [N] or null -> y [M, N]
template <typename T>
inline void quant_dot_rows(const QMatrix& q, const T* x, int64_t M, const float* bias, float* y,
                           QOrder order = QOrder::Auto) {
  static thread_local QActs tls;  // the calling thread's; the workers below read it through `a`
  QActs& a = tls;
  if (q.int4)
    quantize_acts<true>(x, M, q.kp, a, q.mx() ? MXFP4_OFFSET : 8);
  else
    quantize_acts<false>(x, M, q.kp, a);
  const bool tiled = order == QOrder::Tiled || (order == QOrder::Auto && M >= QDOT_TILED_ROWS);
  parallel_for(0, q.n, 32, [&](int64_t n0, int64_t n1) {
    if (q.mx())
      qdot_any_range<true, FMT_MX>(q, a, 0, M, n0, n1, y, tiled);
    else if (q.int4 && q.asym)
      qdot_any_range<true, FMT_ASYM>(q, a, 0, M, n0, n1, y, tiled);
    else if (q.int4)
      qdot_any_range<true, FMT_SYM>(q, a, 0, M, n0, n1, y, tiled);
    else if (q.asym)
      qdot_any_range<false, FMT_ASYM>(q, a, 0, M, n0, n1, y, tiled);
    else
      qdot_any_range<false, FMT_SYM>(q, a, 0, M, n0, n1, y, tiled);
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * q.n + n] += bias[n];
  });
}

// The GEMV of packed weights: integer dot products for group-32 scales, float32 activations (quant_gemv.h)
// for the larger groups
inline void quant_matvec(const QMatrix& q, const float* x, int64_t M, const float* bias, float* y,
                         QOrder order = QOrder::Auto) {
  if (q.group == 32)
    quant_dot_rows(q, x, M, bias, y, order);
  else
    quant_gemv_rows(q, x, M, bias, y);
}

}  // namespace servescope_quant
