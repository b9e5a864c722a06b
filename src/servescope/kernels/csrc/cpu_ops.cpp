// The small per-layer ops of decode on the CPU, one C++ call each: rms_norm, add_rms_norm, rotary,
// silu_mul, store_kv and paged decode attention.
//
// Why: at batch 1 each of these is 3..14 eager PyTorch ops of 3-10 us of dispatch overhead apiece
// over a few hundred numbers; a decoder layer spent more time in that overhead than in arithmetic.
// Numerics follow the torch references in fused_ops.py / attention/torch_ref.py: math in float32,
// intermediate roundings to the tensor dtype (bfloat16) where the reference has them. Built with
// -ffp-contract=off so that the element-wise ops round like the eager ones (explicit FMAs only
// in reductions). Rows are split over torch's thread pool (at::parallel_for) only when there is
// enough work to pay for waking it.
#include "simd.h"

namespace {

using namespace servescope_simd;

// ---------------------------------------------------------------------------------------------
// rms_norm / add_rms_norm. Reference: xf = x.float(); xf *= rsqrt(mean(xf^2) + eps);
// y = w * xf.to(dtype); with a residual, x := x + residual (in dtype) first, also returned.
template <typename T>
void norm_rows(const T* x, int64_t xs, const T* r, int64_t rs, T* h, T* y, const T* w, int64_t rows, int64_t n,
               float eps) {
  at::parallel_for(0, rows, grain_for(n), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      const T* xi = x + i * xs;
      T* yi = y + i * n;
      __m512 acc = _mm512_setzero_ps();
      if (r) {
        const T* ri = r + i * rs;
        T* hi = h + i * n;
        for (int64_t k = 0; k < n; k += 16) {
          __mmask16 m = tail_mask(n - k);
          __m512 v = rnd<T>(_mm512_add_ps(ld(xi + k, m), ld(ri + k, m)));
          st(hi + k, v, m);
          acc = _mm512_fmadd_ps(v, v, acc);
        }
        xi = hi;
      } else {
        for (int64_t k = 0; k < n; k += 16) {
          __m512 v = ld(xi + k, tail_mask(n - k));
          acc = _mm512_fmadd_ps(v, v, acc);
        }
      }
      float inv = 1.0f / std::sqrt(_mm512_reduce_add_ps(acc) / (float)n + eps);
      __m512 iv = _mm512_set1_ps(inv);
      for (int64_t k = 0; k < n; k += 16) {
        __mmask16 m = tail_mask(n - k);
        __m512 v = rnd<T>(_mm512_mul_ps(ld(xi + k, m), iv));
        st(yi + k, _mm512_mul_ps(ld(w + k, m), v), m);
      }
    }
  });
}

// x [R, n] with unit stride in the last dim (a row stride is allowed), else made contiguous
torch::Tensor rows2d(const torch::Tensor& x) {
  int64_t n = x.size(-1);
  if (x.dim() == 2 && x.stride(1) == 1) return x;
  return x.contiguous().view({-1, n});
}

std::vector<torch::Tensor> norm_common(torch::Tensor x, c10::optional<torch::Tensor> residual, torch::Tensor w,
                                       double eps) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(), "rms_norm: weight shape");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: weight dtype must match x");
  auto x2 = rows2d(x);
  int64_t rows = x2.size(0), n = x2.size(1);
  auto y = torch::empty(x.sizes(), x.options());
  torch::Tensor h, r2;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "add_rms_norm: residual");
    r2 = rows2d(*residual);
    h = torch::empty(x.sizes(), x.options());
  }
  if (x.scalar_type() == torch::kFloat32) {
    norm_rows<float>(x2.data_ptr<float>(), x2.stride(0), residual ? r2.data_ptr<float>() : nullptr,
                     residual ? r2.stride(0) : 0, residual ? h.data_ptr<float>() : nullptr, y.data_ptr<float>(),
                     w.data_ptr<float>(), rows, n, (float)eps);
  } else if (x.scalar_type() == torch::kBFloat16) {
    norm_rows<bf16>(x2.data_ptr<bf16>(), x2.stride(0), residual ? r2.data_ptr<bf16>() : nullptr,
                    residual ? r2.stride(0) : 0, residual ? h.data_ptr<bf16>() : nullptr, y.data_ptr<bf16>(),
                    w.data_ptr<bf16>(), rows, n, (float)eps);
  } else {
    TORCH_CHECK(false, "rms_norm: float32 or bfloat16 only");
  }
  if (residual) return {y, h};
  return {y};
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) { return norm_common(x, c10::nullopt, w, eps)[0]; }

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  return norm_common(x, residual, w, eps);
}

// ---------------------------------------------------------------------------------------------
// rotary, rotate-half: out = cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin), float32 math.
template <typename T>
void rotary_impl(const torch::Tensor& q, const torch::Tensor& k, torch::Tensor& qo, torch::Tensor& ko,
                 const float* cos, const float* sin, int64_t cs) {
  int64_t t = q.size(0), hq = q.size(1), hk = k.size(1), d = q.size(2), half = d / 2;
  const T* qp = q.data_ptr<T>();
  const T* kp = k.data_ptr<T>();
  T* qop = qo.data_ptr<T>();
  T* kop = ko.data_ptr<T>();
  int64_t qs0 = q.stride(0), qs1 = q.stride(1), ks0 = k.stride(0), ks1 = k.stride(1);
  int64_t heads = hq + hk;
  at::parallel_for(0, t * heads, grain_for(d), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      int64_t ti = r / heads, hi = r % heads;
      const T* src;
      T* dst;
      if (hi < hq) {
        src = qp + ti * qs0 + hi * qs1;
        dst = qop + (ti * hq + hi) * d;
      } else {
        src = kp + ti * ks0 + (hi - hq) * ks1;
        dst = kop + (ti * hk + hi - hq) * d;
      }
      const float* c = cos + ti * cs;
      const float* s = sin + ti * cs;
      for (int64_t j = 0; j < half; j += 16) {
        __mmask16 m = tail_mask(half - j);
        __m512 x1 = ld(src + j, m), x2 = ld(src + half + j, m);
        __m512 cv = _mm512_maskz_loadu_ps(m, c + j), sv = _mm512_maskz_loadu_ps(m, s + j);
        st(dst + j, _mm512_sub_ps(_mm512_mul_ps(x1, cv), _mm512_mul_ps(x2, sv)), m);
        st(dst + half + j, _mm512_add_ps(_mm512_mul_ps(x2, cv), _mm512_mul_ps(x1, sv)), m);
      }
    }
  });
}

