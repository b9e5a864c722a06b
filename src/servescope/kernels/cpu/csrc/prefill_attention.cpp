// Causal prefill attention for one sequence on the CPU, the keys and values read from the paged cache. bfloat16
// q and KV cache: flash attention tiled for AVX-512 BF16 (VDPBF16PS; compiled only where the extension's ISA has
// it: elsewhere attention/cpu.py's other paths serve bfloat16 prefill). float32: prefill_f32.h, on every ISA.
//
// Shape legend: T query tokens (positions ctx - T .. ctx - 1), H query heads, Hkv KV heads,
// G = H / Hkv, D head dim, S block size.
//
// Why: faster than SDPA's CPU flash kernel and than the paged decode kernel with every prompt token as
// a query (attention/cpu.py) on a long bfloat16 prompt (docs/BENCHMARKS.md): an item is one KV head
// and 16 query tokens with all G of its query heads, the 16 tokens in the 16 lanes, so the online
// softmax is lane-wise (no horizontal sums), q is transposed once per item, and each key or value
// element is a broadcast.
// Scores are exact products summed in float32 (the pairs of VDPBF16PS), the probabilities rounded
// to bfloat16 for p * v as SDPA's bfloat16 kernel rounds them.
#include <ATen/ops/empty_like.h>

#include "simd.h"
#include "ops.h"
#include "prefill_f32.h"

