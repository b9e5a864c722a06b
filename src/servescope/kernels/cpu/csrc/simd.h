// The portable vector layer every CPU kernel is written against: one float32 vector type `vf` of
// W lanes and the few operations the kernels use, over AVX-512 (W = 16), AVX2 + FMA (W = 8), ARM
// NEON (W = 4) or plain C++ (W = 8, "scalar": whatever the compiler makes of it).
//
// Why a header of our own (and not ATen's at::vec::Vectorized or Highway): the kernels must also
// compile with no torch at all, for the aarch64 test binary that is cross-compiled and run under
// qemu (there is no aarch64 libtorch to link on an x86 CI machine); the kernels need lane-count
// tails (masked loads on AVX-512/AVX2), bfloat16 rounding exactly like c10::BFloat16 and a
// transposed lane sum, which Vectorized does not give in one call; and the ISA-specific dot
// products (VDPBF16PS today; VNNI / AVX-VNNI / NEON dotprod for packed int8/int4 later) stay
// explicit specialisations beside the portable code: `SERVESCOPE_HAS_BF16_DOT`,
// `SERVESCOPE_HAS_INT8_DOT` say which are compiled in.
//
// The ISA is chosen by the build: -DSERVESCOPE_ISA_{AVX512,AVX2,NEON,SCALAR} (kernels/cpu_extension.py
// compiles one extension per ISA), else from the compiler's own target macros.
// Torch-free: with -DSERVESCOPE_TORCH the parallel loops run on torch's pool (at::parallel_for),
// otherwise serially (the standalone test binary).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if !defined(SERVESCOPE_ISA_AVX512) && !defined(SERVESCOPE_ISA_AVX2) && !defined(SERVESCOPE_ISA_NEON) && \
    !defined(SERVESCOPE_ISA_SCALAR)
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SERVESCOPE_ISA_AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define SERVESCOPE_ISA_AVX2
#elif defined(__ARM_NEON) && defined(__aarch64__)
#define SERVESCOPE_ISA_NEON
#else
#define SERVESCOPE_ISA_SCALAR
#endif
#endif

#if defined(SERVESCOPE_ISA_AVX512) || defined(SERVESCOPE_ISA_AVX2)
#include <immintrin.h>
#elif defined(SERVESCOPE_ISA_NEON)
#include <arm_neon.h>
#endif

#ifdef SERVESCOPE_TORCH
#include <ATen/Parallel.h>
#endif

#if defined(SERVESCOPE_ISA_AVX512) && defined(__AVX512BF16__)
#define SERVESCOPE_HAS_BF16_DOT 1  // VDPBF16PS: bfloat16 pairs multiplied exactly, summed in float32
#else
#define SERVESCOPE_HAS_BF16_DOT 0
#endif
// int8 dot products for packed weights (not used by today's kernels): VNNI, AVX-VNNI, NEON dotprod
#if (defined(SERVESCOPE_ISA_AVX512) && defined(__AVX512VNNI__)) || (defined(SERVESCOPE_ISA_AVX2) && defined(__AVXVNNI__)) || \
    (defined(SERVESCOPE_ISA_NEON) && defined(__ARM_FEATURE_DOTPROD))
#define SERVESCOPE_HAS_INT8_DOT 1
#else
#define SERVESCOPE_HAS_INT8_DOT 0
#endif

