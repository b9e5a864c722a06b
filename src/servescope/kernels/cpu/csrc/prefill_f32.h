// Causal prefill attention for one sequence on the CPU, float32 q and KV cache, written against the vector
// layer (simd.h), so every ISA path has it (AVX-512, AVX2, NEON, scalar). prefill_attention.cpp dispatches here.
//
// Shape legend: T query tokens (positions ctx - T .. ctx - 1), H query heads, Hkv KV heads, G = H / Hkv,
// D head dim, S block size.
//
// Why: SDPA's CPU flash kernel ran float32 causal prefill at ~65 GFLOP/s on two Zen 4 cores (a 512-token
// prompt of the Llama-3.2-1B shape spent 12% of its prefill there, a 2048-token one ~45%), a third of the FMA
// peak. Here an item is one KV head and W query tokens (the lanes) with all G of its query heads: the online
// softmax is lane-wise (no horizontal sums), q is transposed once per item, each key or value element is one
// broadcast, and a register block of keys x heads (scores) or head dims x heads (p * v) reuses every load.
// A token's arithmetic does not depend on which tokens share its item: keys are visited in tiles from
// position 0, and keys a lane does not see add exactly nothing, so a prompt gives the same bits whether it
// runs in one step or in chunks.
#pragma once

#include "simd.h"

