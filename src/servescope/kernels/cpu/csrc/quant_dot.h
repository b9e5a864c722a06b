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

// x [M, kp] float32 (kp a multiple of 32, zeros past K) -> a (its buffers keep their capacity between calls)
template <bool I4>
inline void quantize_acts(const float* x, int64_t M, int64_t kp, QActs& a) {
  using C = Chunk<I4>;
  const int64_t nb = kp / 32, nc = (kp + C::K - 1) / C::K;
  a.chunks = nc;
  a.q.assign(M * nc * C::QBYTES, 0);
  a.dx.assign(M * nc * W, 0.f);
  a.sx.assign(M * nc * W, 0.f);
  a.corr.assign(M * nc * W, 0);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < nb; ++b) {
      const float* xb = x + m * kp + b * 32;
      const float d = absmax32(xb) / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int8_t qb[32];
      const int32_t sum = round_i8x32(xb, id, qb);
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
  constexpr int32_t off = I4 ? 8 : kS8Bias;
  if (off == 0) return;
  for (int64_t l = 0; l < M * nc * W; ++l) {  // lane l of chunk l / W: bytes 4 (l % W).. of each of its halves
    const int8_t* p = a.q.data() + (l / W) * C::QBYTES + (l % W) * 4;
    int32_t s = p[0] + p[1] + p[2] + p[3];
    if constexpr (I4) s += p[C::BYTES] + p[C::BYTES + 1] + p[C::BYTES + 2] + p[C::BYTES + 3];
    a.corr[l] = -off * s;
  }
}

// One weight row's chunk c (w, sc: the row's bytes and scales): its bytes as the dot products' operands
// (lo, and hi for int4) and its block scales spread over the lanes. FULL: the chunk lies wholly inside
// the row (constant masks), else the row's last, partial chunk.
template <bool I4, bool ASYM, bool FULL>
inline void weight_chunk(const uint8_t* w, const uint16_t* sc, int64_t rb, int64_t nb, int64_t c, vb& lo, vb& hi,
                         vf* out) {
  using C = Chunk<I4>;
  constexpr int B = W / C::LPB > 0 ? W / C::LPB : 1;  // blocks per chunk (NEON int8: half a block, B unused)
  const int64_t b0 = c * C::K / 32;
  const vb raw = FULL ? loadb(w + c * C::BYTES) : loadbn(w + c * C::BYTES, rb - c * C::BYTES);
  if constexpr (I4) {
    lo = low_nibbles(raw);
    hi = high_nibbles(raw);
  } else {
    lo = hi = raw;  // (hi unused)
  }
  half_lanes<C::LPB, ASYM ? 2 : 1>(sc + b0 * (ASYM ? 2 : 1), FULL ? B : nb - b0, out);
}

// Pointers to one activation row's quantised chunks
struct ActRow {
  const int8_t* q;
  const float *dx, *sx;
  const int32_t* corr;
};