namespace servescope_simd {

// bfloat16 as stored (the high half of a float32; layout-compatible with c10::BFloat16)
struct bf16 {
  uint16_t bits;
};

inline float bf16_to_float(bf16 h) {
  uint32_t u = (uint32_t)h.bits << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline bf16 float_to_bf16(float f) {  // round to nearest even, NaN stays NaN (as c10::BFloat16)
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (f != f) return bf16{0x7FC0};
  return bf16{(uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

// IEEE half (float16 scales of packed weights) -> float32
inline float half_to_float(uint16_t h) {
#if defined(SERVESCOPE_ISA_AVX512) || defined(SERVESCOPE_ISA_AVX2)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) {
    u = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    u = sign;
  } else {  // subnormal half: normalise
    int e = -1;
    uint32_t m = man;
    do {
      ++e;
      m <<= 1;
    } while ((m & 0x400u) == 0);
    u = sign | ((uint32_t)(112 - e) << 23) | ((m & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

// ---------------------------------------------------------------------------------------------
#if defined(SERVESCOPE_ISA_AVX512)
constexpr const char* kIsa = "avx512";
constexpr int W = 16;
using vf = __m512;
// 16-bit lane k of a permute takes element idx[k] of [row t (16) | row t+1 (16)]: (t[0], t+1[0], t[1], ...),
// the pair interleave VDPBF16PS multiplies
alignas(64) inline constexpr int16_t kPairIndex[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
inline __mmask16 tail(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
inline vf zero() { return _mm512_setzero_ps(); }
inline vf set1(float x) { return _mm512_set1_ps(x); }
inline vf loadn(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(tail(n), p); }
inline vf load(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }
inline vf loadn(const bf16* p, int64_t n) { return widen_bf16(_mm256_maskz_loadu_epi16(tail(n), p)); }
inline vf load(const bf16* p) { return widen_bf16(_mm256_loadu_si256((const __m256i*)p)); }
inline vf loadn(const int8_t* p, int64_t n) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(tail(n), p))); }
inline vf load(const int8_t* p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p))); }
inline __m256i narrow_bf16(vf v) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(v);
#else
  __m512i u = _mm512_castps_si512(v);
  __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC00000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
#endif
}
inline void storen(float* p, vf v, int64_t n) { _mm512_mask_storeu_ps(p, tail(n), v); }
inline void store(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline void storen(bf16* p, vf v, int64_t n) { _mm256_mask_storeu_epi16(p, tail(n), narrow_bf16(v)); }
inline void store(bf16* p, vf v) { _mm256_storeu_si256((__m256i*)p, narrow_bf16(v)); }
inline vf add(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }    // a * b + c, one rounding
inline vf fnmadd(vf a, vf b, vf c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a * b, one rounding
inline vf max(vf a, vf b) { return _mm512_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm512_min_ps(a, b); }
inline float reduce_add(vf v) { return _mm512_reduce_add_ps(v); }
inline float reduce_max(vf v) { return _mm512_reduce_max_ps(v); }
inline vf round_even(vf v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf y, vf n) { return _mm512_scalef_ps(y, n); }  // y * 2^n (n integral), denormals too
inline vf first_lanes(vf v, int64_t n, float fill) { return _mm512_mask_blend_ps(tail(n), _mm512_set1_ps(fill), v); }
inline vf where_lt(vf x, float limit, vf yes, vf no) {
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(limit), _CMP_LT_OQ), no, yes);
}
// r[t] = sum of the lanes of v[t], t < W: 45 shuffles and adds instead of 16 horizontal sums
inline vf transpose_sum(const vf* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 32-bit interleave: per 128-bit lane [v0+v2, w0+w2, v1+v3, w1+w3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 64-bit interleave: per 128-bit lane the partial sums of 4 rows in order
    __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // pairs of 128-bit lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// ---------------------------------------------------------------------------------------------
#elif defined(SERVESCOPE_ISA_AVX2)
constexpr const char* kIsa = "avx2";
constexpr int W = 8;
using vf = __m256;
alignas(32) inline constexpr int32_t kTailTable[16] = {-1, -1, -1, -1, -1, -1, -1, -1, 0, 0, 0, 0, 0, 0, 0, 0};
inline __m256i tail(int64_t n) { return _mm256_loadu_si256((const __m256i*)(kTailTable + 8 - std::min<int64_t>(n, 8))); }
inline vf zero() { return _mm256_setzero_ps(); }
inline vf set1(float x) { return _mm256_set1_ps(x); }
inline vf load(const float* p) { return _mm256_loadu_ps(p); }
inline vf loadn(const float* p, int64_t n) { return n >= 8 ? _mm256_loadu_ps(p) : _mm256_maskload_ps(p, tail(n)); }
inline vf widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline vf load(const bf16* p) { return widen_bf16(_mm_loadu_si128((const __m128i*)p)); }
inline vf loadn(const bf16* p, int64_t n) {
  if (n >= 8) return load(p);
  alignas(16) bf16 t[8] = {};
  std::memcpy(t, p, n * sizeof(bf16));
  return load(t);
}
inline vf load(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline vf loadn(const int8_t* p, int64_t n) {
  if (n >= 8) return load(p);
  alignas(16) int8_t t[16] = {};
  std::memcpy(t, p, n);
  return load(t);
}
inline __m128i narrow_bf16(vf v) {  // round to nearest even, NaN -> 0x7FC0
  __m256i u = _mm256_castps_si256(v);
  __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC00000), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  r = _mm256_srli_epi32(r, 16);
  // pack within 128-bit lanes, then gather the two low quarters
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}
inline void store(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline void storen(float* p, vf v, int64_t n) { n >= 8 ? _mm256_storeu_ps(p, v) : _mm256_maskstore_ps(p, tail(n), v); }
inline void store(bf16* p, vf v) { _mm_storeu_si128((__m128i*)p, narrow_bf16(v)); }
inline void storen(bf16* p, vf v, int64_t n) {
  if (n >= 8) return store(p, v);
  alignas(16) bf16 t[8];
  store(t, v);
  std::memcpy(p, t, n * sizeof(bf16));
}
inline vf add(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf sub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf mul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf div(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf fnmadd(vf a, vf b, vf c) { return _mm256_fnmadd_ps(a, b, c); }
inline vf max(vf a, vf b) { return _mm256_max_ps(a, b); }
inline vf min(vf a, vf b) { return _mm256_min_ps(a, b); }
inline float reduce_add(vf v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_max(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vf round_even(vf v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf scale_pow2(vf y, vf n) {  // y * 2^n for n >= -126 (the caller flushes below)
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}
inline vf first_lanes(vf v, int64_t n, float fill) {
  return _mm256_blendv_ps(_mm256_set1_ps(fill), v, _mm256_castsi256_ps(tail(n)));
}
inline vf where_lt(vf x, float limit, vf yes, vf no) {
  return _mm256_blendv_ps(no, yes, _mm256_cmp_ps(x, _mm256_set1_ps(limit), _CMP_LT_OQ));
}
inline vf transpose_sum(const vf* v) {
  __m256 a0 = _mm256_hadd_ps(v[0], v[1]), a1 = _mm256_hadd_ps(v[2], v[3]);
  __m256 a2 = _mm256_hadd_ps(v[4], v[5]), a3 = _mm256_hadd_ps(v[6], v[7]);
  __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);  // per 128-bit half: rows 0-3 | 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20), _mm256_permute2f128_ps(b0, b1, 0x31));
}

// ---------------------------------------------------------------------------------------------
#elif defined(SERVESCOPE_ISA_NEON)
constexpr const char* kIsa = "neon";
constexpr int W = 4;
using vf = float32x4_t;
inline vf zero() { return vdupq_n_f32(0.f); }
inline vf set1(float x) { return vdupq_n_f32(x); }
inline vf load(const float* p) { return vld1q_f32(p); }
inline vf loadn(const float* p, int64_t n) {
  if (n >= 4) return vld1q_f32(p);
  float t[4] = {0.f, 0.f, 0.f, 0.f};
  std::memcpy(t, p, n * sizeof(float));
  return vld1q_f32(t);
}
inline vf load(const bf16* p) { return vreinterpretq_f32_u32(vshll_n_u16(vld1_u16((const uint16_t*)p), 16)); }
inline vf loadn(const bf16* p, int64_t n) {
  if (n >= 4) return load(p);
  bf16 t[4] = {};
  std::memcpy(t, p, n * sizeof(bf16));
  return load(t);
}
inline vf load(const int8_t* p) {
  int32_t w;
  std::memcpy(&w, p, 4);
  int16x8_t s = vmovl_s8(vreinterpret_s8_s32(vdup_n_s32(w)));
  return vcvtq_f32_s32(vmovl_s16(vget_low_s16(s)));
}
inline vf loadn(const int8_t* p, int64_t n) {
  if (n >= 4) return load(p);
  int8_t t[4] = {0, 0, 0, 0};
  std::memcpy(t, p, n);
  return load(t);
}
inline uint16x4_t narrow_bf16(vf v) {  // round to nearest even, NaN -> 0x7FC0
  uint32x4_t u = vreinterpretq_u32_f32(v);
  uint32x4_t r = vaddq_u32(u, vaddq_u32(vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1)), vdupq_n_u32(0x7FFF)));
  r = vbslq_u32(vceqq_f32(v, v), r, vdupq_n_u32(0x7FC00000));
  return vshrn_n_u32(r, 16);
}
inline void store(float* p, vf v) { vst1q_f32(p, v); }
inline void storen(float* p, vf v, int64_t n) {
  if (n >= 4) return vst1q_f32(p, v);
  float t[4];
  vst1q_f32(t, v);
  std::memcpy(p, t, n * sizeof(float));
}
inline void store(bf16* p, vf v) { vst1_u16((uint16_t*)p, narrow_bf16(v)); }
inline void storen(bf16* p, vf v, int64_t n) {
  if (n >= 4) return store(p, v);
  bf16 t[4];
  store(t, v);
  std::memcpy(p, t, n * sizeof(bf16));
}
inline vf add(vf a, vf b) { return vaddq_f32(a, b); }
inline vf sub(vf a, vf b) { return vsubq_f32(a, b); }
inline vf mul(vf a, vf b) { return vmulq_f32(a, b); }
inline vf div(vf a, vf b) { return vdivq_f32(a, b); }
inline vf fmadd(vf a, vf b, vf c) { return vfmaq_f32(c, a, b); }
inline vf fnmadd(vf a, vf b, vf c) { return vfmsq_f32(c, a, b); }
inline vf max(vf a, vf b) { return vmaxq_f32(a, b); }
inline vf min(vf a, vf b) { return vminq_f32(a, b); }
inline float reduce_add(vf v) { return vaddvq_f32(v); }
inline float reduce_max(vf v) { return vmaxvq_f32(v); }
inline vf round_even(vf v) { return vrndnq_f32(v); }
inline vf scale_pow2(vf y, vf n) {
  int32x4_t e = vshlq_n_s32(vaddq_s32(vcvtq_s32_f32(n), vdupq_n_s32(127)), 23);
  return vmulq_f32(y, vreinterpretq_f32_s32(e));
}
inline vf first_lanes(vf v, int64_t n, float fill) {
  const int32_t idx[4] = {0, 1, 2, 3};
  uint32x4_t keep = vcltq_s32(vld1q_s32(idx), vdupq_n_s32((int32_t)std::min<int64_t>(n, 4)));
  return vbslq_f32(keep, v, vdupq_n_f32(fill));
}
inline vf where_lt(vf x, float limit, vf yes, vf no) { return vbslq_f32(vcltq_f32(x, vdupq_n_f32(limit)), yes, no); }
inline vf transpose_sum(const vf* v) { return vpaddq_f32(vpaddq_f32(v[0], v[1]), vpaddq_f32(v[2], v[3])); }

// ---------------------------------------------------------------------------------------------
#else  // SERVESCOPE_ISA_SCALAR: plain C++ over 8 lanes (the compiler may vectorise it for its baseline)
constexpr const char* kIsa = "scalar";
constexpr int W = 8;
struct vf {
  float a[W];
};
template <typename F>
inline vf lanes(F f) {
  vf r;
  for (int i = 0; i < W; ++i) r.a[i] = f(i);
  return r;
}
inline vf zero() { return lanes([](int) { return 0.f; }); }
inline vf set1(float x) { return lanes([x](int) { return x; }); }
inline vf loadn(const float* p, int64_t n) { return lanes([=](int i) { return i < n ? p[i] : 0.f; }); }
inline vf load(const float* p) { return loadn(p, W); }
inline vf loadn(const bf16* p, int64_t n) { return lanes([=](int i) { return i < n ? bf16_to_float(p[i]) : 0.f; }); }
inline vf load(const bf16* p) { return loadn(p, W); }
inline vf loadn(const int8_t* p, int64_t n) { return lanes([=](int i) { return i < n ? (float)p[i] : 0.f; }); }
inline vf load(const int8_t* p) { return loadn(p, W); }
inline void storen(float* p, vf v, int64_t n) {
  for (int i = 0; i < W && i < n; ++i) p[i] = v.a[i];
}
inline void store(float* p, vf v) { storen(p, v, W); }
inline void storen(bf16* p, vf v, int64_t n) {
  for (int i = 0; i < W && i < n; ++i) p[i] = float_to_bf16(v.a[i]);
}
inline void store(bf16* p, vf v) { storen(p, v, W); }
inline vf add(vf a, vf b) { return lanes([&](int i) { return a.a[i] + b.a[i]; }); }
inline vf sub(vf a, vf b) { return lanes([&](int i) { return a.a[i] - b.a[i]; }); }
inline vf mul(vf a, vf b) { return lanes([&](int i) { return a.a[i] * b.a[i]; }); }
inline vf div(vf a, vf b) { return lanes([&](int i) { return a.a[i] / b.a[i]; }); }
// two roundings: std::fma is a library call where the baseline ISA has no FMA instruction
inline vf fmadd(vf a, vf b, vf c) { return lanes([&](int i) { return a.a[i] * b.a[i] + c.a[i]; }); }
inline vf fnmadd(vf a, vf b, vf c) { return lanes([&](int i) { return c.a[i] - a.a[i] * b.a[i]; }); }
inline vf max(vf a, vf b) { return lanes([&](int i) { return std::max(a.a[i], b.a[i]); }); }
inline vf min(vf a, vf b) { return lanes([&](int i) { return std::min(a.a[i], b.a[i]); }); }
inline float reduce_add(vf v) {
  float s = 0.f;
  for (int i = 0; i < W; ++i) s += v.a[i];
  return s;
}
inline float reduce_max(vf v) {
  float s = v.a[0];
  for (int i = 1; i < W; ++i) s = std::max(s, v.a[i]);
  return s;
}
inline vf round_even(vf v) { return lanes([&](int i) { return std::nearbyint(v.a[i]); }); }
inline vf scale_pow2(vf y, vf n) { return lanes([&](int i) { return std::ldexp(y.a[i], (int)n.a[i]); }); }
inline vf first_lanes(vf v, int64_t n, float fill) { return lanes([&](int i) { return i < n ? v.a[i] : fill; }); }
inline vf where_lt(vf x, float limit, vf yes, vf no) {
  return lanes([&](int i) { return x.a[i] < limit ? yes.a[i] : no.a[i]; });
}
inline vf transpose_sum(const vf* v) { return lanes([&](int t) { return reduce_add(v[t]); }); }
#endif

// ---------------------------------------------------------------------------------------------
// Built on the layer above, the same on every ISA.

// exp(x) for float32 lanes (Cephes polynomial, ~1 ulp), exp(-inf) = 0
inline vf vexp(vf x) {
  const vf xc = min(max(x, set1(-104.0f)), set1(88.72f));
  const vf n = round_even(mul(xc, set1(1.44269504088896341f)));
  vf r = fnmadd(n, set1(0.693359375f), xc);
  r = fnmadd(n, set1(-2.12194440e-4f), r);
  vf y = set1(1.9875691500E-4f);
  y = fmadd(y, r, set1(1.3981999507E-3f));
  y = fmadd(y, r, set1(8.3334519073E-3f));
  y = fmadd(y, r, set1(4.1665795894E-2f));
  y = fmadd(y, r, set1(1.6666665459E-1f));
  y = fmadd(y, r, set1(5.0000001201E-1f));
  y = fmadd(y, mul(r, r), add(r, set1(1.0f)));
#if defined(SERVESCOPE_ISA_AVX512)
  return scale_pow2(y, n);  // scalef reaches the denormals and 0
#else
  // 2^n from its exponent bits is exact down to 2^-126; below exp(-87.3) the result is flushed to 0
  return where_lt(xc, -87.3f, zero(), scale_pow2(y, max(n, set1(-126.f))));
#endif
}

// c * tanh(x / c) for float32 lanes (attention soft-capping, c > 0): tanh(y) = sign(y) (1 - e) / (1 + e) with
// e = exp(-2|y|) in (0, 1], which never overflows; within a few ulp of c, absolutely, of torch's tanh
inline vf vsoftcap(vf x, float c) {
  const vf y = mul(x, set1(1.0f / c));
  const vf e = vexp(mul(max(y, sub(zero(), y)), set1(-2.0f)));
  const vf t = mul(div(sub(set1(1.0f), e), add(set1(1.0f), e)), set1(c));
  return where_lt(y, 0.0f, sub(zero(), t), t);
}

// v rounded to T and widened back (the rounding an eager op in dtype T does to its result)
template <typename T>
inline vf rnd(vf v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    alignas(64) bf16 t[W];
    store(t, v);
    return load(t);
  }
}

// grain (rows per task) so that a task has at least ~min_work elements of work
inline int64_t grain_for(int64_t work_per_row, int64_t min_work = 16384) {
  return std::max<int64_t>(1, min_work / std::max<int64_t>(1, work_per_row));
}

inline int64_t num_threads() {
#ifdef SERVESCOPE_TORCH
  return at::get_num_threads();
#else
  return 1;
#endif
}

// fn(i0, i1) over [begin, end) in chunks of at least `grain`, on torch's pool where there is one
template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
#ifdef SERVESCOPE_TORCH
  at::parallel_for(begin, end, grain, fn);
#else
  (void)grain;
  if (begin < end) fn(begin, end);
#endif
}

// Items with cumulative costs cum[0] = 0 .. cum[n] cut into nt contiguous ranges of about equal cost:
// fn(i0, i1) once per worker's range of items [i0, i1).
template <typename F>
inline void parallel_by_cost(const std::vector<int64_t>& cum, int64_t nt, const F& fn) {
  const int64_t items = (int64_t)cum.size() - 1, total = cum.back();
  auto first = [&](int64_t t) -> int64_t {
    return t >= nt ? items : std::lower_bound(cum.begin(), cum.end(), total * t / nt) - cum.begin();
  };
  parallel_for(0, nt, 1, [&](int64_t t0, int64_t t1) { fn(first(t0), first(t1)); });
}

inline void prefetch_l2(const void* p) { __builtin_prefetch(p, 0, 2); }

// f(std::integral_constant<int, n>()) for a run-time n in 1 .. N: register tiles whose height is a
// compile-time constant, so that their loops unroll and their accumulators stay in registers (an
// array indexed at run time lives in memory, every FMA a store and a reload)
template <int N, typename F>
inline void with_count(int64_t n, const F& f) {
  if (n == N)
    f(std::integral_constant<int, N>());
  else if constexpr (N > 1)
    with_count<N - 1>(n, f);
}

// An E8M0 scale byte (MXFP4's per-block 2^(e - 127)) halved, as a float: 2^(e - 128), exact for every e (the
// two smallest are float32 subnormals): MXFP4's e2m1 values are taken doubled, as the integers of
// MXFP4_VALUES (ggml's kvalues_mxfp4 and GGML_E8M0_TO_FP32_HALF); 255 (E8M0's NaN) reads as 2^127
inline float e8m0_half(uint8_t e) {
  const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}
// The e2m1 nibble's value doubled (signed), and the same plus MXFP4_OFFSET (0..24, the unsigned operand of
// the int8 dot products: the activations' sums take the offset back out, as symmetric int4's 8)
alignas(16) constexpr int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
constexpr int32_t MXFP4_OFFSET = 12;
alignas(16) constexpr int8_t MXFP4_UNSIGNED[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};

// ---------------------------------------------------------------------------------------------
// Integer dot products for packed weights (csrc/quant_dot.h), beside the float layer above.
// vb: 4W bytes; vi: W int32 lanes, lane i owning bytes 4i..4i+3 of a vb (the layout VNNI's vpdpbusd,
// NEON's sdot and AVX2's maddubs + madd all share), so the same kernel source runs on every path:
//   dot_u4(acc, u, s)  acc[i] += sum_j u[4i+j] * s[4i+j], u in 0..15 (4-bit weights), s int8
//   dot_s8(acc, w, s)  the same for int8 w (s in -127..127: x86 moves w's sign onto s, |w| unsigned)
//   dot_u4x2(acc, u0, s0, u1, s1)  dot_u4 twice (without VNNI the two int16 pair sums are added first)
//   storeb(p, v)  the 4W bytes of v to p
//   seti(v), bcast4(p)  v in every int32 lane; the 4 bytes at p in every lane (a GEMM's activation quad)
//   dot_s8_biased(acc, w, s)  dot_s8 plus kS8Bias * sum(s): with VNNI, w with its sign bit flipped is
//                      w + 128 as an unsigned byte, one vpdpbusd; the caller starts the sum at -kS8Bias sum(s)
// Where the CPU has them: AVX512-VNNI / AVX-VNNI vpdpbusd, NEON dotprod sdot; otherwise maddubs +
// madd (AVX2 / AVX-512 BW), widening multiplies and pairwise adds (NEON), or plain C++ (scalar).
#if defined(SERVESCOPE_ISA_AVX512)
using vb = __m512i;
using vi = __m512i;
inline vb loadb(const void* p) { return _mm512_loadu_si512(p); }
inline void storeb(void* p, vb v) { _mm512_storeu_si512(p, v); }
inline vb loadbn(const void* p, int64_t n) {
  return _mm512_maskz_loadu_epi8(n >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << n) - 1), p);
}
inline vb low_nibbles(vb v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
inline vb high_nibbles(vb v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
inline vi zeroi() { return _mm512_setzero_si512(); }
inline vi loadi(const int32_t* p) { return _mm512_loadu_si512(p); }
inline vi seti(int32_t v) { return _mm512_set1_epi32(v); }
inline vb bcast4(const int8_t* p) {  // the 4 bytes at p in every lane (vpdpbusd's embedded broadcast)
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}
inline vf to_float(vi v) { return _mm512_cvtepi32_ps(v); }
inline vi dot_u4(vi acc, vb u, vb s) {
#ifdef __AVX512VNNI__
  return _mm512_dpbusd_epi32(acc, u, s);
#else
  return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1)));
#endif
}
inline vi dot_s8(vi acc, vb w, vb s) {
  const __mmask64 neg = _mm512_movepi8_mask(w);
  return dot_u4(acc, _mm512_abs_epi8(w), _mm512_mask_sub_epi8(s, neg, _mm512_setzero_si512(), s));
}
#ifdef __AVX512VNNI__
constexpr int32_t kS8Bias = 128;
inline vi dot_s8_biased(vi acc, vb w, vb s) { return _mm512_dpbusd_epi32(acc, _mm512_xor_si512(w, _mm512_set1_epi8(-128)), s); }
inline vi dot_u4x2(vi acc, vb u0, vb s0, vb u1, vb s1) { return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc, u0, s0), u1, s1); }
#else
constexpr int32_t kS8Bias = 0;
inline vi dot_s8_biased(vi acc, vb w, vb s) { return dot_s8(acc, w, s); }
inline vi dot_u4x2(vi acc, vb u0, vb s0, vb u1, vb s1) {  // pair sums <= 2 * 15 * 127 each: their sum fits int16
  const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(u0, s0), _mm512_maddubs_epi16(u1, s1));
  return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1)));
}
#endif
// Per-block float16 scales spread over the lanes of their blocks: out[t] lane i = float(h[(i / LPB) * S + t])
// for t < S (S = 2: interleaved (d, m) pairs), blocks j < n read (0 past them, nothing read past them)
template <int LPB, int S>
inline void half_lanes(const uint16_t* h, int64_t n, vf* out) {
  if constexpr (LPB >= W) {
    for (int t = 0; t < S; ++t) out[t] = _mm512_set1_ps(_cvtsh_ss(h[t]));
  } else {
    constexpr int B = W / LPB;
    const int64_t cnt = std::min<int64_t>(n, B) * S;
    const __m512 v = _mm512_castps256_ps512(_mm256_cvtph_ps(_mm_maskz_loadu_epi16((__mmask8)((1u << cnt) - 1), h)));
    const __m512i blk = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          LPB == 8 ? 3 : LPB == 4 ? 2 : LPB == 2 ? 1 : 0);
    for (int t = 0; t < S; ++t)
      out[t] = _mm512_permutexvar_ps(_mm512_add_epi32(_mm512_mullo_epi32(blk, _mm512_set1_epi32(S)), _mm512_set1_epi32(t)), v);
  }
}

