// Paged decode attention on raw pointers, written against the vector layer (simd.h): one query per
// sequence over its cached keys, read in place from the blocks.
//
// Shape legend: B sequences, H query heads, Hkv KV heads, G = H / Hkv, D head dim, S block size;
// q [B, H, D] at strides (qs0, qs1), caches [N, S, Hkv, D], block tables [B, bts] int32, context
// lengths [B] int32, out [B, H, D] at strides (os0, os1); window > 0: each sequence reads only its last
// `window` positions (a sliding-window layer: the query at ctx - 1 sees keys ctx - window .. ctx - 1; the
// blocks before may have been freed and are never touched), 0: its whole context. An int8 / fp8 cache is [N, S, Hkv, D + 4]
// (each row's float32 scale after its D values, kv_quant.h): its rows are dequantised a tile at a time
// inside the kernels, never copied out whole.
#pragma once

#include "kv_quant.h"

namespace servescope_kernels {

using namespace servescope_simd;

// What changes the scores before the softmax (model/attention/scores.py has the torch reference): softcap > 0,
// each score s (already times the scale) becomes softcap * tanh(s / softcap) (Gemma 2); sinks [H] float32,
// one more logit per query head in the softmax, its probability dropped (gpt-oss). The default: neither.
struct ScoreMods {
  float softcap = 0.f;
  const float* sinks = nullptr;
  // the softmax's denominator with head i's sink joined, the running max being m
  float denominator(float den, float m, int64_t i) const { return sinks ? den + std::exp(sinks[i] - m) : den; }
};

// Any head dim: one task per (sequence, KV head); the G query heads of the group share each K and V
// row (loaded once). Online softmax over chunks of up to CH positions within a block. Where there are fewer
// (sequence, KV head) pairs than threads (MLA's one latent head at batch 1: one task for the whole layer), each
// pair's heads are split into tasks of HT (each reads the rows again; a head's arithmetic is the same either way).
constexpr int64_t CH = 32;
constexpr int64_t HT = 8;  // query heads per register tile

template <typename Q, typename C>
void decode_any(const Q* q, int64_t qs0, int64_t qs1, const C* kc, const C* vc, int64_t S, int64_t hkv, int64_t d,
                const int32_t* bt, int64_t bts, const int32_t* cl, int64_t b, int64_t h, float scale, Q* out,
                int64_t os0, int64_t os1, int64_t window, ScoreMods mods, int64_t dv = 0) {
  const int64_t g = h / hkv;
  if (dv <= 0) dv = d;  // the values: the first dv features of each row (MLA's latent), all d by default
  const int64_t dp = d + kScalePad<C>;  // a row's pitch: D values (and the scale of a quantised cache)
  const int64_t row = hkv * dp;         // elements between consecutive positions of one head in the cache
  int64_t max_ctx = 1;
  for (int64_t i = 0; i < b; ++i) max_ctx = std::max<int64_t>(max_ctx, cl[i]);
  const int64_t parts = b * hkv < num_threads() ? (g + HT - 1) / HT : 1, per = (g + parts - 1) / parts;
  parallel_for(0, b * hkv * parts, grain_for(max_ctx * per * d, 32768), [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(2 * g * d + g * CH + 2 * g);
    float* qf = buf.data();   // [G, D] queries in float32
    float* acc = qf + g * d;  // [G, D] running sum of p * v
    float* sc = acc + g * d;  // [G, CH] scores / probabilities of the chunk
    float* mx = sc + g * CH;  // [G] running max
    float* den = mx + g;      // [G] running sum of p
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t bi = item / parts / hkv, kh = item / parts % hkv;
      const int64_t h0 = item % parts * per, h1 = std::min(g, h0 + per);  // this task's heads of the group
      for (int64_t i = h0; i < h1; ++i) {
        const Q* qi = q + bi * qs0 + (kh * g + i) * qs1;
        for (int64_t j = 0; j < d; j += W) storen(qf + i * d + j, loadn(qi + j, d - j), d - j);
        mx[i] = -std::numeric_limits<float>::infinity();
        den[i] = 0.f;
      }
      std::fill(acc, acc + g * d, 0.f);
      const int64_t ctx = cl[bi];
      const int32_t* table = bt + bi * bts;
      for (int64_t p = window > 0 ? std::max<int64_t>(0, ctx - window) : 0; p < ctx;) {
        const int64_t blk = table[p / S], off = p % S;
        const int64_t n = std::min<int64_t>({CH, S - off, ctx - p});
        const C* kb = kc + ((blk * S + off) * hkv + kh) * dp;
        const C* vb = vc + ((blk * S + off) * hkv + kh) * dp;
        // scores[i][t] = scale * q_i . k_t
        for (int64_t t = 0; t < n; ++t) {
          const C* kr = kb + t * row;
          for (int64_t i0h = h0; i0h < h1; i0h += HT) {
            const int64_t nh = std::min<int64_t>(HT, h1 - i0h);
            vf a[HT];
            for (int64_t i = 0; i < nh; ++i) a[i] = zero();
            for (int64_t j = 0; j < d; j += W) {
              const vf kv = loadn(kr + j, d - j);
              for (int64_t i = 0; i < nh; ++i) a[i] = fmadd(loadn(qf + (i0h + i) * d + j, d - j), kv, a[i]);
            }
            const float ks = scale * row_scale(kr, d);  // q . (k_q * s) = s (q . k_q)
            for (int64_t i = 0; i < nh; ++i) sc[(i0h + i) * CH + t] = reduce_add(a[i]) * ks;
          }
        }
        // online softmax: rescale the running sums by exp(old max - new max)
        for (int64_t i = h0; i < h1; ++i) {
          float* s = sc + i * CH;
          if (mods.softcap > 0.f)
            for (int64_t t = 0; t < n; t += W) storen(s + t, vsoftcap(loadn(s + t, n - t), mods.softcap), n - t);
          float cmax = s[0];
          for (int64_t t = 1; t < n; ++t) cmax = std::max(cmax, s[t]);
          const float mnew = std::max(mx[i], cmax);
          const float corr = mnew == mx[i] ? 1.0f : std::exp(mx[i] - mnew);  // exp(0) = 1 exactly
          mx[i] = mnew;
          vf sum = zero();
          for (int64_t t = 0; t < n; t += W) {
            const vf e = first_lanes(vexp(sub(loadn(s + t, n - t), set1(mnew))), n - t, 0.f);
            storen(s + t, e, n - t);
            sum = add(sum, e);
          }
          den[i] = den[i] * corr + reduce_add(sum);
          if (corr != 1.0f) {
            float* ai = acc + i * d;
            for (int64_t j = 0; j < dv; j += W) storen(ai + j, mul(loadn(ai + j, dv - j), set1(corr)), dv - j);
          }
        }
        // acc_i += sum_t p[i][t] * v_t
        for (int64_t t = 0; t < n; ++t) {
          const C* vr = vb + t * row;
          const float vs = row_scale(vr, d);  // p (v_q * s) = (p s) v_q
          for (int64_t j = 0; j < dv; j += W) {
            const vf vv = loadn(vr + j, dv - j);
            for (int64_t i = h0; i < h1; ++i) {
              float* ai = acc + i * d + j;
              storen(ai, fmadd(set1(sc[i * CH + t] * vs), vv, loadn(ai, dv - j)), dv - j);
            }
          }
        }
        p += n;
      }
      for (int64_t i = h0; i < h1; ++i) {
        Q* o = out + bi * os0 + (kh * g + i) * os1;
        const float all = mods.denominator(den[i], mx[i], kh * g + i);
        const vf inv = set1(all > 0.f ? 1.0f / all : 0.f);
        for (int64_t j = 0; j < dv; j += W) storen(o + j, mul(loadn(acc + i * d + j, dv - j), inv), dv - j);
      }
    }
  });
}