// q [T, H, D], k [T, Hkv, D] (any strides with a unit last stride), cos, sin [T, 1, D/2] float32
std::vector<torch::Tensor> rotary(torch::Tensor q, torch::Tensor k, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary: shapes");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary: q, k dtype");
  TORCH_CHECK(cos.scalar_type() == torch::kFloat32 && sin.scalar_type() == torch::kFloat32, "rotary: cos/sin float32");
  int64_t t = q.size(0), half = q.size(2) / 2;
  if (q.stride(2) != 1) q = q.contiguous();
  if (k.stride(2) != 1) k = k.contiguous();
  auto c2 = cos.reshape({t, half});
  auto s2 = sin.reshape({t, half});
  if (c2.stride(1) != 1) c2 = c2.contiguous();
  if (s2.stride(1) != 1 || s2.stride(0) != c2.stride(0)) {
    c2 = c2.contiguous();
    s2 = s2.contiguous();
  }
  auto qo = torch::empty(q.sizes(), q.options());
  auto ko = torch::empty(k.sizes(), k.options());
  if (q.scalar_type() == torch::kFloat32)
    rotary_impl<float>(q, k, qo, ko, c2.data_ptr<float>(), s2.data_ptr<float>(), c2.stride(0));
  else if (q.scalar_type() == torch::kBFloat16)
    rotary_impl<bf16>(q, k, qo, ko, c2.data_ptr<float>(), s2.data_ptr<float>(), c2.stride(0));
  else
    TORCH_CHECK(false, "rotary: float32 or bfloat16 only");
  return {qo, ko};
}

// ---------------------------------------------------------------------------------------------
// silu_mul: [T, 2I] -> [T, I], silu(g) = g / (1 + exp(-g)), then * up (each rounded to dtype).
template <typename T>
void silu_mul_impl(const T* x, int64_t xs, T* y, int64_t rows, int64_t inner) {
  at::parallel_for(0, rows, grain_for(inner), [&](int64_t r0, int64_t r1) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = r0; i < r1; ++i) {
      const T* g = x + i * xs;
      const T* u = g + inner;
      T* o = y + i * inner;
      for (int64_t j = 0; j < inner; j += 16) {
        __mmask16 m = tail_mask(inner - j);
        __m512 gv = ld(g + j, m);
        __m512 e = exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv));
        __m512 s = rnd<T>(_mm512_div_ps(gv, _mm512_add_ps(one, e)));
        st(o + j, _mm512_mul_ps(s, ld(u + j, m)), m);
      }
    }
  });
}

torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_mul: last dim must be even");
  auto x2 = rows2d(x);
  int64_t rows = x2.size(0), inner = x2.size(1) / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = inner;
  auto y = torch::empty(sizes, x.options());
  if (x.scalar_type() == torch::kFloat32)
    silu_mul_impl<float>(x2.data_ptr<float>(), x2.stride(0), y.data_ptr<float>(), rows, inner);
  else if (x.scalar_type() == torch::kBFloat16)
    silu_mul_impl<bf16>(x2.data_ptr<bf16>(), x2.stride(0), y.data_ptr<bf16>(), rows, inner);
  else
    TORCH_CHECK(false, "silu_mul: float32 or bfloat16 only");
  return y;
}

// ---------------------------------------------------------------------------------------------
// store_kv: cache.view(N*S, Hkv, D)[slot[t]] = src[t] (converted to the cache dtype)
template <typename S, typename C>
void copy_rows(const S* src, int64_t s0, int64_t s1, C* cache, const int64_t* slots, int64_t t, int64_t hkv,
               int64_t d) {
  at::parallel_for(0, t, grain_for(hkv * d, 65536), [&](int64_t r0, int64_t r1) {
    for (int64_t i = r0; i < r1; ++i) {
      C* dst = cache + slots[i] * hkv * d;
      for (int64_t h = 0; h < hkv; ++h) {
        const S* sp = src + i * s0 + h * s1;
        C* dp = dst + h * d;
        if constexpr (std::is_same<S, C>::value) {
          std::memcpy(dp, sp, d * sizeof(C));
        } else {
          for (int64_t j = 0; j < d; j += 16) {
            __mmask16 m = tail_mask(d - j);
            st(dp + j, ld(sp + j, m), m);
          }
        }
      }
    }
  });
}

template <typename C>
void store_one(torch::Tensor src, torch::Tensor cache, const int64_t* slots) {
  int64_t t = src.size(0), hkv = src.size(1), d = src.size(2);
  if (src.stride(2) != 1) src = src.contiguous();
  if (src.scalar_type() == torch::kFloat32)
    copy_rows<float, C>(src.data_ptr<float>(), src.stride(0), src.stride(1), cache.data_ptr<C>(), slots, t, hkv, d);
  else if (src.scalar_type() == torch::kBFloat16)
    copy_rows<bf16, C>(src.data_ptr<bf16>(), src.stride(0), src.stride(1), cache.data_ptr<C>(), slots, t, hkv, d);
  else
    TORCH_CHECK(false, "store_kv: k/v float32 or bfloat16 only");
}

void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "store_kv: shapes");
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) == k_cache.size(3) && v.sizes() == k.sizes() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: shapes");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == k.size(0),
              "store_kv: slot_mapping int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (k_cache.scalar_type() == torch::kFloat32) {
    store_one<float>(k, k_cache, sp);
    store_one<float>(v, v_cache, sp);
  } else if (k_cache.scalar_type() == torch::kBFloat16) {
    store_one<bf16>(k, k_cache, sp);
    store_one<bf16>(v, v_cache, sp);
  } else {
    TORCH_CHECK(false, "store_kv: cache float32 or bfloat16 only");
  }
}