// 32 floats x * id rounded to int8 (to nearest even, as std::lrint in the default rounding mode) and
// clamped to +-127, stored at q; returns their sum (the activation quantisation of quant_dot.h)

// MXFP4 (quant_dot.h): 16-entry byte table lookup of nibbles idx (0..15) in every 128-bit lane
inline vb lut16(vb idx, const int8_t* table) {
  return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)table)), idx);
}
// Per-block E8M0 scales (MXFP4), halved (e8m0_half) and spread over the lanes of their blocks, blocks j < n
template <int LPB>
inline void e8m0_lanes(const uint8_t* e, int64_t n, vf* out) {
  if constexpr (LPB >= W) {
    out[0] = _mm512_set1_ps(e8m0_half(e[0]));
  } else {
    constexpr int B = W / LPB;
    const int64_t cnt = std::min<int64_t>(n, B);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8((__mmask16)((1u << cnt) - 1), e));
    const __m512i big = _mm512_slli_epi32(_mm512_sub_epi32(v, _mm512_set1_epi32(1)), 23);
    const __m512i small = _mm512_sllv_epi32(_mm512_set1_epi32(0x00200000), v);
    const __m512i bits = _mm512_mask_blend_epi32(_mm512_cmpge_epi32_mask(v, _mm512_set1_epi32(2)), small, big);
    const __m512i blk = _mm512_srli_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                          LPB == 8 ? 3 : LPB == 4 ? 2 : LPB == 2 ? 1 : 0);
    out[0] = _mm512_permutexvar_ps(blk, _mm512_castsi512_ps(bits));
  }
}