// The same attention for head dims that are a multiple of W (64 and 128 are instantiated; NJ = D / W
// vectors per row), arranged so that the arithmetic stays in registers: keys are taken W at a time
// (within one KV block) and copied, all KV heads at once and in the order they lie in the cache, into
// a scratch tile (converted to float32 on the way; bfloat16 queries and caches on AVX512-BF16 keep
// the raw pairs for VDPBF16PS, in q.k and in p.v). Each query head's W dot products are summed across
// lanes together (transpose_sum), and the p * v accumulation of a tile of HD heads
// (HD * NJ <= 16 accumulators) runs in registers over the W keys. Measured at batch 64, context ~400,
// SmolLM2 bfloat16: see docs/BENCHMARKS.md.
//
// One cached row of D = W NJ elements into the scratch: as it is (float32; bfloat16 read raw, T = bf16),
// widened (bfloat16 into float32), or multiplied by its scale (int8 / fp8).
template <typename C, typename T, int NJ>
inline void row_to_tile(const C* src, T* dst) {
  if constexpr (std::is_same_v<C, bf16> && std::is_same_v<T, bf16>) {
    std::memcpy(dst, src, W * NJ * sizeof(T));
  } else if constexpr (kQuantKV<C>) {
    const vf s = set1(row_scale(src, W * NJ));
    for (int j = 0; j < NJ; ++j) store(dst + W * j, mul(load(src + W * j), s));
  } else {
    for (int j = 0; j < NJ; ++j) store(dst + W * j, load(src + W * j));
  }
}

