// Packed-weight kernels: a decode GEMV that reads 4- and 8-bit weights in their packed blocks, and
// the dequantisation of a whole matrix (the prefill path dequantises, then runs a float GEMM).
// Torch-free, written against the vector layer (simd.h), so it builds on every ISA path.
//
// The packed form (kernels/quant_linear.py makes it; GGUF's Q4_0 / Q4_1 / Q8_0 blocks are the same
// bytes with their scales moved out): along K the weight is cut into blocks of 32; a row is its blocks
// one after the other, and a group (32, 64, 128 or the whole row) shares one scale.
//  - int4: 16 bytes per block; byte j holds element j in its low nibble and element j + 16 in its high
//    nibble (GGUF's order). Value: symmetric d * (u - 8); asymmetric d * u + m.
//  - int8: 32 int8 per block. Value: symmetric d * q; asymmetric d * q + m.
// Scales are float16: [N, G] (d) when symmetric, [N, G, 2] (d, m) when asymmetric.
//
// This float-activation GEMV (the result equals a dequantise-then-float GEMV up to float32 summation
// order) serves groups of 64, 128 or a whole row; group-32 weights (every GGUF block type and the
// default modes) take quant_dot.h's integer dot products, ~3x less work per weight. Per group:
// acc = sum(u * x) in vectors, y += d * acc, and the offset term m * sum(x over the group) is one
// scalar per group from precomputed group sums of x.
#pragma once

#include "simd.h"

namespace servescope_quant {

using namespace servescope_simd;

constexpr int64_t QBLOCK = 32;

// W packed bytes at p -> their low nibbles (lo) and high nibbles (hi) as float32 lanes
#if defined(SERVESCOPE_ISA_AVX512)
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  lo = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
  hi = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#elif defined(SERVESCOPE_ISA_AVX2)
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
  hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#elif defined(SERVESCOPE_ISA_NEON)
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  const uint32x4_t v = vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w)))));
  lo = vcvtq_f32_u32(vandq_u32(v, vdupq_n_u32(15)));
  hi = vcvtq_f32_u32(vshrq_n_u32(v, 4));
}
#else
inline void nibbles(const uint8_t* p, vf& lo, vf& hi) {
  lo = lanes([=](int i) { return (float)(p[i] & 15); });
  hi = lanes([=](int i) { return (float)(p[i] >> 4); });
}
#endif

struct QMatrix {
  const uint8_t* w;        // [N, row_bytes]
  int64_t n, kp, group;    // rows, padded K (a multiple of group), group (a multiple of 32)
  bool int4, asym;
  const uint16_t* scales;  // float16 [N, G] or [N, G, 2]
  // MXFP4 (int4 bytes of e2m1 nibbles in the same order, group 32, symmetric): E8M0 scale bytes [N, kp / 32]
  // instead of `scales`; value 2^(e - 127) * e2m1(u) = e8m0_half(e) * MXFP4_VALUES[u] (simd.h)
  const uint8_t* e8m0 = nullptr;
  // 0: rows as above; else the columns per panel of quant_gemm.h's kept panel layout (weights and scales
  // transposed per panel at load time: model/linears/packed.py's QuantLinear.keep_panels), which only
  // quant_gemm.h's kept-panel kernel reads
  int64_t panel = 0;
  bool mx() const { return e8m0 != nullptr; }
  int64_t row_bytes() const { return int4 ? kp / 2 : kp; }
  int64_t groups() const { return kp / group; }
};

// acc[m] += (stored integers of one 32-block) * x[m * ldx ..], the block widened once for all MR rows
template <bool I4, int MR>
inline void block_dot(const uint8_t* b, const float* x, int64_t ldx, vf* acc) {
  if constexpr (I4) {
    for (int64_t i = 0; i < 16; i += W) {
      vf lo, hi;
      nibbles(b + i, lo, hi);
      for (int m = 0; m < MR; ++m) {
        acc[m] = fmadd(lo, load(x + m * ldx + i), acc[m]);
        acc[m] = fmadd(hi, load(x + m * ldx + 16 + i), acc[m]);
      }
    }
  } else {
    const int8_t* s = (const int8_t*)b;
    for (int64_t i = 0; i < QBLOCK; i += W) {
      const vf v = load(s + i);
      for (int m = 0; m < MR; ++m) acc[m] = fmadd(v, load(x + m * ldx + i), acc[m]);
    }
  }
}

// y[m * ldy + r] for MR rows of x (each kp long, group sums gs [MR][G]) against NR weight rows r0..
template <bool I4, int MR, int NR>
inline void qrows(const QMatrix& q, const float* x, const float* gs, int64_t r0, float* y, int64_t ldy) {
  const int64_t G = q.groups(), bpg = q.group / QBLOCK, rb = q.row_bytes(), bb = I4 ? 16 : 32;
  const int64_t sc = q.asym ? 2 : 1;
  vf tot[MR][NR];
  float off[MR][NR];
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) tot[m][s] = zero(), off[m][s] = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    for (int s = 0; s < NR; ++s) {
      const uint16_t* sp = q.scales + ((r0 + s) * G + g) * sc;
      const float d = half_to_float(sp[0]);
      const float mo = q.asym ? half_to_float(sp[1]) : (I4 ? -8.f * d : 0.f);
      const uint8_t* wb = q.w + (r0 + s) * rb + g * bpg * bb;
      vf acc[MR];
      for (int m = 0; m < MR; ++m) acc[m] = zero();
      for (int64_t j = 0; j < bpg; ++j) block_dot<I4, MR>(wb + j * bb, x + (g * bpg + j) * QBLOCK, q.kp, acc);
      const vf dv = set1(d);
      for (int m = 0; m < MR; ++m) {
        tot[m][s] = fmadd(acc[m], dv, tot[m][s]);
        off[m][s] += mo * gs[m * G + g];
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int s = 0; s < NR; ++s) y[m * ldy + r0 + s] = reduce_add(tot[m][s]) + off[m][s];
}