inline int32_t round_i8x32(const float* x, float id, int8_t* q) {
  const __m512 s = _mm512_set1_ps(id);
  const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
  const __m512i a = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), s)), lo), hi);
  const __m512i b = _mm512_min_epi32(_mm512_max_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x + 16), s)), lo), hi);
  _mm_storeu_si128((__m128i*)q, _mm512_cvtepi32_epi8(a));
  _mm_storeu_si128((__m128i*)(q + 16), _mm512_cvtepi32_epi8(b));
  return _mm512_reduce_add_epi32(_mm512_add_epi32(a, b));
}

#elif defined(SERVESCOPE_ISA_AVX2)
using vb = __m256i;
using vi = __m256i;
inline vb loadb(const void* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline void storeb(void* p, vb v) { _mm256_storeu_si256((__m256i*)p, v); }
inline vb loadbn(const void* p, int64_t n) {
  if (n >= 32) return loadb(p);
  alignas(32) uint8_t t[32] = {};
  std::memcpy(t, p, n);
  return loadb(t);
}
inline vb low_nibbles(vb v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
inline vb high_nibbles(vb v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
inline vi zeroi() { return _mm256_setzero_si256(); }
inline vi loadi(const int32_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
inline vi seti(int32_t v) { return _mm256_set1_epi32(v); }
inline vb bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}
inline vf to_float(vi v) { return _mm256_cvtepi32_ps(v); }
inline vi dot_u4(vi acc, vb u, vb s) {
#ifdef __AVXVNNI__
  return _mm256_dpbusd_avx_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}
inline vi dot_s8(vi acc, vb w, vb s) { return dot_u4(acc, _mm256_sign_epi8(w, w), _mm256_sign_epi8(s, w)); }
#ifdef __AVXVNNI__
constexpr int32_t kS8Bias = 128;
inline vi dot_s8_biased(vi acc, vb w, vb s) { return _mm256_dpbusd_avx_epi32(acc, _mm256_xor_si256(w, _mm256_set1_epi8(-128)), s); }
inline vi dot_u4x2(vi acc, vb u0, vb s0, vb u1, vb s1) { return dot_u4(dot_u4(acc, u0, s0), u1, s1); }
#else
constexpr int32_t kS8Bias = 0;
inline vi dot_s8_biased(vi acc, vb w, vb s) { return dot_s8(acc, w, s); }
inline vi dot_u4x2(vi acc, vb u0, vb s0, vb u1, vb s1) {  // pair sums <= 2 * 15 * 127 each: their sum fits int16
  const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(u0, s0), _mm256_maddubs_epi16(u1, s1));
  return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
}
#endif
template <int LPB, int S>
inline void half_lanes(const uint16_t* h, int64_t n, vf* out) {
  if constexpr (LPB >= W) {
    for (int t = 0; t < S; ++t) out[t] = _mm256_set1_ps(_cvtsh_ss(h[t]));
  } else {
    constexpr int B = W / LPB;
    static_assert(B * S <= 4, "AVX2: at most 4 halves per vector");
    // whole chunks load their 2 or 4 halves with one load of that width: a zeroed 8 bytes filled by a
    // 4-byte copy and read back whole is a store-forwarding stall per call (it once made symmetric int4
    // several times slower than asymmetric)
    __m128i raw;
    if (n >= B) {
      int32_t w32;
      std::memcpy(&w32, h, sizeof(w32));
      raw = B * S == 4 ? _mm_loadl_epi64((const __m128i*)h) : _mm_cvtsi32_si128(w32);
    } else {  // the row's last, partial chunk
      alignas(16) uint16_t t[8] = {};
      std::memcpy(t, h, n * S * sizeof(uint16_t));
      raw = _mm_load_si128((const __m128i*)t);
    }
    const __m256 v = _mm256_castps128_ps256(_mm_cvtph_ps(raw));
    const __m256i blk = _mm256_srli_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), LPB == 4 ? 2 : LPB == 2 ? 1 : 0);
    for (int t = 0; t < S; ++t)
      out[t] = _mm256_permutevar8x32_ps(v, _mm256_add_epi32(_mm256_mullo_epi32(blk, _mm256_set1_epi32(S)), _mm256_set1_epi32(t)));
  }
}