// tot + the chunk c's products of one weight row (lo, hi, scales sc) with activation row x
template <bool I4, bool ASYM>
inline vf chunk_dot(const ActRow& x, int64_t c, vb lo, vb hi, const vf* sc, vf tot) {
  using C = Chunk<I4>;
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
template <bool I4, bool ASYM, int MR, int NR, bool FULL>
inline void qdot_chunks(const QMatrix& q, const QActs& a, int64_t m0, int64_t r0, int64_t rs, int64_t c0, int64_t c1,
                        vf (&acc)[MR][NR]) {
  using C = Chunk<I4>;
  constexpr int S = ASYM ? 2 : 1;
  const int64_t nb = q.kp / 32, rb = I4 ? q.kp / 2 : q.kp, nc = a.chunks;
  const uint8_t* wr[NR];
  const uint16_t* sr[NR];
  for (int s = 0; s < NR; ++s) wr[s] = q.w + (r0 + s * rs) * rb, sr[s] = q.scales + (r0 + s * rs) * nb * S;
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
  const int64_t next = (rs == 1 ? NR : 1) * nb * S;
  if (c0 == 0)
    for (int s = 0; s < NR; ++s) {
      __builtin_prefetch(sr[s] + next, 0, 3);
      __builtin_prefetch(sr[s] + next + 32, 0, 3);
    }
  for (int64_t c = c0; c < c1; ++c) {
    for (int s = 0; s < NR; ++s) __builtin_prefetch(wr[s] + c * C::BYTES + 512, 0, 3);
    if constexpr (MR == 1) {
      for (int s = 0; s < NR; ++s) {
        vb lo, hi;
        vf sc[S];
        weight_chunk<I4, ASYM, FULL>(wr[s], sr[s], rb, nb, c, lo, hi, sc);
        tot[0][s] = chunk_dot<I4, ASYM>(x[0], c, lo, hi, sc, tot[0][s]);
      }
    } else {
      vb lo[NR], hi[NR];
      vf sc[NR][S];
      for (int s = 0; s < NR; ++s) weight_chunk<I4, ASYM, FULL>(wr[s], sr[s], rb, nb, c, lo[s], hi[s], sc[s]);
      for (int m = 0; m < MR; ++m)
        for (int s = 0; s < NR; ++s) tot[m][s] = chunk_dot<I4, ASYM>(x[m], c, lo[s], hi[s], sc[s], tot[m][s]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) acc[m][s] = tot[m][s];
}

// y[m * ldy + r] for activation rows m0 .. m0 + MR of a against NR weight rows r = r0 + s * rs (group-32
// scales): the row's whole chunks, then its partial last one
template <bool I4, bool ASYM, int MR, int NR>
inline void qdot_rows(const QMatrix& q, const QActs& a, int64_t m0, int64_t r0, int64_t rs, float* y, int64_t ldy) {
  const int64_t full = (q.int4 ? q.kp / 2 : q.kp) / Chunk<I4>::BYTES;
  vf tot[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) tot[m][s] = zero();
  qdot_chunks<I4, ASYM, MR, NR, true>(q, a, m0, r0, rs, 0, full, tot);
  if (full < a.chunks) qdot_chunks<I4, ASYM, MR, NR, false>(q, a, m0, r0, rs, full, a.chunks, tot);
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) y[m * ldy + r0 + s * rs] = reduce_add(tot[m][s]);
}

// Rows n0 .. n1 of y for every row of x. One row of x reads 4 weight rows at a time from the four
// quarters of the range, as the float GEMV does: four long sequential streams for the prefetchers
// (4 neighbouring rows, a few cache lines each, read in turn, left them behind the loads).
template <bool I4, bool ASYM>
inline void qdot_range(const QMatrix& q, const QActs& a, int64_t M, int64_t n0, int64_t n1, float* y) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    float* ym = y + m0 * q.n;
    int64_t r = n0;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: {
        const int64_t quarter = (n1 - n0) / 4;
        for (int64_t i = 0; i < quarter; ++i) qdot_rows<I4, ASYM, 1, 4>(q, a, m0, n0 + i, quarter, ym, q.n);
        for (r = n0 + 4 * quarter; r < n1; ++r) qdot_rows<I4, ASYM, 1, 1>(q, a, m0, r, 1, ym, q.n);
        break;
      }
      case 2:
        for (; r + 2 <= n1; r += 2) qdot_rows<I4, ASYM, 2, 2>(q, a, m0, r, 1, ym, q.n);
        for (; r < n1; ++r) qdot_rows<I4, ASYM, 2, 1>(q, a, m0, r, 1, ym, q.n);
        break;
      case 3:
        for (; r < n1; ++r) qdot_rows<I4, ASYM, 3, 1>(q, a, m0, r, 1, ym, q.n);
        break;
      default:  // 4 x 2: 8 accumulators, the most that stay in registers beside the weights
        for (; r + 2 <= n1; r += 2) qdot_rows<I4, ASYM, 4, 2>(q, a, m0, r, 1, ym, q.n);
        for (; r < n1; ++r) qdot_rows<I4, ASYM, 4, 1>(q, a, m0, r, 1, ym, q.n);
        break;
    }
  }
}

// x [M, kp] float32 (zeros past K), group-32 packed q, bias [N] or null -> y [M, N]
inline void quant_dot_rows(const QMatrix& q, const float* x, int64_t M, const float* bias, float* y) {
  static thread_local QActs tls;  // the calling thread's; the workers below read it through `a`
  QActs& a = tls;
  if (q.int4)
    quantize_acts<true>(x, M, q.kp, a);
  else
    quantize_acts<false>(x, M, q.kp, a);
  parallel_for(0, q.n, 32, [&](int64_t n0, int64_t n1) {
    if (q.int4 && q.asym)
      qdot_range<true, true>(q, a, M, n0, n1, y);
    else if (q.int4)
      qdot_range<true, false>(q, a, M, n0, n1, y);
    else if (q.asym)
      qdot_range<false, true>(q, a, M, n0, n1, y);
    else
      qdot_range<false, false>(q, a, M, n0, n1, y);
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * q.n + n] += bias[n];
  });
}

// The decode GEMV of packed weights: integer dot products for group-32 scales, float activations
// (quant_gemv.h) for the larger groups
inline void quant_matvec(const QMatrix& q, const float* x, int64_t M, const float* bias, float* y) {
  if (q.group == 32)
    quant_dot_rows(q, x, M, bias, y);
  else
    quant_gemv_rows(q, x, M, bias, y);
}

}  // namespace servescope_quant