// ---------------------------------------------------------------------------------------------
// paged decode attention: one query per sequence over its cached keys, read in place from the
// blocks. One task per (sequence, KV head): the G = H/Hkv query heads of the group share each
// K and V row (loaded once). Online softmax over chunks of up to CH positions within a block.
constexpr int64_t CH = 32;
constexpr int64_t HT = 8;  // query heads per register tile

template <typename Q, typename C>
void decode_impl(const Q* q, int64_t qs0, int64_t qs1, const C* kc, const C* vc, int64_t S, int64_t hkv, int64_t d,
                 const int32_t* bt, int64_t bts, const int32_t* cl, int64_t b, int64_t h, float scale, Q* out,
                 int64_t os0, int64_t os1) {
  const int64_t g = h / hkv;
  const int64_t row = hkv * d;  // elements between consecutive positions of one head in the cache
  int64_t max_ctx = 1;
  for (int64_t i = 0; i < b; ++i) max_ctx = std::max<int64_t>(max_ctx, cl[i]);
  at::parallel_for(0, b * hkv, grain_for(max_ctx * g * d, 32768), [&](int64_t i0, int64_t i1) {
    std::vector<float> buf(2 * g * d + g * CH + 2 * g);
    float* qf = buf.data();         // [G, D] queries in float32
    float* acc = qf + g * d;        // [G, D] running sum of p * v
    float* sc = acc + g * d;        // [G, CH] scores / probabilities of the chunk
    float* mx = sc + g * CH;        // [G] running max
    float* den = mx + g;            // [G] running sum of p
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t bi = item / hkv, kh = item % hkv;
      for (int64_t i = 0; i < g; ++i) {
        const Q* qi = q + bi * qs0 + (kh * g + i) * qs1;
        for (int64_t j = 0; j < d; j += 16) {
          __mmask16 m = tail_mask(d - j);
          _mm512_mask_storeu_ps(qf + i * d + j, m, ld(qi + j, m));
        }
        mx[i] = -std::numeric_limits<float>::infinity();
        den[i] = 0.f;
      }
      std::fill(acc, acc + g * d, 0.f);
      const int64_t ctx = cl[bi];
      const int32_t* table = bt + bi * bts;
      for (int64_t p = 0; p < ctx;) {
        const int64_t blk = table[p / S], off = p % S;
        const int64_t n = std::min<int64_t>({CH, S - off, ctx - p});
        const C* kb = kc + ((blk * S + off) * hkv + kh) * d;
        const C* vb = vc + ((blk * S + off) * hkv + kh) * d;
        // scores[i][t] = scale * q_i . k_t
        for (int64_t t = 0; t < n; ++t) {
          const C* kr = kb + t * row;
          for (int64_t i0h = 0; i0h < g; i0h += HT) {
            const int64_t nh = std::min<int64_t>(HT, g - i0h);
            __m512 a[HT];
            for (int64_t i = 0; i < nh; ++i) a[i] = _mm512_setzero_ps();
            for (int64_t j = 0; j < d; j += 16) {
              __mmask16 m = tail_mask(d - j);
              __m512 kv = ld(kr + j, m);
              for (int64_t i = 0; i < nh; ++i)
                a[i] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qf + (i0h + i) * d + j), kv, a[i]);
            }
            for (int64_t i = 0; i < nh; ++i) sc[(i0h + i) * CH + t] = _mm512_reduce_add_ps(a[i]) * scale;
          }
        }
        // online softmax: rescale the running sums by exp(old max - new max)
        for (int64_t i = 0; i < g; ++i) {
          float* s = sc + i * CH;
          float cmax = s[0];
          for (int64_t t = 1; t < n; ++t) cmax = std::max(cmax, s[t]);
          const float mnew = std::max(mx[i], cmax);
          const float corr = std::exp(mx[i] - mnew);
          mx[i] = mnew;
          __m512 sum = _mm512_setzero_ps();
          for (int64_t t = 0; t < n; t += 16) {
            __mmask16 m = tail_mask(n - t);
            __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), _mm512_set1_ps(mnew)));
            e = _mm512_maskz_mov_ps(m, e);
            _mm512_mask_storeu_ps(s + t, m, e);
            sum = _mm512_add_ps(sum, e);
          }
          den[i] = den[i] * corr + _mm512_reduce_add_ps(sum);
          if (corr != 1.0f) {
            __m512 cv = _mm512_set1_ps(corr);
            float* ai = acc + i * d;
            for (int64_t j = 0; j < d; j += 16) {
              __mmask16 m = tail_mask(d - j);
              _mm512_mask_storeu_ps(ai + j, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, ai + j), cv));
            }
          }
        }
        // acc_i += sum_t p[i][t] * v_t
        for (int64_t t = 0; t < n; ++t) {
          const C* vr = vb + t * row;
          for (int64_t j = 0; j < d; j += 16) {
            __mmask16 m = tail_mask(d - j);
            __m512 vv = ld(vr + j, m);
            for (int64_t i = 0; i < g; ++i) {
              float* ai = acc + i * d + j;
              _mm512_mask_storeu_ps(ai, m, _mm512_fmadd_ps(_mm512_set1_ps(sc[i * CH + t]), vv,
                                                           _mm512_maskz_loadu_ps(m, ai)));
            }
          }
        }
        p += n;
      }
      for (int64_t i = 0; i < g; ++i) {
        Q* o = out + bi * os0 + (kh * g + i) * os1;
        __m512 inv = _mm512_set1_ps(den[i] > 0.f ? 1.0f / den[i] : 0.f);
        for (int64_t j = 0; j < d; j += 16) {
          __mmask16 m = tail_mask(d - j);
          st(o + j, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, acc + i * d + j), inv), m);
        }
      }
    }
  });
}

// The same attention for head dims 64 and 128 (NJ = D / 16 vectors per row), arranged so that the
// arithmetic stays in registers: keys are taken 16 at a time (within one KV block), converted once
// to float32 in a scratch tile (bfloat16 queries and caches skip that: VDPBF16PS multiplies the raw
// pairs, for q.k and for p.v), each query head's 16 dot products are summed across lanes together
// (reduce16: 45 shuffles/adds instead of 16 full horizontal sums), and the p * v accumulation of a
// tile of HT heads (HT * NJ = 16 accumulators) runs in registers over the 16 keys. Measured at
// batch 64, context ~400, SmolLM2 bfloat16: see docs/BENCHMARKS.md.