inline vb lut16(vb idx, const int8_t* table) {
  return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)table)), idx);
}
template <int LPB>
inline void e8m0_lanes(const uint8_t* e, int64_t n, vf* out) {
  if constexpr (LPB >= W) {
    out[0] = _mm256_set1_ps(e8m0_half(e[0]));
  } else {
    constexpr int B = W / LPB;
    static_assert(B <= 4, "AVX2: at most 4 blocks per vector");
    uint32_t raw = 0;
    std::memcpy(&raw, e, std::min<int64_t>(n, B));
    const __m256i v = _mm256_cvtepu8_epi32(_mm_cvtsi32_si128((int)raw));
    const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(v, _mm256_set1_epi32(1)), 23);
    const __m256i small = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), v);
    const __m256i bits = _mm256_blendv_epi8(small, big, _mm256_cmpgt_epi32(v, _mm256_set1_epi32(1)));
    const __m256i blk = _mm256_srli_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0), LPB == 4 ? 2 : LPB == 2 ? 1 : 0);
    out[0] = _mm256_permutevar8x32_ps(_mm256_castsi256_ps(bits), blk);
  }
}

inline int32_t round_i8x32(const float* x, float id, int8_t* q) {
  const __m256 s = _mm256_set1_ps(id);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  __m256i v[4];
  for (int i = 0; i < 4; ++i)
    v[i] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + 8 * i), s)), lo), hi);
  // packs work within 128-bit halves: dwords come out as (v0 v1 v2 v3)[0..3], then [4..7]; put them back in order
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  _mm256_storeu_si256((__m256i*)q, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  const __m256i t = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]), _mm256_add_epi32(v[2], v[3]));
  __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  u = _mm_add_epi32(u, _mm_shuffle_epi32(u, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(u, _mm_shuffle_epi32(u, 0xB1)));
}