namespace servescope_prefill {

using namespace servescope_simd;

constexpr int FK = 32;  // keys per tile
#if defined(SERVESCOPE_ISA_AVX2) || defined(SERVESCOPE_ISA_SCALAR)
constexpr int VREGS = 16;
#else
constexpr int VREGS = 32;
#endif

// keys (or head dims) per register block for G heads: the largest power of two <= 8 whose block of
// accumulators, the G loaded vectors and a broadcast fit the registers (at least 1)
constexpr int block_for(int g) {
  int b = 8;
  while (b > 1 && b * g + g + 2 > VREGS) b /= 2;
  return b;
}

// floats of work space prefill_f32_item needs
constexpr int64_t f32_work(int g, int d) { return (int64_t)g * d * W + FK * g * W + (int64_t)d * g * W + 3 * g * W + W; }

template <int G, int D>
void prefill_f32_item(const float* q, int64_t qs0, int64_t qs1, const float* kc, const float* vc, int64_t S,
                      int64_t hkv, const int32_t* bt, int64_t ctx, int64_t q0, int64_t T, int64_t kvh, int64_t t0,
                      float scale, float* out, int64_t os0, int64_t os1, float* work) {
  constexpr int B = block_for(G);
  const int64_t nt = std::min<int64_t>(W, T - t0);
  float* qt = work;                 // [G][D][W] q, lanes = tokens (rows past T are zeros)
  float* sc = qt + G * D * W;       // [FK][G][W] scores -> p
  float* oacc = sc + FK * G * W;    // [D][G][W]
  float* mrow = oacc + D * G * W;   // [G][W] running max
  float* lrow = mrow + G * W;       // [G][W] running sum
  float* crow = lrow + G * W;       // [G][W] this tile's rescale
  float* pos = crow + G * W;        // [W] each lane's position
  for (int j = 0; j < G; ++j)
    for (int d = 0; d < D; ++d)
      for (int t = 0; t < W; ++t) qt[(j * D + d) * W + t] = t < nt ? q[(t0 + t) * qs0 + (kvh * G + j) * qs1 + d] : 0.f;
  for (int t = 0; t < W; ++t) pos[t] = (float)(q0 + t0 + t);
  std::fill(oacc, oacc + D * G * W, 0.f);
  for (int j = 0; j < G; ++j) {
    store(mrow + j * W, set1(-std::numeric_limits<float>::infinity()));
    store(lrow + j * W, zero());
  }
  const vf lanepos = load(pos), ninf = set1(-std::numeric_limits<float>::infinity()), vscale = set1(scale);
  const int64_t kend = std::min<int64_t>(ctx, q0 + t0 + nt);  // keys any of these tokens sees
  const int64_t row = hkv * D;  // elements between consecutive positions in a block
  auto at = [&](const float* c, int64_t p) { return c + ((int64_t)bt[p / S] * S + p % S) * row + kvh * D; };
  for (int64_t k0 = 0; k0 < kend; k0 += FK) {
    const int nk = (int)std::min<int64_t>(FK, kend - k0);
    const float* kr[FK];
    const float* vr[FK];
    for (int i = 0; i < nk; ++i) kr[i] = at(kc, k0 + i), vr[i] = at(vc, k0 + i);
    for (int i = nk; i < FK; ++i) kr[i] = kr[nk - 1], vr[i] = vr[nk - 1];
    // scores of B keys x G heads at a time; a key past the tile repeats the last (its score is not kept)
    for (int kb = 0; kb < nk; kb += B) {
      vf acc[B][G];
      for (int kk = 0; kk < B; ++kk)
        for (int j = 0; j < G; ++j) acc[kk][j] = zero();
      for (int d = 0; d < D; ++d) {
        vf qv[G];
        for (int j = 0; j < G; ++j) qv[j] = load(qt + (j * D + d) * W);
        for (int kk = 0; kk < B; ++kk) {
          const vf kv = set1(kr[kb + kk][d]);
          for (int j = 0; j < G; ++j) acc[kk][j] = fmadd(qv[j], kv, acc[kk][j]);
        }
      }
      for (int kk = 0; kk < B && kb + kk < nk; ++kk) {
        // a lane sees the key where its position is at or past the key's: key - position < 0.5
        const vf before = sub(set1((float)(k0 + kb + kk)), lanepos);
        for (int j = 0; j < G; ++j) store(sc + ((kb + kk) * G + j) * W, where_lt(before, 0.5f, mul(acc[kk][j], vscale), ninf));
      }
    }
    // online softmax per lane (key 0 is seen by every lane, so the max is finite from the first tile on)
    for (int j = 0; j < G; ++j) {
      vf mx = load(sc + j * W);
      for (int kk = 1; kk < nk; ++kk) mx = max(mx, load(sc + (kk * G + j) * W));
      const vf mold = load(mrow + j * W), mnew = max(mold, mx);
      const vf corr = vexp(sub(mold, mnew));
      vf sum = zero();
      for (int kk = 0; kk < nk; ++kk) {
        const vf p = vexp(sub(load(sc + (kk * G + j) * W), mnew));
        store(sc + (kk * G + j) * W, p);
        sum = add(sum, p);
      }
      store(mrow + j * W, mnew);
      store(crow + j * W, corr);
      store(lrow + j * W, fmadd(load(lrow + j * W), corr, sum));
    }
    // o = o * corr + p v, B head dims x G heads at a time
    for (int d0 = 0; d0 < D; d0 += B) {
      vf acc[B][G];
      for (int dd = 0; dd < B; ++dd)
        for (int j = 0; j < G; ++j) acc[dd][j] = mul(load(oacc + ((d0 + dd) * G + j) * W), load(crow + j * W));
      for (int i = 0; i < nk; ++i) {
        vf pv[G];
        for (int j = 0; j < G; ++j) pv[j] = load(sc + (i * G + j) * W);
        for (int dd = 0; dd < B; ++dd) {
          const vf vv = set1(vr[i][d0 + dd]);
          for (int j = 0; j < G; ++j) acc[dd][j] = fmadd(pv[j], vv, acc[dd][j]);
        }
      }
      for (int dd = 0; dd < B; ++dd)
        for (int j = 0; j < G; ++j) store(oacc + ((d0 + dd) * G + j) * W, acc[dd][j]);
    }
  }
  // out[token][head][d] = oacc[d][head][token] / l
  alignas(64) float tmp[W];
  for (int j = 0; j < G; ++j) {
    const vf inv = div(set1(1.f), load(lrow + j * W));
    for (int d = 0; d < D; ++d) {
      store(tmp, mul(load(oacc + (d * G + j) * W), inv));
      for (int t = 0; t < nt; ++t) out[(t0 + t) * os0 + (kvh * G + j) * os1 + d] = tmp[t];
    }
  }
}

// q [T, H, D] at strides (qs0, qs1), caches [N, S, Hkv, D], the sequence's block table -> out [T, H, D] at
// strides (os0, os1): items (KV head, W tokens) split over the threads by the keys they read
template <int G, int D>
void prefill_f32_run(const float* q, int64_t qs0, int64_t qs1, const float* kc, const float* vc, int64_t S,
                     int64_t hkv, const int32_t* bt, int64_t T, int64_t ctx, float scale, float* out, int64_t os0,
                     int64_t os1) {
  const int64_t q0 = ctx - T, tiles = (T + W - 1) / W, items = hkv * tiles;
  std::vector<int64_t> cum(items + 1, 0);
  for (int64_t it = 0; it < items; ++it)
    cum[it + 1] = cum[it] + std::min<int64_t>(ctx, q0 + (it % tiles + 1) * W) + 64;
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(num_threads(), items));
  parallel_by_cost(cum, nth, [&](int64_t i0, int64_t i1) {
    std::vector<float> wbuf(f32_work(G, D) + 16);
    float* work = (float*)(((uintptr_t)wbuf.data() + 63) & ~(uintptr_t)63);
    for (int64_t it = i0; it < i1; ++it)
      prefill_f32_item<G, D>(q, qs0, qs1, kc, vc, S, hkv, bt, ctx, q0, T, it / tiles, (it % tiles) * W, scale, out,
                             os0, os1, work);
  });
}

}  // namespace servescope_prefill