namespace {

using namespace servescope_simd;

#if SERVESCOPE_HAS_BF16_DOT
constexpr int QT = 16;  // query tokens per item: the 16 lanes
constexpr int KT = 32;  // keys per tile

// One item: KV head kvh, query tokens [t0, t0 + 16) of the sequence (positions q0 + t), its G query
// heads; lanes are tokens. Keys 0 .. min(ctx, last position + 1) from the paged cache.
template <int G, int D>
void prefill_item(const bf16* q, int64_t qs0, int64_t qs1, const bf16* kc, const bf16* vc, int64_t S, int64_t hkv,
                  const int32_t* bt, int64_t ctx, int64_t q0, int64_t T, int64_t kvh, int64_t t0, float scale,
                  bf16* out, int64_t os0, int64_t os1, float* work) {
  constexpr int DP = D / 2;
  // register blocks: DC G accumulators for p * v, KB G for the scores (at most 24 of the 32 registers)
  constexpr int DC = G <= 4 ? 4 : 2;  // head dims per p * v block
  constexpr int KB = G <= 3 ? 8 : (G <= 4 ? 4 : 2);  // keys per score block
  const int64_t nt = std::min<int64_t>(QT, T - t0);
  // buffers (in `work`, 64-byte aligned floats)
  uint32_t* qtp = (uint32_t*)work;               // [G][DP][16] q pairs, lanes = tokens
  float* sc = work + G * DP * 16;                 // [KT][G][16] scores -> p
  uint32_t* pp = (uint32_t*)(sc + KT * G * 16);   // [KT/2][G][16] p pairs (bf16, keys 2i, 2i+1)
  uint32_t* vp = pp + (KT / 2) * G * 16;          // [KT/2][D] v pairs (keys 2i, 2i+1) per d
  float* oacc = (float*)(vp + (KT / 2) * D);      // [D][G][16]
  float* mrow = oacc + D * G * 16;                // [G][16]
  float* lrow = mrow + G * 16;                    // [G][16]
  // q pairs transposed: lanes = tokens (rows past T are zeros)
  for (int j = 0; j < G; ++j)
    for (int t = 0; t < QT; ++t) {
      const uint32_t* src = t < nt ? (const uint32_t*)(q + (t0 + t) * qs0 + (kvh * G + j) * qs1) : nullptr;
      for (int dp = 0; dp < DP; ++dp) qtp[(j * DP + dp) * 16 + t] = src ? src[dp] : 0u;
    }
  std::fill(oacc, oacc + D * G * 16, 0.f);
  for (int j = 0; j < G; ++j) {
    _mm512_storeu_ps(mrow + j * 16, _mm512_set1_ps(-std::numeric_limits<float>::infinity()));
    _mm512_storeu_ps(lrow + j * 16, _mm512_setzero_ps());
  }
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i rowpos = _mm512_add_epi32(_mm512_set1_epi32((int)(q0 + t0)), lane);  // position of each lane's token
  const int64_t kend = std::min<int64_t>(ctx, q0 + t0 + nt);  // keys any of these tokens sees
  const __m512i inter = _mm512_loadu_si512(kPairIndex);
  const int64_t row = hkv * D;  // elements between consecutive positions in a block
  auto kptr = [&](int64_t p) -> const bf16* { return kc + ((int64_t)bt[p / S] * S + p % S) * row + kvh * D; };
  auto vptr = [&](int64_t p) -> const bf16* { return vc + ((int64_t)bt[p / S] * S + p % S) * row + kvh * D; };
  for (int64_t k0 = 0; k0 < kend; k0 += KT) {
    const int nk = (int)std::min<int64_t>(KT, kend - k0);
    // scores: lanes = tokens, one vector per (key, head)
    for (int jb = 0; jb < KT; jb += KB) {
      __m512 acc[KB][G];
      for (int kk = 0; kk < KB; ++kk)
        for (int j = 0; j < G; ++j) acc[kk][j] = _mm512_setzero_ps();
      const uint32_t* kp[KB];
      for (int kk = 0; kk < KB; ++kk) kp[kk] = (const uint32_t*)kptr(k0 + std::min(jb + kk, nk - 1));
      for (int dp = 0; dp < DP; ++dp) {
        __m512i qv[G];
        for (int j = 0; j < G; ++j) qv[j] = _mm512_loadu_si512(qtp + (j * DP + dp) * 16);
        for (int kk = 0; kk < KB; ++kk) {
          const __m512i kb = _mm512_set1_epi32((int)kp[kk][dp]);
          for (int j = 0; j < G; ++j) acc[kk][j] = _mm512_dpbf16_ps(acc[kk][j], (__m512bh)qv[j], (__m512bh)kb);
        }
      }
      for (int kk = 0; kk < KB; ++kk) {
        const int64_t kpos = k0 + jb + kk;
        // lanes whose token comes before this key (or a key past the tile) see -inf
        __mmask16 vis = jb + kk < nk ? _mm512_cmp_epi32_mask(_mm512_set1_epi32((int)kpos), rowpos, _MM_CMPINT_LE) : 0;
        for (int j = 0; j < G; ++j)
          _mm512_storeu_ps(sc + ((jb + kk) * G + j) * 16,
                           _mm512_mask_mul_ps(_mm512_set1_ps(-std::numeric_limits<float>::infinity()), vis, acc[kk][j],
                                              _mm512_set1_ps(scale)));
      }
    }
    // online softmax per lane; the accumulators' rescale factor per head
    __m512 corr[G];
    for (int j = 0; j < G; ++j) {
      __m512 mx = _mm512_loadu_ps(sc + j * 16);
      for (int kk = 1; kk < KT; ++kk) mx = _mm512_max_ps(mx, _mm512_loadu_ps(sc + (kk * G + j) * 16));
      const __m512 mold = _mm512_loadu_ps(mrow + j * 16);
      const __m512 mnew = _mm512_max_ps(mold, mx);
      const __mmask16 live = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), _CMP_NEQ_OQ);
      corr[j] = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.f), vexp(_mm512_sub_ps(mold, mnew)));
      __m512 sum = _mm512_setzero_ps();
      for (int kk = 0; kk < KT; kk += 2) {
        const __m512 p0 = _mm512_maskz_mov_ps(live, vexp(_mm512_sub_ps(_mm512_loadu_ps(sc + (kk * G + j) * 16), mnew)));
        const __m512 p1 = _mm512_maskz_mov_ps(live, vexp(_mm512_sub_ps(_mm512_loadu_ps(sc + ((kk + 1) * G + j) * 16), mnew)));
        sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
        // (p0, p1) rounded to bfloat16 and interleaved per lane: the pair for VDPBF16PS
        const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(p0)),
                                                (__m256i)_mm512_cvtneps_pbh(p1), 1);
        _mm512_storeu_si512(pp + ((kk / 2) * G + j) * 16, _mm512_permutexvar_epi16(inter, both));
      }
      _mm512_storeu_ps(mrow + j * 16, mnew);
      _mm512_storeu_ps(lrow + j * 16, _mm512_fmadd_ps(_mm512_loadu_ps(lrow + j * 16), corr[j], sum));
    }
    // v pairs: vp[i][d] = (v[2i][d], v[2i+1][d]); keys past the tile are zeros
    for (int i = 0; i < KT / 2; ++i) {
      for (int c = 0; c < D; c += 16) {
        const __m256i r0 = 2 * i < nk ? _mm256_loadu_si256((const __m256i*)(vptr(k0 + 2 * i) + c)) : _mm256_setzero_si256();
        const __m256i r1 = 2 * i + 1 < nk ? _mm256_loadu_si256((const __m256i*)(vptr(k0 + 2 * i + 1) + c))
                                          : _mm256_setzero_si256();
        _mm512_storeu_si512(vp + i * D + c,
                            _mm512_permutexvar_epi16(inter, _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1)));
      }
    }
    const int npairs = (nk + 1) / 2;
    for (int d0 = 0; d0 < D; d0 += DC) {
      __m512 acc[DC][G];
      for (int dd = 0; dd < DC; ++dd)
        for (int j = 0; j < G; ++j)
          acc[dd][j] = _mm512_mul_ps(_mm512_loadu_ps(oacc + ((d0 + dd) * G + j) * 16), corr[j]);
      for (int i = 0; i < npairs; ++i) {
        __m512i pv[G];
        for (int j = 0; j < G; ++j) pv[j] = _mm512_loadu_si512(pp + (i * G + j) * 16);
        for (int dd = 0; dd < DC; ++dd) {
          const __m512i vb = _mm512_set1_epi32((int)vp[i * D + d0 + dd]);
          for (int j = 0; j < G; ++j) acc[dd][j] = _mm512_dpbf16_ps(acc[dd][j], (__m512bh)pv[j], (__m512bh)vb);
        }
      }
      for (int dd = 0; dd < DC; ++dd)
        for (int j = 0; j < G; ++j) _mm512_storeu_ps(oacc + ((d0 + dd) * G + j) * 16, acc[dd][j]);
    }
  }
  // out[token][head][d] = oacc[d][head][token] / l
  alignas(64) float tmp[16];
  for (int j = 0; j < G; ++j) {
    const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_loadu_ps(lrow + j * 16));
    for (int d = 0; d < D; ++d) {
      _mm512_store_ps(tmp, _mm512_mul_ps(_mm512_loadu_ps(oacc + (d * G + j) * 16), inv));
      for (int t = 0; t < nt; ++t) out[(t0 + t) * os0 + (kvh * G + j) * os1 + d] = float_to_bf16(tmp[t]);
    }
  }
}

