// The decode GEMV over packed weights with integer dot products, the llama.cpp way
// (ggml's vec_dot_q4_0_q8_0 / q4_1_q8_1 / q8_0_q8_0): the activation rows are quantised once per
// call to int8 in blocks of 32 (one float scale per block, like Q8_0), then each weight block meets
// its activation block in int8 x int8 -> int32 dot products (simd.h's dot_u4 / dot_s8: VNNI vpdpbusd,
// AVX-VNNI, NEON sdot, or their widening fallbacks), and only the block's int32 sum is scaled in float.
// Per weight that is a fraction of an instruction instead of the float path's widen + convert + FMA
// (quant_gemv.h), which was compute-bound at 2 threads; this one is bound by the bytes it reads.
//
// Result: y[m, n] = sum over blocks b of  dw[n, b] * dx[m, b] * (sum_k u[n, k] q[m, k]  - 8 sum_k q[m, k])
// (symmetric int4; asymmetric adds m[n, b] * dx[m, b] * sum_k q[m, k]; int8 has no offset term), i.e.
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
// layout), and per lane the block's scale dx, dx * sum(q) / LPB (asymmetric offsets) and, in each block's
// first lane, -8 * sum(q) (symmetric int4's offset, folded into the int32 sum).
struct QActs {
  int64_t chunks = 0;
  std::vector<int8_t> q;
  std::vector<float> dx, sx;
  std::vector<int32_t> corr;
};

// x [M, kp] float32 (kp a multiple of 32, zeros past K) -> a
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
      float amax = 0.f;
      for (int k = 0; k < 32; ++k) amax = std::max(amax, std::abs(xb[k]));
      const float d = amax / 127.f, id = d > 0.f ? 1.f / d : 0.f;
      int32_t sum = 0;
      int8_t qb[32];
      for (int k = 0; k < 32; ++k) {
        qb[k] = (int8_t)std::max(-127L, std::min(127L, std::lrint(xb[k] * id)));
        sum += qb[k];
      }
      int64_t c = 0, lane0 = 0;  // the block's chunk and first lane (int4)
      int8_t* dst;
      if constexpr (I4) {
        c = b / (W / 4), lane0 = (b % (W / 4)) * 4;
        dst = a.q.data() + (m * nc + c) * C::QBYTES + (b % (W / 4)) * 16;
        std::memcpy(dst, qb, 16);
        std::memcpy(dst + C::BYTES, qb + 16, 16);
      } else {
        dst = a.q.data() + m * nc * C::QBYTES + b * 32;
        std::memcpy(dst, qb, 32);
      }
      for (int64_t l = 0; l < 8; ++l) {  // the block's lanes: 4 (int4) or 8 (int8, maybe over two chunks)
        const int64_t flat = I4 ? (m * nc + c) * W + lane0 + l : m * nc * W + b * 8 + l;
        if (I4 && l >= 4) break;
        a.dx[flat] = d;
        a.sx[flat] = d * (float)sum / C::LPB;
        if (l == 0) a.corr[flat] = -8 * sum;
      }
    }
}

// y[m * ldy + r] for activation rows m0 .. m0 + MR of a against NR weight rows r0.. (group-32 scales)
template <bool I4, bool ASYM, int MR, int NR>
inline void qdot_rows(const QMatrix& q, const QActs& a, int64_t m0, int64_t r0, float* y, int64_t ldy) {
  using C = Chunk<I4>;
  constexpr int S = ASYM ? 2 : 1;
  const int64_t nb = q.kp / 32, rb = q.row_bytes(), nc = a.chunks;
  vf tot[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) tot[m][s] = zero();
  for (int64_t c = 0; c < nc; ++c) {
    const int64_t b0 = c * C::K / 32, left = rb - c * C::BYTES;
    vb lo[NR], hi[NR];
    vf sc[NR][S];
    for (int s = 0; s < NR; ++s) {
      const uint8_t* wp = q.w + (r0 + s) * rb + c * C::BYTES;
      const vb raw = left >= C::BYTES ? loadb(wp) : loadbn(wp, left);
      if constexpr (I4) {
        lo[s] = low_nibbles(raw);
        hi[s] = high_nibbles(raw);
      } else {
        lo[s] = raw;
      }
      half_lanes<C::LPB, S>(q.scales + ((r0 + s) * nb + b0) * S, nb - b0, sc[s]);
    }
    for (int m = 0; m < MR; ++m) {
      const int64_t at = (m0 + m) * nc + c;
      const int8_t* qa = a.q.data() + at * C::QBYTES;
      const vf dxv = load(a.dx.data() + at * W);
      const vb q0 = loadb(qa), q1 = I4 ? loadb(qa + C::BYTES) : q0;
      const vi init = (I4 && !ASYM) ? loadi(a.corr.data() + at * W) : zeroi();
      for (int s = 0; s < NR; ++s) {
        vi acc = init;
        if constexpr (I4)
          acc = dot_u4(dot_u4(acc, lo[s], q0), hi[s], q1);
        else
          acc = dot_s8(acc, lo[s], q0);
        tot[m][s] = fmadd(to_float(acc), mul(sc[s][0], dxv), tot[m][s]);
        if constexpr (ASYM) tot[m][s] = fmadd(sc[s][1], load(a.sx.data() + at * W), tot[m][s]);
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) y[m * ldy + r0 + s] = reduce_add(tot[m][s]);
}

template <bool I4, bool ASYM>
inline void qdot_range(const QMatrix& q, const QActs& a, int64_t M, int64_t n0, int64_t n1, float* y) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    float* ym = y + m0 * q.n;
    int64_t r = n0;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1:
        for (; r + 4 <= n1; r += 4) qdot_rows<I4, ASYM, 1, 4>(q, a, m0, r, ym, q.n);
        for (; r < n1; ++r) qdot_rows<I4, ASYM, 1, 1>(q, a, m0, r, ym, q.n);
        break;
      case 2:
        for (; r + 2 <= n1; r += 2) qdot_rows<I4, ASYM, 2, 2>(q, a, m0, r, ym, q.n);
        for (; r < n1; ++r) qdot_rows<I4, ASYM, 2, 1>(q, a, m0, r, ym, q.n);
        break;
      case 3:
        for (; r < n1; ++r) qdot_rows<I4, ASYM, 3, 1>(q, a, m0, r, ym, q.n);
        break;
      default:  // 4 x 2: 8 accumulators, the most that stay in registers beside the weights
        for (; r + 2 <= n1; r += 2) qdot_rows<I4, ASYM, 4, 2>(q, a, m0, r, ym, q.n);
        for (; r < n1; ++r) qdot_rows<I4, ASYM, 4, 1>(q, a, m0, r, ym, q.n);
        break;
    }
  }
}

// x [M, kp] float32 (zeros past K), group-32 packed q, bias [N] or null -> y [M, N]
inline void quant_dot_rows(const QMatrix& q, const float* x, int64_t M, const float* bias, float* y) {
  QActs a;
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