// group sums of x [M, kp] -> gs [M, G]
inline void group_sums(const float* x, int64_t M, int64_t kp, int64_t group, float* gs) {
  const int64_t G = kp / group;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      vf a = zero();
      for (int64_t k = 0; k < group; k += W) a = add(a, load(x + m * kp + g * group + k));
      gs[m * G + g] = reduce_add(a);
    }
}

template <bool I4, int MR>
inline void qgemv_tile(const QMatrix& q, const float* x, const float* gs, int64_t n0, int64_t n1, float* y) {
  int64_t r = n0;
  if constexpr (MR == 1)
    for (; r + 4 <= n1; r += 4) qrows<I4, 1, 4>(q, x, gs, r, y, q.n);
  for (; r < n1; ++r) qrows<I4, MR, 1>(q, x, gs, r, y, q.n);
}

template <bool I4>
inline void qgemv_range(const QMatrix& q, const float* x, const float* gs, int64_t M, int64_t n0, int64_t n1,
                        float* y) {
  for (int64_t m0 = 0; m0 < M; m0 += 4) {
    const float* xm = x + m0 * q.kp;
    const float* gm = gs + m0 * q.groups();
    float* ym = y + m0 * q.n;
    switch (std::min<int64_t>(4, M - m0)) {
      case 1: qgemv_tile<I4, 1>(q, xm, gm, n0, n1, ym); break;
      case 2: qgemv_tile<I4, 2>(q, xm, gm, n0, n1, ym); break;
      case 3: qgemv_tile<I4, 3>(q, xm, gm, n0, n1, ym); break;
      default: qgemv_tile<I4, 4>(q, xm, gm, n0, n1, ym); break;
    }
  }
}

// x [M, kp] float32 (zero past K), bias [N] or null -> y [M, N] float32. Rows of the weight are split
// over the threads; every group of up to 4 rows of x goes over a weight row while it sits in L1.
inline void quant_gemv_rows(const QMatrix& q, const float* x, int64_t M, const float* bias, float* y) {
  std::vector<float> gs(M * q.groups());
  group_sums(x, M, q.kp, q.group, gs.data());
  parallel_for(0, q.n, 32, [&](int64_t n0, int64_t n1) {
    if (q.int4)
      qgemv_range<true>(q, x, gs.data(), M, n0, n1, y);
    else
      qgemv_range<false>(q, x, gs.data(), M, n0, n1, y);
    if (bias)
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = n0; n < n1; ++n) y[m * q.n + n] += bias[n];
  });
}

// Rows r0 .. r0 + rows of the packed matrix, their first k columns (k <= kp), as T [rows, k] at out
// (T float or bf16: written straight in the GEMM's dtype, no float32 copy in between). The prefill path
// calls it a tile of rows at a time into a buffer it reuses, so the tile is still in cache for the GEMM.
template <typename T>
inline void dequantize_rows(const QMatrix& q, int64_t r0, int64_t rows, int64_t k, T* out) {
  const int64_t G = q.groups(), bpg = q.group / QBLOCK, rb = q.row_bytes(), sc = q.asym ? 2 : 1;
  // out[c .. c + W) = v, clipped at column k (a block's padding past K is not written)
  auto put = [k](T* row, int64_t c, vf v) {
    if (c + W <= k)
      store(row + c, v);
    else if (c < k)
      storen(row + c, v, k - c);
  };
  parallel_for(r0, r0 + rows, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t r = n0; r < n1; ++r) {
      T* row = out + (r - r0) * k;
      for (int64_t b = 0; q.mx() && b * QBLOCK < k; ++b) {  // MXFP4: 32 table values times the block's scale
        alignas(64) float v[QBLOCK];
        const uint8_t* p = q.w + r * rb + b * 16;
        const float d = e8m0_half(q.e8m0[r * G + b]);
        for (int i = 0; i < 16; ++i) v[i] = MXFP4_VALUES[p[i] & 15] * d, v[16 + i] = MXFP4_VALUES[p[i] >> 4] * d;
        for (int64_t i = 0; i < QBLOCK; i += W) put(row, b * QBLOCK + i, load(v + i));
      }
      for (int64_t g = 0; g < G && !q.mx(); ++g) {
        const uint16_t* sp = q.scales + (r * G + g) * sc;
        const float d = half_to_float(sp[0]);
        const float mo = q.asym ? half_to_float(sp[1]) : (q.int4 ? -8.f * d : 0.f);
        const vf dv = set1(d), mv = set1(mo);
        for (int64_t j = 0; j < bpg; ++j) {
          const int64_t k0 = (g * bpg + j) * QBLOCK;
          if (k0 >= k) break;
          const uint8_t* b = q.w + r * rb + (g * bpg + j) * (q.int4 ? 16 : 32);
          for (int64_t i = 0; i < 16 && q.int4; i += W) {
            vf lo, hi;
            nibbles(b + i, lo, hi);
            put(row, k0 + i, fmadd(lo, dv, mv));
            put(row, k0 + 16 + i, fmadd(hi, dv, mv));
          }
          for (int64_t i = 0; i < QBLOCK && !q.int4; i += W) put(row, k0 + i, fmadd(load((const int8_t*)b + i), dv, mv));
        }
      }
    }
  });
}

}  // namespace servescope_quant
