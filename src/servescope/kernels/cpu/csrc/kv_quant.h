// The quantised KV cache's rows as the attention kernels read them (torch-free, like simd.h).
//
// A cache of int8 or fp8 e4m3 elements is [N, S, Hkv, D + 4]: for each position and KV head, the D
// quantised values, then the 4 bytes of their float32 scale (value = q * scale; written by store_kv,
// model/attention/kv_quant.py describes the format). The kernels take the cache's element type C
// and derive the row pitch from it, so a float cache (pitch D, scale 1) runs the very same code.
#pragma once

#include "simd.h"

namespace servescope_simd {

// float8 e4m3 ("fn": bias 7, no infinities, 0x7F / 0xFF are NaN; torch.float8_e4m3fn) as stored
struct fp8e4m3 {
  uint8_t bits;
};

// e4m3 -> float32 without a table: the exponent and mantissa bits moved into float32's place read
// as 2^(e-127) (1 + m/8) (or the denormal 2^-126 m/8 for e = 0); times 2^120 that is e4m3's value
// 2^(e-7) (1 + m/8) (or 2^-6 m/8), exactly. The vector loads below do the same lane by lane.
inline float fp8_to_float(fp8e4m3 x) {
  const uint32_t em = (uint32_t)(x.bits & 0x7F) << 20;
  float f;
  std::memcpy(&f, &em, 4);
  f *= 0x1p120f;
  return (x.bits & 0x80) ? -f : f;
}

#if defined(SERVESCOPE_ISA_AVX512)
inline vf widen_fp8(__m512i b) {  // one e4m3 byte per 32-bit lane
  const __m512i em = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
  const __m512i sg = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(em), _mm512_set1_ps(0x1p120f));
  return _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(f), sg));
}
inline vf loadn(const fp8e4m3* p, int64_t n) { return widen_fp8(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(tail(n), p))); }
inline vf load(const fp8e4m3* p) { return widen_fp8(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p))); }
#elif defined(SERVESCOPE_ISA_AVX2)
inline vf widen_fp8(__m256i b) {
  const __m256i em = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sg = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(em), _mm256_set1_ps(0x1p120f));
  return _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(f), sg));
}
inline vf load(const fp8e4m3* p) { return widen_fp8(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p))); }
inline vf loadn(const fp8e4m3* p, int64_t n) {
  if (n >= 8) return load(p);
  alignas(16) uint8_t t[16] = {};
  std::memcpy(t, p, n);
  return load((const fp8e4m3*)t);
}
#elif defined(SERVESCOPE_ISA_NEON)
inline vf widen_fp8(uint32x4_t b) {
  const uint32x4_t em = vshlq_n_u32(vandq_u32(b, vdupq_n_u32(0x7F)), 20);
  const uint32x4_t sg = vshlq_n_u32(vandq_u32(b, vdupq_n_u32(0x80)), 24);
  const float32x4_t f = vmulq_f32(vreinterpretq_f32_u32(em), vdupq_n_f32(0x1p120f));
  return vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(f), sg));
}
inline vf load(const fp8e4m3* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return widen_fp8(vmovl_u16(vget_low_u16(vmovl_u8(vreinterpret_u8_u32(vdup_n_u32(w))))));
}
inline vf loadn(const fp8e4m3* p, int64_t n) {
  if (n >= 4) return load(p);
  uint8_t t[4] = {0, 0, 0, 0};
  std::memcpy(t, p, n);
  return load((const fp8e4m3*)t);
}
#else
inline vf loadn(const fp8e4m3* p, int64_t n) { return lanes([=](int i) { return i < n ? fp8_to_float(p[i]) : 0.f; }); }
inline vf load(const fp8e4m3* p) { return loadn(p, W); }
#endif

// element types whose rows carry a scale, and the elements (bytes) the scale adds to a row
template <typename C>
inline constexpr bool kQuantKV = std::is_same_v<C, int8_t> || std::is_same_v<C, fp8e4m3>;
template <typename C>
inline constexpr int64_t kScalePad = kQuantKV<C> ? 4 : 0;

// the scale of the row of D values at `row` (1 for a float cache: multiplying by it changes nothing)
template <typename C>
inline float row_scale(const C* row, int64_t d) {
  if constexpr (kQuantKV<C>) {
    float s;
    std::memcpy(&s, row + d, sizeof(s));
    return s;
  } else {
    (void)row;
    (void)d;
    return 1.0f;
  }
}

inline float to_float(float x) { return x; }
inline float to_float(bf16 x) { return bf16_to_float(x); }

// float32 -> e4m3 ("fn"), round to nearest even, as c10::Float8_e4m3fn converts (beyond 448 -> NaN;
// the store never goes there: rows are scaled to at most 448)
inline fp8e4m3 float_to_fp8(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint32_t sign = u & 0x80000000u;
  u ^= sign;
  uint8_t r;
  if (u >= (1087u << 20)) {  // 480 and above (or NaN): no e4m3 value
    r = 0x7F;
  } else if (u < (121u << 23)) {  // below 2^-6: an e4m3 denormal (or 0); the float addition rounds it
    const uint32_t denorm = 141u << 23;
    float a, m;
    std::memcpy(&a, &u, 4);
    std::memcpy(&m, &denorm, 4);
    a += m;
    uint32_t ab;
    std::memcpy(&ab, &a, 4);
    r = (uint8_t)(ab - denorm);
  } else {  // rebias the exponent, round the mantissa to 3 bits (ties to even)
    const uint32_t odd = (u >> 20) & 1u;
    u += ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + odd;
    r = (uint8_t)(u >> 20);
  }
  return fp8e4m3{(uint8_t)(r | (sign >> 24))};
}

// One row of D values (one token, one KV head) into a quantised cache row: the D values x / s, then s =
// absmax / qmax (127 for int8, rounded half to even; 448 for e4m3) as 4 bytes. The same arithmetic as
// model/attention/kv_quant.quantize_rows (IEEE division, then rounding), so both write the same bytes.
template <typename C, typename X>
inline void quantize_row(const X* x, int64_t d, C* dst) {
  static_assert(kQuantKV<C>, "quantize_row: an int8 or fp8 row");
  constexpr float qmax = std::is_same_v<C, int8_t> ? 127.0f : 448.0f;
  float amax = 0.f;
  for (int64_t j = 0; j < d; ++j) amax = std::max(amax, std::fabs(to_float(x[j])));
  const float s = amax / qmax, div = s > 0.f ? s : 1.0f;
  for (int64_t j = 0; j < d; ++j) {
    const float y = std::min(std::max(to_float(x[j]) / div, -qmax), qmax);
    if constexpr (std::is_same_v<C, int8_t>)
      dst[j] = (int8_t)std::nearbyint(y);
    else
      dst[j] = float_to_fp8(y);
  }
  std::memcpy(dst + d, &s, sizeof(s));
}

}  // namespace servescope_simd