// Prefetch distance in positions, into L2 (T1). Measured at batch 64, context 300-600, SmolLM2's
// heads, the KV cache in memory (not in cache, as in a real step): 3-15% faster than none into L1
// (T0), and T1 another 10-16% faster than T0 (T2 the same as T1, NTA slower); 32 about 16.
constexpr int64_t PF = 32;

// The keys of one tile: (position in the cache, in rows of D elements; count of keys from there)
struct Tile {
  int64_t row0, n;
};

template <typename Q, typename C, int D>
void decode_fast(const Q* q, int64_t qs0, int64_t qs1, const C* kc, const C* vc, int64_t S, int64_t hkv,
                 const int32_t* bt, int64_t bts, const int32_t* cl, int64_t b, int64_t h, float scale, Q* out,
                 int64_t os0, int64_t os1, int64_t window, ScoreMods mods) {
  constexpr int NJ = D / W, HD = NJ >= 16 ? 1 : 16 / NJ, KW = W;  // KW keys per tile
  static_assert(D % W == 0, "decode_fast: head dim a multiple of the vector width");
  // bfloat16 queries and keys: the scores come from VDPBF16PS on the raw pairs (products of two
  // bfloat16 are exact in float32, summed in float32), with no float32 copy of the keys
  constexpr bool kDot = SERVESCOPE_HAS_BF16_DOT && std::is_same_v<Q, bf16> && std::is_same_v<C, bf16>;
  constexpr int64_t DP = D + kScalePad<C>;  // a row's pitch (the scale after the D values of a quantised cache)
  const int64_t g = h / hkv;
  // Each tile is copied into a scratch in cache order (below), except float32 rows of 512 bytes or more:
  // those the prefetcher follows in place, and the copy only costs (measured at Llama-3-8B's heads:
  // docs/BENCHMARKS.md, decode attention in cache order)
  constexpr bool kCopy = !(std::is_same_v<C, float> && D * sizeof(C) >= 512);
  const int64_t rs = kCopy ? D : hkv * DP;  // elements between a KV head's consecutive rows, where they are read
  // An item is a sequence with all its KV heads (each block's keys and values are read whole, front
  // to back: 3-10% faster in float32 at batch 64 with the cache in memory than items of one KV head,
  // neutral in bfloat16) or, with fewer than two sequences per thread, a part of a sequence's context
  // (flash-decoding: the parts' partial softmax sums are merged at the end; at batch 1 this keeps
  // both threads busy on whole blocks). Items cost in proportion to their context: one contiguous
  // range per thread of about equal total context, on one thread when the whole step is small.
  const int64_t nthreads = num_threads();
  const int64_t parts = b >= 2 * nthreads ? 1 : (2 * nthreads + b - 1) / b;  // context parts per sequence
  const int64_t items = b * parts;
  // item -> [p0, p1) within the sequence's visible positions [lo, ctx), cut at lo + multiples of KW
  auto range_of = [&](int64_t it, int64_t* p0, int64_t* p1) {
    const int64_t ctx = cl[it / parts], j = it % parts;
    const int64_t lo = window > 0 ? std::max<int64_t>(0, ctx - window) : 0;
    const int64_t per = (ctx - lo + KW * parts - 1) / (KW * parts) * KW;
    *p0 = std::min(ctx, lo + j * per);
    *p1 = std::min(ctx, *p0 + per);
  };
  std::vector<int64_t> cum(items + 1, 0);
  for (int64_t it = 0; it < items; ++it) {
    int64_t p0, p1;
    range_of(it, &p0, &p1);
    cum[it + 1] = cum[it] + (p1 - p0 + 16) * hkv;
  }
  const int64_t total = cum[items];
  // split sequences: each part's running max, sum of p and sum of p * v per query head, merged below
  std::vector<float> partial(parts > 1 ? items * h * (D + 2) : 0);
  const int64_t nt = std::max<int64_t>(1, std::min<int64_t>({nthreads, items, total * g * D / 32768}));
  parallel_by_cost(cum, nt, [&](int64_t i0, int64_t i1) {
    using T = std::conditional_t<kDot, bf16, float>;  // the tile scratch's element type
    std::vector<float> buf(2 * h * D + KW * h + 2 * h);
    float* qf = buf.data();       // [H, D] queries in float32, pre-scaled
    float* acc_ = qf + h * D;     // [H, D] running sum of p * v
    float* pr_ = acc_ + h * D;    // [H, KW] probabilities of the current keys
    float* mx_ = pr_ + KW * h;    // [H] running max
    float* den_ = mx_ + h;        // [H] running sum of p
    // [Hkv, KW, D] keys, one KV head after another, then as many values. Each KV head's slice is
    // padded by a cache line so that the slices do not sit 4 KiB apart: stores and loads at the same
    // offset within 4 KiB pages stall each other (29.0 -> 27.3 ns per key and KV head, float32 in L2).
    constexpr int64_t SL = KW * D + 64 / sizeof(T);
    std::vector<T> tile_(kCopy ? 2 * hkv * SL + SL : 0);
    T* kt = tile_.data();
    T* vt = kCopy ? kt + hkv * SL + SL / 2 : nullptr;
    std::vector<bf16> qb_(kDot ? h * D : 0);   // [H, D] queries as they are (bfloat16), for the pair dot products
    std::vector<bf16> pb_(kDot ? h * KW : 0);  // [H, KW] probabilities rounded to bfloat16 (p * v pairs)
    // where the keys of item `it` at position `pos` are, and how many of them are in this tile (0 past its end)
    auto tile_at = [&](int64_t it, int64_t pos) -> Tile {
      int64_t p0, p1;
      range_of(it, &p0, &p1);
      if (pos >= p1) return {0, 0};
      const int64_t blk = bt[(it / parts) * bts + pos / S], off = pos % S;
      return {(blk * S + off) * hkv, std::min<int64_t>({KW, S - off, p1 - pos})};
    };
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t bi = item / parts;
      for (int64_t i = 0; i < h; ++i) {  // query head i of the sequence
        const Q* qi = q + bi * qs0 + i * qs1;
        if constexpr (kDot)  // the pair products read q as it is; the float32 copy is not needed
          std::memcpy(qb_.data() + i * D, qi, D * sizeof(bf16));
        else
          for (int j = 0; j < NJ; ++j) store(qf + i * D + W * j, mul(load(qi + W * j), set1(scale)));
        mx_[i] = -std::numeric_limits<float>::infinity();
        den_[i] = 0.f;
      }
      std::fill(acc_, acc_ + h * D, 0.f);
      int64_t p_begin, p_end;
      range_of(item, &p_begin, &p_end);
      for (int64_t p = p_begin; p < p_end;) {
        const Tile tile = tile_at(item, p);
        const int64_t n = tile.n, r0 = tile.row0;
        // The blocks of a sequence lie anywhere in the cache, so the hardware prefetcher cannot
        // guess the next one: ask for the keys and values PF positions ahead (the next item's first
        // ones near the end of this one) while this tile computes.
        {
          Tile pf = tile_at(item, p + PF);
          if (pf.n == 0 && item + 1 < i1) {
            int64_t q0, q1;
            range_of(item + 1, &q0, &q1);
            pf = tile_at(item + 1, q0 + p + PF - p_end);
          }
          const char* pk = (const char*)(kc + pf.row0 * DP);  // pf.n positions, one contiguous run
          const char* pv = (const char*)(vc + pf.row0 * DP);
          for (int64_t cb = 0; cb < pf.n * hkv * DP * (int64_t)sizeof(C); cb += 64) {
            prefetch_l2(pk + cb);
            prefetch_l2(pv + cb);
          }
        }
        // The tile's keys and values are read once, in the order they lie in the cache (position after
        // position, each with its KV heads), into the scratch: the hardware prefetcher follows that
        // stream. Reading one KV head's rows at a time strides over the others, and it does not (a walk
        // over SmolLM2's float32 cache read at well under half the in-order rate: docs/BENCHMARKS.md).
        if constexpr (kCopy)
          for (int64_t t = 0; t < n; ++t)
            for (int64_t kl = 0; kl < hkv; ++kl) {
              row_to_tile<C, T, NJ>(kc + (r0 + t * hkv + kl) * DP, kt + kl * SL + t * D);
              row_to_tile<C, T, NJ>(vc + (r0 + t * hkv + kl) * DP, vt + kl * SL + t * D);
            }
        for (int64_t kl = 0; kl < hkv; ++kl) {  // the item's KV heads, each with its g query heads
          float* acc = acc_ + kl * g * D;
          float* pr = pr_ + kl * g * KW;
          float* mx = mx_ + kl * g;
          float* den = den_ + kl * g;
          const float* qh = qf + kl * g * D;
          [[maybe_unused]] const bf16* qb = kDot ? qb_.data() + kl * g * D : nullptr;
          [[maybe_unused]] bf16* pb = kDot ? pb_.data() + kl * g * KW : nullptr;
          // this KV head's keys (KW rows are read: rows n.. are stale ones in the scratch, row n - 1 again
          // in place; their scores are masked) and values (n rows), `rs` elements apart
          const T *kh, *vh;
          if constexpr (kCopy) {
            kh = kt + kl * SL;
            vh = vt + kl * SL;
          } else {  // float32 rows, read where they are
            kh = kc + (r0 + kl) * DP;
            vh = vc + (r0 + kl) * DP;
          }
          for (int64_t i = 0; i < g; ++i) {  // scores of head i for the n keys, then the online softmax
            vf part[KW];
            if constexpr (kDot) {
#if SERVESCOPE_HAS_BF16_DOT
              __m512bh qv[NJ / 2];
              for (int j = 0; j < NJ / 2; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qb + i * D + 32 * j);
#pragma GCC unroll 16
              for (int64_t t = 0; t < KW; ++t) {
                const T* kr = kh + t * rs;
                __m512 a = _mm512_setzero_ps();
#pragma GCC unroll 4
                for (int j = 0; j < NJ / 2; ++j) a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(kr + 32 * j));
                part[t] = a;
              }
#endif
            } else {
              vf qv[NJ];
              for (int j = 0; j < NJ; ++j) qv[j] = load(qh + i * D + W * j);
#pragma GCC unroll 16
              for (int64_t t = 0; t < KW; ++t) {
                const T* kr = kh + (kCopy ? t : std::min<int64_t>(t, n - 1)) * rs;
                vf a = zero();
#pragma GCC unroll 16
                for (int j = 0; j < NJ; ++j) a = fmadd(qv[j], load(kr + W * j), a);
                part[t] = a;
              }
            }
            vf sum = transpose_sum(part);
            if constexpr (kDot) sum = mul(sum, set1(scale));  // q unscaled: exact bf16 pairs
            if (mods.softcap > 0.f) sum = vsoftcap(sum, mods.softcap);
            const vf sc = first_lanes(sum, n, -std::numeric_limits<float>::infinity());
            const float mnew = std::max(mx[i], reduce_max(sc));
            // exp(-inf) = 0 on the first keys; an unchanged max (most tiles) needs no exp: exp(0) = 1 exactly
            const float corr = mnew == mx[i] ? 1.0f : std::exp(mx[i] - mnew);
            mx[i] = mnew;
            const vf e = first_lanes(vexp(sub(sc, set1(mnew))), n, 0.f);
            den[i] = den[i] * corr + reduce_add(e);
            store(pr + KW * i, e);
#if SERVESCOPE_HAS_BF16_DOT
            if constexpr (kDot) _mm256_storeu_si256((__m256i*)(pb + KW * i), (__m256i)_mm512_cvtneps_pbh(e));
#endif
            if (corr != 1.0f)
              for (int j = 0; j < NJ; ++j) store(acc + i * D + W * j, mul(load(acc + i * D + W * j), set1(corr)));
          }
          for (int64_t i0h = 0; i0h < g; i0h += HD) {  // acc[i] += sum_t p[i][t] v_t, NH <= HD heads in registers
            with_count<HD>(std::min<int64_t>(HD, g - i0h), [&](auto nh_c) {
              constexpr int NH = decltype(nh_c)::value;
              vf a[NH][NJ];
#pragma GCC unroll 16
              for (int ii = 0; ii < NH; ++ii)
#pragma GCC unroll 32
                for (int j = 0; j < NJ; ++j) a[ii][j] = load(acc + (i0h + ii) * D + W * j);
              if constexpr (kDot) {
#if SERVESCOPE_HAS_BF16_DOT
                // two keys at a time: VDPBF16PS adds p_t v_t[d] + p_t+1 v_t+1[d] for 16 dims d, the
                // probabilities rounded to bfloat16 as SDPA's bfloat16 kernel rounds them for its p*v GEMM
                const __m512i inter = _mm512_loadu_si512(kPairIndex);
                for (int64_t t = 0; t < n; t += 2) {
                  const bool two = t + 1 < n;  // an odd tail pairs with a zero row (its p is 0 too)
                  __m512i vv[NJ];
#pragma GCC unroll 32
                  for (int j = 0; j < NJ; ++j) {
                    __m256i r0v = _mm256_loadu_si256((const __m256i*)(vh + t * rs + 16 * j));
                    __m256i r1v = two ? _mm256_loadu_si256((const __m256i*)(vh + (t + 1) * rs + 16 * j))
                                      : _mm256_setzero_si256();
                    vv[j] = _mm512_permutexvar_epi16(inter, _mm512_inserti64x4(_mm512_castsi256_si512(r0v), r1v, 1));
                  }
#pragma GCC unroll 16
                  for (int ii = 0; ii < NH; ++ii) {
                    uint32_t pair;
                    std::memcpy(&pair, pb + KW * (i0h + ii) + t, sizeof(pair));
                    const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
#pragma GCC unroll 32
                    for (int j = 0; j < NJ; ++j) a[ii][j] = _mm512_dpbf16_ps(a[ii][j], pp, (__m512bh)vv[j]);
                  }
                }
#endif
              } else {
                for (int64_t t = 0; t < n; ++t) {
                  vf vv[NJ];
#pragma GCC unroll 32
                  for (int j = 0; j < NJ; ++j) vv[j] = load(vh + t * rs + W * j);
#pragma GCC unroll 16
                  for (int ii = 0; ii < NH; ++ii) {
                    const vf pv = set1(pr[KW * (i0h + ii) + t]);
#pragma GCC unroll 32
                    for (int j = 0; j < NJ; ++j) a[ii][j] = fmadd(pv, vv[j], a[ii][j]);
                  }
                }
              }
#pragma GCC unroll 16
              for (int ii = 0; ii < NH; ++ii)
#pragma GCC unroll 32
                for (int j = 0; j < NJ; ++j) store(acc + (i0h + ii) * D + W * j, a[ii][j]);
            });
          }
        }
        p += n;
      }
      if (parts > 1) {  // [max, sum of p, sum of p * v (D)] per query head, merged below
        float* pp = partial.data() + item * h * (D + 2);
        for (int64_t i = 0; i < h; ++i) {
          pp[i * (D + 2)] = mx_[i];
          pp[i * (D + 2) + 1] = den_[i];
          std::memcpy(pp + i * (D + 2) + 2, acc_ + i * D, D * sizeof(float));
        }
        continue;
      }
      for (int64_t i = 0; i < h; ++i) {
        Q* o = out + bi * os0 + i * os1;
        const float all = mods.denominator(den_[i], mx_[i], i);
        const vf inv = set1(all > 0.f ? 1.0f / all : 0.f);
        for (int j = 0; j < NJ; ++j) store(o + W * j, mul(load(acc_ + i * D + W * j), inv));
      }
    }
  });
  if (parts == 1) return;
  for (int64_t bi = 0; bi < b; ++bi)  // softmax over the parts: rescale each part's sums to the common max
    for (int64_t i = 0; i < h; ++i) {
      float m = -std::numeric_limits<float>::infinity(), den = 0.f;
      for (int64_t j = 0; j < parts; ++j) m = std::max(m, partial[((bi * parts + j) * h + i) * (D + 2)]);
      vf acc[NJ];
      for (int k = 0; k < NJ; ++k) acc[k] = zero();
      for (int64_t j = 0; j < parts; ++j) {
        const float* pp = partial.data() + ((bi * parts + j) * h + i) * (D + 2);
        if (pp[1] == 0.f) continue;  // an empty part
        const float c = std::exp(pp[0] - m);
        den += pp[1] * c;
        for (int k = 0; k < NJ; ++k) acc[k] = fmadd(loadn(pp + 2 + W * k, W), set1(c), acc[k]);
      }
      den = mods.denominator(den, m, i);
      const vf inv = set1(den > 0.f ? 1.0f / den : 0.f);
      Q* o = out + bi * os0 + i * os1;
      for (int k = 0; k < NJ; ++k) store(o + W * k, mul(acc[k], inv));
    }
}