#elif defined(SERVESCOPE_ISA_NEON)
using vb = int8x16_t;
using vi = int32x4_t;
inline vb loadb(const void* p) { return vld1q_s8((const int8_t*)p); }
inline void storeb(void* p, vb v) { vst1q_s8((int8_t*)p, v); }
inline vb loadbn(const void* p, int64_t n) {
  if (n >= 16) return loadb(p);
  int8_t t[16] = {};
  std::memcpy(t, p, n);
  return loadb(t);
}
inline vb low_nibbles(vb v) { return vandq_s8(v, vdupq_n_s8(15)); }
inline vb high_nibbles(vb v) { return vreinterpretq_s8_u8(vshrq_n_u8(vreinterpretq_u8_s8(v), 4)); }
inline vi zeroi() { return vdupq_n_s32(0); }
inline vi loadi(const int32_t* p) { return vld1q_s32(p); }
inline vi seti(int32_t v) { return vdupq_n_s32(v); }
inline vb bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return vreinterpretq_s8_s32(vdupq_n_s32(v));
}
inline vf to_float(vi v) { return vcvtq_f32_s32(v); }
inline vi dot_s8(vi acc, vb w, vb s) {
#ifdef __ARM_FEATURE_DOTPROD
  return vdotq_s32(acc, w, s);
#else  // products as int16 (|w s| <= 128 * 127), pairwise sums to int16 (<= 32512), then to int32
  const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(s)), hi = vmull_s8(vget_high_s8(w), vget_high_s8(s));
  return vaddq_s32(acc, vpaddlq_s16(vpaddq_s16(lo, hi)));