// r[t] = sum of the 16 lanes of v[t], t < 16
inline __m512 reduce16(__m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // 32-bit interleave: per 128-bit lane [v0+v2, w0+w2, v1+v3, w1+w3]
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // 64-bit interleave: per 128-bit lane the partial sums of 4 keys in order
    __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
    b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // pairs of 128-bit lanes
    c[i] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

template <typename C, int NJ>
inline const float* rows_f32(const C* src, int64_t stride, int64_t n, float* tile, int64_t* lds) {
  // n rows of D = 16 NJ elements at `stride` -> float32; float32 rows are used in place
  if constexpr (std::is_same_v<C, float>) {
    *lds = stride;
    return src;
  } else {
    for (int64_t t = 0; t < n; ++t)
      for (int j = 0; j < NJ; ++j) _mm512_storeu_ps(tile + t * 16 * NJ + 16 * j, ld(src + t * stride + 16 * j, 0xFFFF));
    *lds = 16 * NJ;
    return tile;
  }
}

// Prefetch distance in positions, into L2 (T1). Measured at batch 64, context 300-600, SmolLM2's
// heads, the KV cache in memory (not in cache, as in a real step): 3-15% faster than none into L1
// (T0), and T1 another 10-16% faster than T0 (T2 the same as T1, NTA slower); 32 about 16.
constexpr int64_t PF = 32;

template <typename Q, typename C, int NJ>
void decode_fast(const Q* q, int64_t qs0, int64_t qs1, const C* kc, const C* vc, int64_t S, int64_t hkv,
                 const int32_t* bt, int64_t bts, const int32_t* cl, int64_t b, int64_t h, float scale, Q* out,
                 int64_t os0, int64_t os1) {
  constexpr int D = 16 * NJ, HT = 16 / NJ;
  // bfloat16 queries and keys: the scores come from VDPBF16PS on the raw pairs (products of two
  // bfloat16 are exact in float32, summed in float32), with no float32 copy of the keys
#ifdef __AVX512BF16__
  constexpr bool kDot = std::is_same_v<Q, bf16> && std::is_same_v<C, bf16>;
#else
  constexpr bool kDot = false;
#endif
  const int64_t g = h / hkv, row = hkv * D;
  // An item is a sequence with all its KV heads (each block's keys and values are read whole, front
  // to back: 3-10% faster in float32 at batch 64 with the cache in memory than items of one KV head,
  // neutral in bfloat16) or, with fewer than two sequences per thread, a part of a sequence's context
  // (flash-decoding: the parts' partial softmax sums are merged at the end; at batch 1 this keeps
  // both threads busy on whole blocks, where items of one KV head split 3 heads 2:1). Items cost in
  // proportion to their context: split them into one contiguous range per thread of about equal
  // total context (an equal count of items left one thread with the long sequences of a mixed
  // batch: 3-12% slower at batch 8-34), and stay on one thread when the whole step is small.
  const int64_t nthreads = at::get_num_threads();
  const int64_t parts = b >= 2 * nthreads ? 1 : (2 * nthreads + b - 1) / b;  // context parts per sequence
  const int64_t items = b * parts;
  // item -> [p0, p1) of its sequence's context; parts cut at multiples of 16 positions
  auto range_of = [&](int64_t it, int64_t* p0, int64_t* p1) {
    const int64_t ctx = cl[it / parts], j = it % parts, per = (ctx + 16 * parts - 1) / (16 * parts) * 16;
    *p0 = std::min(ctx, j * per);
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
    std::vector<float> buf(2 * h * D + 16 * h + 2 * h + 2 * 16 * D);
    float* qf = buf.data();     // [H, D] queries in float32, pre-scaled
    float* acc_ = qf + h * D;  // [H, D] running sum of p * v
    float* pr_ = acc_ + h * D; // [H, 16] probabilities of the current keys
    float* mx_ = pr_ + 16 * h; // [H] running max
    float* den_ = mx_ + h;     // [H] running sum of p
    float* kt = den_ + h;      // [16, D] keys in float32 (bfloat16 caches)
    float* vt = kt + 16 * D;    // [16, D] values
    std::vector<bf16> qb_(kDot ? h * D : 0);  // [H, D] queries as they are (bfloat16), for the pair dot products
    std::vector<bf16> pb_(kDot ? h * 16 : 0);  // [H, 16] probabilities rounded to bfloat16 (p * v pairs)
    // where the keys of item `it` at position `pos` are (block row offset, in rows of D elements), and
    // how many of its keys from there are in this tile (0 past the item's end)
    auto tile_at = [&](int64_t it, int64_t pos, int64_t* n) -> int64_t {
      const int64_t bi = it / parts;
      int64_t p0, p1;
      range_of(it, &p0, &p1);
      *n = 0;
      if (pos >= p1) return 0;
      const int64_t blk = bt[bi * bts + pos / S], off = pos % S;
      *n = std::min<int64_t>({16, S - off, p1 - pos});
      return (blk * S + off) * hkv;
    };
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t bi = item / parts;
      for (int64_t i = 0; i < h; ++i) {  // query head i of the sequence
        const Q* qi = q + bi * qs0 + i * qs1;
        if constexpr (kDot)  // the pair products read q as it is; the float32 copy is not needed
          std::memcpy(qb_.data() + i * D, qi, D * sizeof(bf16));
        else
          for (int j = 0; j < NJ; ++j)
            _mm512_storeu_ps(qf + i * D + 16 * j, _mm512_mul_ps(ld(qi + 16 * j, 0xFFFF), _mm512_set1_ps(scale)));
        mx_[i] = -std::numeric_limits<float>::infinity();
        den_[i] = 0.f;
      }
      std::fill(acc_, acc_ + h * D, 0.f);
      int64_t p_begin, p_end;
      range_of(item, &p_begin, &p_end);
      for (int64_t p = p_begin; p < p_end;) {
        int64_t n = 0;
        const int64_t r0 = tile_at(item, p, &n);
        const __mmask16 valid = tail_mask(n);
        // The blocks of a sequence lie anywhere in the cache, so the hardware prefetcher cannot
        // guess the next one: ask for the keys and values PF positions ahead (the next item's first
        // ones near the end of this one) while this tile computes.
        {
          int64_t pn = 0, pr0 = tile_at(item, p + PF, &pn);
          if (pn == 0 && item + 1 < i1) {
            int64_t q0, q1;
            range_of(item + 1, &q0, &q1);
            pr0 = tile_at(item + 1, q0 + p + PF - p_end, &pn);
          }
          for (int64_t t = 0; t < pn; ++t) {
            const char* kp = (const char*)(kc + (pr0 + t * hkv) * D);
            const char* vp = (const char*)(vc + (pr0 + t * hkv) * D);
            for (int64_t cb = 0; cb < (int64_t)(hkv * D * sizeof(C)); cb += 64) {
              _mm_prefetch(kp + cb, _MM_HINT_T1);
              _mm_prefetch(vp + cb, _MM_HINT_T1);
            }
          }
        }
        for (int64_t kl = 0; kl < hkv; ++kl) {  // the item's KV heads, each with its g query heads
          float* acc = acc_ + kl * g * D;
          float* pr = pr_ + kl * g * 16;
          float* mx = mx_ + kl * g;
          float* den = den_ + kl * g;
          const float* qh = qf + kl * g * D;
          const bf16* qb = kDot ? qb_.data() + kl * g * D : nullptr;
          bf16* pb = kDot ? pb_.data() + kl * g * 16 : nullptr;
          int64_t kld = 0, vld = 0;
          const C* kraw = kc + (r0 + kl) * D;
          const float* kf = kDot ? nullptr : rows_f32<C, NJ>(kraw, row, n, kt, &kld);
          const C* vraw = vc + (r0 + kl) * D;
          const float* vf = kDot ? nullptr : rows_f32<C, NJ>(vraw, row, n, vt, &vld);
          for (int64_t i = 0; i < g; ++i) {  // scores of head i for the n keys, then the online softmax
            __m512 part[16];
            if constexpr (kDot) {
#ifdef __AVX512BF16__
              __m512bh qv[NJ / 2];
              for (int j = 0; j < NJ / 2; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qb + i * D + 32 * j);
              for (int64_t t = 0; t < 16; ++t) {
                __m512 a = _mm512_setzero_ps();
                if (t < n)
                  for (int j = 0; j < NJ / 2; ++j)
                    a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(kraw + t * row + 32 * j));
                part[t] = a;
              }
#endif
            } else {
              __m512 qv[NJ];
              for (int j = 0; j < NJ; ++j) qv[j] = _mm512_loadu_ps(qh + i * D + 16 * j);
              for (int64_t t = 0; t < 16; ++t) {
                __m512 a = _mm512_setzero_ps();
                if (t < n)
                  for (int j = 0; j < NJ; ++j) a = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(kf + t * kld + 16 * j), a);
                part[t] = a;
              }
            }
            __m512 sum = reduce16(part);
            if constexpr (kDot) sum = _mm512_mul_ps(sum, _mm512_set1_ps(scale));  // q unscaled: exact bf16 pairs
            __m512 sc = _mm512_mask_blend_ps(valid, _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sum);
            const float mnew = std::max(mx[i], _mm512_reduce_max_ps(sc));
            const float corr = std::exp(mx[i] - mnew);  // exp(-inf) = 0 on the first keys
            mx[i] = mnew;
            __m512 e = _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(sc, _mm512_set1_ps(mnew))));
            den[i] = den[i] * corr + _mm512_reduce_add_ps(e);
            _mm512_storeu_ps(pr + 16 * i, e);
#ifdef __AVX512BF16__
            if constexpr (kDot) _mm256_storeu_si256((__m256i*)(pb + 16 * i), (__m256i)_mm512_cvtneps_pbh(e));
#endif
            if (corr != 1.0f)
              for (int j = 0; j < NJ; ++j)
                _mm512_storeu_ps(acc + i * D + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc + i * D + 16 * j),
                                                                     _mm512_set1_ps(corr)));
          }
          for (int64_t i0h = 0; i0h < g; i0h += HT) {  // acc[i] += sum_t p[i][t] v_t, HT heads in registers
            const int64_t nh = std::min<int64_t>(HT, g - i0h);
            __m512 a[HT][NJ];
            for (int ii = 0; ii < HT; ++ii)
              for (int j = 0; j < NJ; ++j)
                a[ii][j] = ii < nh ? _mm512_loadu_ps(acc + (i0h + ii) * D + 16 * j) : _mm512_setzero_ps();
            if constexpr (kDot) {
#ifdef __AVX512BF16__
              // two keys at a time: VDPBF16PS adds p_t v_t[d] + p_t+1 v_t+1[d] for 16 dims d, the
              // probabilities rounded to bfloat16 as SDPA's bfloat16 kernel rounds them for its p*v GEMM
              const __m512i inter = _mm512_loadu_si512(kPairIndex);
              for (int64_t t = 0; t < n; t += 2) {
                const bool two = t + 1 < n;  // an odd tail pairs with a zero row (its p is 0 too)
                __m512i vv[NJ];
                for (int j = 0; j < NJ; ++j) {
                  __m256i r0 = _mm256_loadu_si256((const __m256i*)(vraw + t * row + 16 * j));
                  __m256i r1 = two ? _mm256_loadu_si256((const __m256i*)(vraw + (t + 1) * row + 16 * j))
                                   : _mm256_setzero_si256();
                  vv[j] = _mm512_permutexvar_epi16(inter, _mm512_inserti64x4(_mm512_castsi256_si512(r0), r1, 1));
                }
                for (int ii = 0; ii < HT; ++ii) {
                  if (ii >= nh) break;
                  uint32_t pair;
                  std::memcpy(&pair, pb + 16 * (i0h + ii) + t, sizeof(pair));
                  const __m512bh pp = (__m512bh)_mm512_set1_epi32((int)pair);
                  for (int j = 0; j < NJ; ++j) a[ii][j] = _mm512_dpbf16_ps(a[ii][j], pp, (__m512bh)vv[j]);
                }
              }
#endif
            } else {
              for (int64_t t = 0; t < n; ++t) {
                __m512 vv[NJ];
                for (int j = 0; j < NJ; ++j) vv[j] = _mm512_loadu_ps(vf + t * vld + 16 * j);
                for (int ii = 0; ii < HT; ++ii) {
                  if (ii >= nh) break;
                  const __m512 pv = _mm512_set1_ps(pr[16 * (i0h + ii) + t]);
                  for (int j = 0; j < NJ; ++j) a[ii][j] = _mm512_fmadd_ps(pv, vv[j], a[ii][j]);
                }
              }
            }
            for (int ii = 0; ii < nh; ++ii)
              for (int j = 0; j < NJ; ++j) _mm512_storeu_ps(acc + (i0h + ii) * D + 16 * j, a[ii][j]);
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
        __m512 inv = _mm512_set1_ps(den_[i] > 0.f ? 1.0f / den_[i] : 0.f);
        for (int j = 0; j < NJ; ++j) st(o + 16 * j, _mm512_mul_ps(_mm512_loadu_ps(acc_ + i * D + 16 * j), inv), 0xFFFF);
      }
    }
  });
  if (parts == 1) return;
  for (int64_t bi = 0; bi < b; ++bi)  // softmax over the parts: rescale each part's sums to the common max
    for (int64_t i = 0; i < h; ++i) {
      float m = -std::numeric_limits<float>::infinity(), den = 0.f;
      for (int64_t j = 0; j < parts; ++j) m = std::max(m, partial[((bi * parts + j) * h + i) * (D + 2)]);
      __m512 acc[NJ];
      for (int k = 0; k < NJ; ++k) acc[k] = _mm512_setzero_ps();
      for (int64_t j = 0; j < parts; ++j) {
        const float* pp = partial.data() + ((bi * parts + j) * h + i) * (D + 2);
        if (pp[1] == 0.f) continue;  // an empty part
        const float c = std::exp(pp[0] - m);
        den += pp[1] * c;
        for (int k = 0; k < NJ; ++k) acc[k] = _mm512_fmadd_ps(_mm512_loadu_ps(pp + 2 + 16 * k), _mm512_set1_ps(c), acc[k]);
      }
      __m512 inv = _mm512_set1_ps(den > 0.f ? 1.0f / den : 0.f);
      Q* o = out + bi * os0 + i * os1;
      for (int k = 0; k < NJ; ++k) st(o + 16 * k, _mm512_mul_ps(acc[k], inv), 0xFFFF);
    }
}

