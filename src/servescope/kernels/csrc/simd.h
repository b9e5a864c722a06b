// AVX-512 helpers shared by the CPU kernels of the one extension (cpu_ops.cpp, prefill_attention.cpp):
// bfloat16 <-> float32 lanes, masked loads/stores, exp, the pair interleave for VDPBF16PS.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace servescope_simd {

using bf16 = at::BFloat16;

inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }

inline __m512 bf16_to_f32(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

inline __m256i f32_to_bf16(__m512 v) {  // round to nearest even, like c10::BFloat16
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}

inline __m512 ld(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 ld(const bf16* p, __mmask16 m) { return bf16_to_f32(_mm256_maskz_loadu_epi16(m, p)); }
inline void st(float* p, __m512 v, __mmask16 m) { _mm512_mask_storeu_ps(p, m, v); }
inline void st(bf16* p, __m512 v, __mmask16 m) { _mm256_mask_storeu_epi16(p, m, f32_to_bf16(v)); }

// v rounded to T and widened back (the rounding an eager op in dtype T does to its result)
template <typename T> inline __m512 rnd(__m512 v);
template <> inline __m512 rnd<float>(__m512 v) { return v; }
template <> inline __m512 rnd<bf16>(__m512 v) { return bf16_to_f32(f32_to_bf16(v)); }

// exp(x) for float32 lanes (Cephes polynomial, ~1 ulp), exp(-inf) = 0
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(88.72f));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500E-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073E-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894E-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459E-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201E-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(y, n);
}

// grain (rows per task) so that a task has at least ~min_work elements of work
inline int64_t grain_for(int64_t work_per_row, int64_t min_work = 16384) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, work_per_row));
}

// 16-bit lane k of the result takes element idx[k] of [row t (16) | row t+1 (16)]: (t[0], t+1[0], t[1], ...)
alignas(64) inline constexpr int16_t kPairIndex[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// Items with cumulative costs cum[0] = 0 .. cum[n] cut into nt contiguous ranges of about equal cost,
// run on torch's thread pool: fn(i0, i1) once per worker's range of items [i0, i1).
template <typename F>
inline void parallel_by_cost(const std::vector<int64_t>& cum, int64_t nt, const F& fn) {
  const int64_t items = (int64_t)cum.size() - 1, total = cum.back();
  auto first = [&](int64_t t) -> int64_t {
    return t >= nt ? items : std::lower_bound(cum.begin(), cum.end(), total * t / nt) - cum.begin();
  };
  at::parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) { fn(first(t0), first(t1)); });
}

}  // namespace servescope_simd

// The extension's entry points defined outside cpu_ops.cpp (bound in its PYBIND11_MODULE).
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                                int64_t ctx, double scale);
bool prefill_attention_supported(int64_t group, int64_t head_dim);