#endif
}
inline vi dot_u4(vi acc, vb u, vb s) { return dot_s8(acc, u, s); }  // 0..15 is the same signed
constexpr int32_t kS8Bias = 0;
inline vi dot_s8_biased(vi acc, vb w, vb s) { return dot_s8(acc, w, s); }
inline vi dot_u4x2(vi acc, vb u0, vb s0, vb u1, vb s1) { return dot_u4(dot_u4(acc, u0, s0), u1, s1); }
template <int LPB, int S>
inline void half_lanes(const uint16_t* h, int64_t, vf* out) {
  static_assert(LPB >= W, "NEON: a vector's lanes lie in one block");
  for (int t = 0; t < S; ++t) out[t] = set1(half_to_float(h[t]));
}

inline vb lut16(vb idx, const int8_t* table) { return vqtbl1q_s8(vld1q_s8(table), vreinterpretq_u8_s8(idx)); }
template <int LPB>
inline void e8m0_lanes(const uint8_t* e, int64_t, vf* out) {
  static_assert(LPB >= W, "NEON: a vector's lanes lie in one block");
  out[0] = set1(e8m0_half(e[0]));
}

inline int32_t round_i8x32(const float* x, float id, int8_t* q) {
  int32x4_t tot = vdupq_n_s32(0);
  for (int i = 0; i < 32; i += 8) {  // vcvtnq: to nearest, ties to even
    const int32x4_t a = vmaxq_s32(vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + i), id)), vdupq_n_s32(127)), vdupq_n_s32(-127));
    const int32x4_t b = vmaxq_s32(vminq_s32(vcvtnq_s32_f32(vmulq_n_f32(vld1q_f32(x + i + 4), id)), vdupq_n_s32(127)), vdupq_n_s32(-127));
    tot = vaddq_s32(tot, vaddq_s32(a, b));
    vst1_s8(q + i, vqmovn_s16(vcombine_s16(vqmovn_s32(a), vqmovn_s32(b))));
  }
  return vaddvq_s32(tot);
}