// q [B, H, D]; caches [N, S, Hkv, D]; block_tables [B, M] int32; context_lens [B] int32 -> [B, H, D].
// `out`, when given (numel > 0), is written instead of a new tensor.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: shapes");
  int64_t b = q.size(0), h = q.size(1), d = q.size(2), S = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d && h % hkv == 0, "paged_decode: heads / head dim");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && block_tables.size(0) >= b &&
                  block_tables.stride(1) == 1, "paged_decode: block_tables int32 [B, M]");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt32 && context_lens.is_contiguous() && context_lens.numel() >= b,
              "paged_decode: context_lens int32 [B]");
  if (q.stride(2) != 1) q = q.contiguous();
  if (!out.defined() || out.numel() == 0) out = torch::empty({b, h, d}, q.options());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1,
              "paged_decode: out");
  const int32_t* bt = block_tables.data_ptr<int32_t>();
  const int32_t* cl = context_lens.data_ptr<int32_t>();
  int64_t bts = block_tables.stride(0);
  auto run = [&](auto qtag, auto ctag) {
    using Q = decltype(qtag);
    using C = decltype(ctag);
    if (d == 64)
      decode_fast<Q, C, 4>(q.data_ptr<Q>(), q.stride(0), q.stride(1), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), S,
                           hkv, bt, bts, cl, b, h, (float)scale, out.data_ptr<Q>(), out.stride(0), out.stride(1));
    else if (d == 128)
      decode_fast<Q, C, 8>(q.data_ptr<Q>(), q.stride(0), q.stride(1), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), S,
                           hkv, bt, bts, cl, b, h, (float)scale, out.data_ptr<Q>(), out.stride(0), out.stride(1));
    else
      decode_impl<Q, C>(q.data_ptr<Q>(), q.stride(0), q.stride(1), k_cache.data_ptr<C>(), v_cache.data_ptr<C>(), S,
                        hkv, d, bt, bts, cl, b, h, (float)scale, out.data_ptr<Q>(), out.stride(0), out.stride(1));
  };
  auto qt = q.scalar_type(), ct = k_cache.scalar_type();
  if (qt == torch::kFloat32 && ct == torch::kFloat32) run(float(), float());
  else if (qt == torch::kFloat32 && ct == torch::kBFloat16) run(float(), bf16());
  else if (qt == torch::kBFloat16 && ct == torch::kBFloat16) run(bf16(), bf16());
  else if (qt == torch::kBFloat16 && ct == torch::kFloat32) run(bf16(), float());
  else TORCH_CHECK(false, "paged_decode: float32 or bfloat16 only");
  return out;
}