inline bf16* as_bf16(const at::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr()); }

template <int G, int D>
void prefill_run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
                 int64_t ctx, double scale, at::Tensor& out) {
  const int64_t T = q.size(0), S = kc.size(1), hkv = kc.size(2), q0 = ctx - T;
  const int64_t tiles = (T + QT - 1) / QT, items = hkv * tiles;
  // cost of an item ~ the keys it reads: contiguous ranges of about equal total per thread
  std::vector<int64_t> cum(items + 1, 0);
  for (int64_t it = 0; it < items; ++it) {
    const int64_t tile = it % tiles;
    cum[it + 1] = cum[it] + std::min<int64_t>(ctx, q0 + (tile + 1) * QT) + 64;
  }
  const int64_t nth = std::max<int64_t>(1, std::min<int64_t>(num_threads(), items));
  const size_t wsz = G * (D / 2) * 16 + KT * G * 16 + (KT / 2) * G * 16 + (KT / 2) * D + D * G * 16 + 2 * G * 16 + 16;
  parallel_by_cost(cum, nth, [&](int64_t i0, int64_t i1) {
    std::vector<float> wbuf(wsz + 16);
    float* work = (float*)(((uintptr_t)wbuf.data() + 63) & ~(uintptr_t)63);
    for (int64_t it = i0; it < i1; ++it)
      prefill_item<G, D>(as_bf16(q), q.stride(0), q.stride(1), as_bf16(kc), as_bf16(vc), S,
                         hkv, bt.data_ptr<int32_t>(), ctx, q0, T, it / tiles, (it % tiles) * QT, (float)scale,
                         as_bf16(out), out.stride(0), out.stride(1), work);
  });
}