#else  // scalar
struct vb {
  int8_t b[4 * W];
};
struct vi {
  int32_t a[W];
};
inline vb loadbn(const void* p, int64_t n) {
  vb v{};
  std::memcpy(v.b, p, std::min<int64_t>(n, 4 * W));
  return v;
}
inline vb loadb(const void* p) { return loadbn(p, 4 * W); }
inline void storeb(void* p, vb v) { std::memcpy(p, v.b, 4 * W); }
inline vb low_nibbles(vb v) {
  for (auto& x : v.b) x = (int8_t)(x & 15);
  return v;
}
inline vb high_nibbles(vb v) {
  for (auto& x : v.b) x = (int8_t)(((uint8_t)x) >> 4);
  return v;
}
inline vi zeroi() { return vi{}; }
inline vi loadi(const int32_t* p) {
  vi v;
  std::memcpy(v.a, p, sizeof(v.a));
  return v;
}
inline vi seti(int32_t v) {
  vi r;
  for (auto& x : r.a) x = v;
  return r;
}
inline vb bcast4(const int8_t* p) {
  vb r;
  for (int i = 0; i < 4 * W; ++i) r.b[i] = p[i % 4];
  return r;
}
inline vf to_float(vi v) { return lanes([&](int i) { return (float)v.a[i]; }); }
inline vi dot_s8(vi acc, vb w, vb s) {
  for (int i = 0; i < W; ++i)
    for (int j = 0; j < 4; ++j) acc.a[i] += (int32_t)w.b[4 * i + j] * s.b[4 * i + j];
  return acc;
}
inline vi dot_u4(vi acc, vb u, vb s) { return dot_s8(acc, u, s); }
constexpr int32_t kS8Bias = 0;
inline vi dot_s8_biased(vi acc, vb w, vb s) { return dot_s8(acc, w, s); }
inline vi dot_u4x2(vi acc, vb u0, vb s0, vb u1, vb s1) { return dot_u4(dot_u4(acc, u0, s0), u1, s1); }
template <int LPB, int S>
inline void half_lanes(const uint16_t* h, int64_t n, vf* out) {
  for (int t = 0; t < S; ++t) out[t] = lanes([&](int i) { return i / LPB < n ? half_to_float(h[(i / LPB) * S + t]) : 0.f; });
}
inline vb lut16(vb idx, const int8_t* table) {
  for (auto& x : idx.b) x = table[x & 15];
  return idx;
}
template <int LPB>
inline void e8m0_lanes(const uint8_t* e, int64_t n, vf* out) {
  out[0] = lanes([&](int i) { return i / LPB < n ? e8m0_half(e[i / LPB]) : 0.f; });
}
inline int32_t round_i8x32(const float* x, float id, int8_t* q) {
  int32_t sum = 0;
  for (int k = 0; k < 32; ++k) {
    q[k] = (int8_t)std::max(-127L, std::min(127L, std::lrint(x[k] * id)));
    sum += q[k];
  }
  return sum;
}
#endif

// max |x| of 32 floats
inline float absmax32(const float* x) {
  vf m = zero();
  for (int i = 0; i < 32; i += W) {
    const vf v = load(x + i);
    m = max(m, max(v, sub(zero(), v)));
  }
  return reduce_max(m);
}

}  // namespace servescope_simd