// ---------------------------------------------------------------------------------------------
// Decode-time matrix-vector products: y[m, n] = sum_k x[m, k] * W[n, k] for a few rows m (decode at
// small batch), with W in float32, bfloat16 or int8 (per-row scale).
//
// Why: at batch 1 decode reads every weight once per step, so its speed is memory bandwidth.
// Eager PyTorch's kernels reach about half of it for float32 on this CPU and much less for bfloat16;
// these loops stream W once, widen it to float32 in registers, and keep M x 4 accumulators, so the
// only traffic is the weights. Work is split over rows of W with at::parallel_for (torch's pool).
// Load 16 weights starting at p as float32, with a mask for the tail.
inline __m512 load_w(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load_w(const uint16_t* p, __mmask16 m) {  // bfloat16: the high half of a float32
  __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
inline __m512 load_w(const int8_t* p, __mmask16 m) {
  __m128i b = _mm_maskz_loadu_epi8(m, p);
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
}

constexpr int U = 4;  // 16-wide chunks of K per loop iteration (independent accumulators)

template <typename W, int M>
inline void row_dot(const float* x, int64_t K, const W* wr, float* out, int64_t ldo) {
  // out[m * ldo] = dot(x[m], wr) for m < M. The weight row is read front to back once.
  __m512 acc[M][U];
  for (int m = 0; m < M; ++m)
    for (int u = 0; u < U; ++u) acc[m][u] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 * U <= K; k += 16 * U) {
    __m512 wv[U];
    for (int u = 0; u < U; ++u) wv[u] = load_w(wr + k + 16 * u, (__mmask16)0xFFFF);
    for (int m = 0; m < M; ++m)
      for (int u = 0; u < U; ++u) acc[m][u] = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k + 16 * u), wv[u], acc[m][u]);
  }
  for (; k < K; k += 16) {
    __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    __m512 wv = load_w(wr + k, mask);
    for (int m = 0; m < M; ++m) acc[m][0] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, x + m * K + k), wv, acc[m][0]);
  }
  for (int m = 0; m < M; ++m) {
    __m512 s = acc[m][0];
    for (int u = 1; u < U; ++u) s = _mm512_add_ps(s, acc[m][u]);
    out[m * ldo] = _mm512_reduce_add_ps(s);
  }
}