#endif  // SERVESCOPE_HAS_BF16_DOT

}  // namespace

namespace servescope_ops {

bool prefill_attention_supported(int64_t group, int64_t head_dim, bool float32) {
  const bool shape = group >= 1 && group <= 8 && (head_dim == 64 || head_dim == 128);
#if SERVESCOPE_HAS_BF16_DOT
  return shape;
#else
  return shape && float32;
#endif
}

// q [T, H, D] (strides: D contiguous); caches [N, S, Hkv, D] contiguous, q's dtype (bfloat16 or float32);
// block_table [>= ceil(ctx / S)] int32: the sequence's blocks; ctx: its length after this step (>= T) -> [T, H, D].
at::Tensor prefill_attention(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_table,
                                int64_t ctx, double scale) {
  const auto dt = q.scalar_type();
  TORCH_CHECK(q.dim() == 3 && (dt == at::kBFloat16 || dt == at::kFloat) && q.stride(2) == 1,
              "prefill_attention: q [T, H, D] bfloat16 or float32, D contiguous");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  k_cache.scalar_type() == dt && v_cache.scalar_type() == dt && k_cache.sizes() == v_cache.sizes(),
              "prefill_attention: caches [N, S, Hkv, D] of q's dtype, contiguous");
  const int64_t h = q.size(1), d = q.size(2), hkv = k_cache.size(2), S = k_cache.size(1);
  TORCH_CHECK(k_cache.size(3) == d && h % hkv == 0, "prefill_attention: heads / head dim");
  TORCH_CHECK(ctx >= q.size(0) && block_table.dim() == 1 && block_table.scalar_type() == at::kInt &&
                  block_table.is_contiguous() && block_table.size(0) * S >= ctx,
              "prefill_attention: block_table int32 covering ctx >= T tokens");
  const bool f32 = dt == at::kFloat;
  TORCH_CHECK(prefill_attention_supported(h / hkv, d, f32), "prefill_attention: unsupported group ", h / hkv,
              " / head dim ", d);
  auto out = at::empty_like(q);
  if (q.size(0) == 0) return out;
#define SERVESCOPE_CASES(CASE)                                                                          \
  CASE(1, 64) CASE(2, 64) CASE(3, 64) CASE(4, 64) CASE(5, 64) CASE(6, 64) CASE(7, 64) CASE(8, 64) CASE(1, 128) \
  CASE(2, 128) CASE(3, 128) CASE(4, 128) CASE(5, 128) CASE(6, 128) CASE(7, 128) CASE(8, 128)
  if (f32) {
#define SERVESCOPE_F32(G_, D_)                                                                                     \
  if (h / hkv == G_ && d == D_) {                                                                                  \
    servescope_prefill::prefill_f32_run<G_, D_>(q.data_ptr<float>(), q.stride(0), q.stride(1),                     \
                                                k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), S, hkv,      \
                                                block_table.data_ptr<int32_t>(), q.size(0), ctx, (float)scale,     \
                                                out.data_ptr<float>(), out.stride(0), out.stride(1));              \
    return out;                                                                                                    \
  }
    SERVESCOPE_CASES(SERVESCOPE_F32)
#undef SERVESCOPE_F32
  }
#if SERVESCOPE_HAS_BF16_DOT
#define SERVESCOPE_BF16(G_, D_) \
  if (h / hkv == G_ && d == D_) { prefill_run<G_, D_>(q, k_cache, v_cache, block_table, ctx, scale, out); return out; }
  SERVESCOPE_CASES(SERVESCOPE_BF16)
#undef SERVESCOPE_BF16
#endif
#undef SERVESCOPE_CASES
  return out;
}

}  // namespace servescope_ops