// The dispatch every caller uses: the register-tiled kernel for head dims 64 and 128, else the general one.
template <typename Q, typename C>
void paged_decode_rows(const Q* q, int64_t qs0, int64_t qs1, const C* kc, const C* vc, int64_t S, int64_t hkv,
                       int64_t d, const int32_t* bt, int64_t bts, const int32_t* cl, int64_t b, int64_t h, float scale,
                       Q* out, int64_t os0, int64_t os1, int64_t window = 0, ScoreMods mods = {}) {
  if (d == 64)
    decode_fast<Q, C, 64>(q, qs0, qs1, kc, vc, S, hkv, bt, bts, cl, b, h, scale, out, os0, os1, window, mods);
  else if (d == 128)
    decode_fast<Q, C, 128>(q, qs0, qs1, kc, vc, S, hkv, bt, bts, cl, b, h, scale, out, os0, os1, window, mods);
  else
    decode_any<Q, C>(q, qs0, qs1, kc, vc, S, hkv, d, bt, bts, cl, b, h, scale, out, os0, os1, window, mods);
}

// MLA's absorbed decode (model/mla.py): one KV head whose rows are the latents [c | k_pe] of width d = r + R,
// read as the keys whole and as the values by their first dv = r features only (the value is c: k_pe is never
// read twice), out [B, H, dv] at strides (os0, os1). The general kernel computes it directly; head dims 64 and
// 128 (whose register-tiled kernel holds whole rows) run at full width into a scratch whose first dv features
// are kept: either way each output equals the full-width kernel's own, bit for bit.
template <typename Q, typename C>
void latent_decode_rows(const Q* q, int64_t qs0, int64_t qs1, const C* cache, int64_t S, int64_t d, int64_t dv,
                        const int32_t* bt, int64_t bts, const int32_t* cl, int64_t b, int64_t h, float scale, Q* out,
                        int64_t os0, int64_t os1) {
  if (d != 64 && d != 128) {
    decode_any<Q, C>(q, qs0, qs1, cache, cache, S, 1, d, bt, bts, cl, b, h, scale, out, os0, os1, 0, {}, dv);
    return;
  }
  std::vector<Q> full(b * h * d);
  paged_decode_rows<Q, C>(q, qs0, qs1, cache, cache, S, 1, d, bt, bts, cl, b, h, scale, full.data(), h * d, d);
  for (int64_t i = 0; i < b; ++i)
    for (int64_t j = 0; j < h; ++j) std::memcpy(out + i * os0 + j * os1, full.data() + (i * h + j) * d, dv * sizeof(Q));
}

}  // namespace servescope_kernels