// One row of x against four rows of W read in lockstep: four memory streams per thread (one stream
// per thread left a core at ~70% of what a streaming sum reads on one core), each x vector loaded
// once for the four rows.
template <typename W>
inline void rows4_dot(const float* x, int64_t K, const W* const* wr, float* const* out) {
  __m512 a[4][2];
  for (int s = 0; s < 4; ++s) a[s][0] = a[s][1] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512 x0 = _mm512_loadu_ps(x + k), x1 = _mm512_loadu_ps(x + k + 16);
    for (int s = 0; s < 4; ++s) {
      a[s][0] = _mm512_fmadd_ps(x0, load_w(wr[s] + k, (__mmask16)0xFFFF), a[s][0]);
      a[s][1] = _mm512_fmadd_ps(x1, load_w(wr[s] + k + 16, (__mmask16)0xFFFF), a[s][1]);
    }
  }
  for (; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K - k)) - 1);
    const __m512 x0 = _mm512_maskz_loadu_ps(mask, x + k);
    for (int s = 0; s < 4; ++s) a[s][0] = _mm512_fmadd_ps(x0, load_w(wr[s] + k, mask), a[s][0]);
  }
  for (int s = 0; s < 4; ++s) *out[s] = _mm512_reduce_add_ps(_mm512_add_ps(a[s][0], a[s][1]));
}

template <typename W>
void gemv_impl(const float* x, int64_t M, int64_t K, const W* w, int64_t N, const float* scale, const float* bias,
               float* y) {
  // y [M, N]. Each task owns a contiguous range of W's rows. With one row of x (decode at batch 1)
  // the range is read as four quarters in lockstep (rows4_dot): over SmolLM2's 121 matrices that
  // reads at 94% of a streaming sum against 77-81% for one stream per thread (same process, 2
  // threads; 85% vs 64% on one thread). Otherwise rows go front to back one at a time (interleaving
  // 4 adjacent rows measured ~15% slower), every group of up to 4 rows of x against the row while
  // it sits in L1.
  at::parallel_for(0, N, 64, [&](int64_t n0, int64_t n1) {
    int64_t first = n0;  // rows before this one are done by rows4_dot
    if (M == 1) {  // a task's rows as four quarters read in lockstep
      const int64_t q = (n1 - n0) / 4;
      for (int64_t i = 0; i < q; ++i) {
        const W* wr[4];
        float* out[4];
        for (int s = 0; s < 4; ++s) {
          wr[s] = w + (n0 + s * q + i) * K;
          out[s] = y + n0 + s * q + i;
        }
        rows4_dot<W>(x, K, wr, out);
      }
      first = n0 + 4 * q;
    }
    for (int64_t n = first; n < n1; ++n) {
      const W* wr = w + n * K;
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* xm = x + m0 * K;
        float* out = y + m0 * N + n;
        switch (std::min<int64_t>(4, M - m0)) {
          case 1: row_dot<W, 1>(xm, K, wr, out, N); break;
          case 2: row_dot<W, 2>(xm, K, wr, out, N); break;
          case 3: row_dot<W, 3>(xm, K, wr, out, N); break;
          default: row_dot<W, 4>(xm, K, wr, out, N); break;
        }
      }
    }
    if (scale || bias)
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m = 0; m < M; ++m) {
          float& v = y[m * N + n];
          if (scale) v *= scale[n];
          if (bias) v += bias[n];
        }
  });
}

// x [M, K] (any float dtype; widened to float32), w [N, K] float32 | bfloat16 | int8,
// scale [N] float32 (int8 only, else empty), bias [N] float32 or empty -> y [M, N] float32.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: shapes");
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous");
  auto xf = x.to(torch::kFloat32).contiguous();
  int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, xf.options());
  const float* s = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (w.scalar_type() == torch::kFloat32) {
    gemv_impl<float>(xf.data_ptr<float>(), M, K, w.data_ptr<float>(), N, s, b, y.data_ptr<float>());
  } else if (w.scalar_type() == torch::kBFloat16) {
    gemv_impl<uint16_t>(xf.data_ptr<float>(), M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), N, s, b,
                         y.data_ptr<float>());
  } else if (w.scalar_type() == torch::kInt8) {
    TORCH_CHECK(s != nullptr, "gemv: int8 weights need a scale");
    gemv_impl<int8_t>(xf.data_ptr<float>(), M, K, w.data_ptr<int8_t>(), N, s, b, y.data_ptr<float>());
  } else {
    TORCH_CHECK(false, "gemv: unsupported weight dtype");
  }
  return y;
}


// ---------------------------------------------------------------------------------------------
// DecodePlan: every decoder layer of a decode-only step in one call.
//
// Why: each layer is ~12 kernel calls (norms, 4 GEMVs, rotary, KV store, attention); issued from
// Python through nn.Module dispatch they cost ~200 us of host time per layer here, about a quarter
// of a float32 batch-1 step of SmolLM2. The plan holds the layers' weights and issues the very same
// kernels, in the same order with the same roundings, from C++: the result equals the module path
// bit for bit (tests/model/test_decode_plan.py), only the host time goes.
struct PlanLinear {
  torch::Tensor w, scale, bias;  // w [N, K] float32 | bfloat16 | int8; scale [N] f32 (int8) or empty; bias [N] f32 or empty
  torch::Tensor packed, packed_bias;  // oneDNN's prepacked weight and the bias in the model dtype (or empty)
  int64_t gemv_rows;  // the GEMV up to this many rows, oneDNN above (CpuLinear's dispatch)
};

// oneDNN's GEMM on a prepacked weight: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], None)
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.numel() ? c10::IValue(bias) : c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get()))),
                          c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

struct PlanLayer {
  torch::Tensor ln1, ln2, q_norm, k_norm;  // q_norm / k_norm empty unless the model normalises q, k per head
  PlanLinear qkv, o, gate_up, down;
};

class DecodePlan {
 public:
  // layers: per layer [ln1, ln2, q_norm, k_norm, then for qkv, o, gate_up, down each: w, scale, bias, packed,
  // packed_bias] (empty tensors where absent); gemv_rows: per layer, the four projections' GEMV limits
  DecodePlan(std::vector<std::vector<torch::Tensor>> layers, std::vector<std::vector<int64_t>> gemv_rows,
             torch::Tensor final_norm, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : final_norm_(final_norm), heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(gemv_rows.size() == layers.size(), "DecodePlan: gemv_rows per layer");
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& t = layers[i];
      TORCH_CHECK(t.size() == 24 && gemv_rows[i].size() == 4, "DecodePlan: 24 tensors and 4 limits per layer");
      PlanLayer l;
      l.ln1 = t[0];
      l.ln2 = t[1];
      l.q_norm = t[2];
      l.k_norm = t[3];
      PlanLinear* lins[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
      for (int j = 0; j < 4; ++j)
        *lins[j] = {t[4 + 5 * j], t[5 + 5 * j], t[6 + 5 * j], t[7 + 5 * j], t[8 + 5 * j], gemv_rows[i][j]};
      TORCH_CHECK(l.qkv.w.size(0) == (heads + 2 * kv_heads) * head_dim, "DecodePlan: qkv rows");
      layers_.push_back(l);
    }
  }

  // h [T, Dm] (the embeddings), cos/sin [T, 1, D/2] float32, kv_caches per layer (K, V) [N, S, Hkv, D] (the
  // ModelRunner's list as it is), slots [T] int64, block_tables [T, M] int32, context_lens [T] int32 (one
  // decode token per sequence) -> final-normed [T, Dm]
  torch::Tensor run(torch::Tensor h, torch::Tensor cos, torch::Tensor sin,
                    const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& kv_caches, torch::Tensor slots,
                    torch::Tensor block_tables, torch::Tensor context_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodePlan: caches per layer");
    const int64_t t = h.size(0), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_;
    torch::Tensor residual;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const PlanLayer& l = layers_[i];
      torch::Tensor x;
      if (i == 0) {
        residual = h;
        x = rms_norm(h, l.ln1, eps_);
      } else {
        auto r = add_rms_norm(h, residual, l.ln1, eps_);
        x = r[0];
        residual = r[1];
      }
      auto qkv = linear(x, l.qkv);  // [T, (H + 2 Hkv) D]
      auto q = qkv.narrow(1, 0, qs).view({t, heads_, head_dim_});
      auto k = qkv.narrow(1, qs, kvs).view({t, kv_heads_, head_dim_});
      auto v = qkv.narrow(1, qs + kvs, kvs).view({t, kv_heads_, head_dim_});
      if (l.q_norm.numel()) {
        q = rms_norm(q, l.q_norm, eps_);
        k = rms_norm(k, l.k_norm, eps_);
      }
      auto qk = rotary(q, k, cos, sin);
      const auto& [k_cache, v_cache] = kv_caches[i];
      store_kv(qk[1], v, k_cache, v_cache, slots);
      auto o = paged_decode(qk[0], k_cache, v_cache, block_tables, context_lens, scale_, torch::Tensor());
      auto r = add_rms_norm(linear(o.reshape({t, qs}), l.o), residual, l.ln2, eps_);
      residual = r[1];
      h = linear(silu_mul(linear(r[0], l.gate_up)), l.down);
    }
    return add_rms_norm(h, residual, final_norm_, eps_)[0];
  }

 private:
  static torch::Tensor linear(const torch::Tensor& x, const PlanLinear& l) {
    if (x.size(0) <= l.gemv_rows) return gemv(x, l.w, l.scale, l.bias).to(x.scalar_type());
    TORCH_CHECK(l.packed.defined() && l.packed.numel(), "DecodePlan: no prepacked weight for this batch");
    return onednn_linear(x, l.packed, l.packed_bias);
  }

  std::vector<PlanLayer> layers_;
  torch::Tensor final_norm_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "rms_norm(x, w, eps)");
  m.def("add_rms_norm", &add_rms_norm, "add_rms_norm(x, residual, w, eps) -> [y, x + residual]");
  m.def("rotary", &rotary, "rotary(q, k, cos, sin) -> [q', k'] (rotate-half)");
  m.def("silu_mul", &silu_mul, "silu_mul(gate_up) -> silu(gate) * up");
  m.def("store_kv", &store_kv, "store_kv(k, v, k_cache, v_cache, slot_mapping), in place");
  m.def("gemv", &gemv, "gemv(x, w, scale, bias): decode GEMV (float32/bfloat16/int8 weights) -> float32");
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>, torch::Tensor, int64_t,
                    int64_t, int64_t, double, double>())
      .def("run", &DecodePlan::run, "run(h, cos, sin, kv_caches, slots, block_tables, context_lens)");
  m.def("paged_decode", &paged_decode, "paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out)");
  m.def("prefill_attention", &prefill_attention,
        "prefill_attention(q, k_cache, v_cache, block_table, ctx, scale): causal, one sequence, bfloat16");
  m.def("prefill_attention_supported", &prefill_attention_supported, "prefill_attention_supported(group, head_dim)");
}
