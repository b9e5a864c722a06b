// The extension's entry points: torch tensors in, the kernels of kernels.h (written once against the
// portable vector layer, simd.h) on their raw pointers, (the DecodePlan of decode_plan.h issues them for all
// layers of a decode step). One extension is compiled per ISA (kernels/cpu_extension.py); `isa()`
// says which this one is.
//
// Why C++ for these small ops: at batch 1 each of them is a handful of eager PyTorch ops, each with
// its dispatch overhead, over a few hundred numbers; a decoder layer spent more time in that overhead
// than in arithmetic.
#include <ATen/ops/empty.h>

#include "kernels.h"
#include "ops.h"

namespace servescope_ops {

using namespace servescope_kernels;


namespace {

// the tensor's data as the kernels' element type (servescope_simd::bf16 is layout-compatible with c10::BFloat16)
template <typename T>
T* data(const at::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Calls fn(T()) with T = float or bf16 for the tensor's dtype; anything else is a clear error.
template <typename F>
void by_dtype(const at::Tensor& t, const char* what, const F& fn) {
  if (t.scalar_type() == at::kFloat)
    fn(float());
  else if (t.scalar_type() == at::kBFloat16)
    fn(bf16());
  else
    TORCH_CHECK(false, what, ": float32 or bfloat16 only");
}

// Calls fn(C()) with the KV cache's element type: float, bf16, or a quantised cache's int8_t / fp8e4m3
// (whose rows carry their scale: kv_quant.h)
template <typename F>
void by_kv_dtype(const at::Tensor& cache, const char* what, const F& fn) {
  if (cache.scalar_type() == at::kChar)
    fn(int8_t());
  else if (cache.scalar_type() == at::ScalarType::Float8_e4m3fn)
    fn(fp8e4m3());
  else
    by_dtype(cache, what, fn);
}

bool quantized_kv(const at::Tensor& cache) {
  return cache.scalar_type() == at::kChar || cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
}

// ---------------------------------------------------------------------------------------------
// x [R, n] with unit stride in the last dim (a row stride is allowed), else made contiguous
at::Tensor rows2d(const at::Tensor& x) {
  int64_t n = x.size(-1);
  if (x.dim() == 2 && x.stride(1) == 1) return x;
  return x.contiguous().view({-1, n});
}

std::vector<at::Tensor> norm_common(at::Tensor x, c10::optional<at::Tensor> residual, at::Tensor w,
                                       double eps) {
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(-1) && w.is_contiguous(), "rms_norm: weight shape");
  TORCH_CHECK(w.scalar_type() == x.scalar_type(), "rms_norm: weight dtype must match x");
  auto x2 = rows2d(x);
  int64_t rows = x2.size(0), n = x2.size(1);
  auto y = at::empty(x.sizes(), x.options());
  at::Tensor h, r2;
  if (residual) {
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(), "add_rms_norm: residual");
    r2 = rows2d(*residual);
    h = at::empty(x.sizes(), x.options());
  }
  by_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(data<T>(x2), x2.stride(0), residual ? data<T>(r2) : nullptr, residual ? r2.stride(0) : 0,
                 residual ? data<T>(h) : nullptr, data<T>(y), data<T>(w), rows, n, (float)eps);
  });
  if (residual) return {y, h};
  return {y};
}

}  // namespace

at::Tensor rms_norm(at::Tensor x, at::Tensor w, double eps) { return norm_common(x, c10::nullopt, w, eps)[0]; }

std::vector<at::Tensor> add_rms_norm(at::Tensor x, at::Tensor residual, at::Tensor w, double eps) {
  return norm_common(x, residual, w, eps);
}

// q [T, H, D], k [T, Hkv, D] (any strides with a unit last stride), cos, sin [T, 1, D/2] float32
std::vector<at::Tensor> rotary(at::Tensor q, at::Tensor k, at::Tensor cos, at::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2) && q.size(2) % 2 == 0,
              "rotary: shapes");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "rotary: q, k dtype");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat, "rotary: cos/sin float32");
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
  auto qo = at::empty(q.sizes(), q.options());
  auto ko = at::empty(k.sizes(), k.options());
  by_dtype(q, "rotary", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(data<T>(q), q.stride(0), q.stride(1), data<T>(k), k.stride(0), k.stride(1), data<T>(qo), data<T>(ko),
                   t, q.size(1), k.size(1), q.size(2), data<float>(c2), data<float>(s2), c2.stride(0));
  });
  return {qo, ko};
}

at::Tensor silu_mul(at::Tensor x) {
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_mul: last dim must be even");
  auto x2 = rows2d(x);
  int64_t rows = x2.size(0), inner = x2.size(1) / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = inner;
  auto y = at::empty(sizes, x.options());
  by_dtype(x, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(data<T>(x2), x2.stride(0), data<T>(y), rows, inner);
  });
  return y;
}

namespace {

template <typename C>
void store_one(at::Tensor src, at::Tensor cache, const int64_t* slots) {
  if (src.stride(2) != 1) src = src.contiguous();
  by_dtype(src, "store_kv: k/v", [&](auto tag) {
    using S = decltype(tag);
    copy_rows<S, C>(data<S>(src), src.stride(0), src.stride(1), data<C>(cache), slots, src.size(0), src.size(1),
                    src.size(2));
  });
}

// x [T, Hkv, D] quantised per row (token, head) into a cache [N, S, Hkv, D + 4] of int8 / fp8 at `slots`
// (kv_quant.h's quantize_row: the arithmetic of model/attention/kv_quant.quantize_rows)
template <typename C>
void store_quantized(at::Tensor x, const at::Tensor& cache, const int64_t* slots) {
  if (x.stride(2) != 1) x = x.contiguous();
  const int64_t t = x.size(0), hkv = x.size(1), d = x.size(2);
  C* base = data<C>(cache);
  by_dtype(x, "store_kv: k/v", [&](auto tag) {
    using S = decltype(tag);
    const S* p = data<S>(x);
    for (int64_t i = 0; i < t; ++i)
      for (int64_t h = 0; h < hkv && slots[i] >= 0; ++h)
        quantize_row<C>(p + i * x.stride(0) + h * x.stride(1), d, base + (slots[i] * hkv + h) * (d + 4));
  });
}

}  // namespace

void store_kv(at::Tensor k, at::Tensor v, at::Tensor k_cache, at::Tensor v_cache, at::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "store_kv: shapes");
  const int64_t pad = quantized_kv(k_cache) ? 4 : 0;
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) + pad == k_cache.size(3) && v.sizes() == k.sizes() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: shapes");
  TORCH_CHECK(slots.scalar_type() == at::kLong && slots.is_contiguous() && slots.numel() == k.size(0),
              "store_kv: slot_mapping int64 [T]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  if (pad) {
    by_kv_dtype(k_cache, "store_kv: cache", [&](auto tag) {
      using C = decltype(tag);
      if constexpr (kQuantKV<C>) {
        store_quantized<C>(k, k_cache, sp);
        store_quantized<C>(v, v_cache, sp);
      }
    });
    return;
  }
  by_dtype(k_cache, "store_kv: cache", [&](auto tag) {
    using C = decltype(tag);
    store_one<C>(k, k_cache, sp);
    store_one<C>(v, v_cache, sp);
  });
}

// q [B, H, D]; caches [N, S, Hkv, D] (int8 / fp8: [N, S, Hkv, D + 4], kv_quant.h); block_tables [B, M] int32; context_lens [B] int32 -> [B, H, D].
// `out`, when given (numel > 0), is written instead of a new tensor; window > 0: the last `window` positions of
// each sequence only; softcap > 0, sinks [H] float32 (numel > 0): decode_attention.h's ScoreMods.
at::Tensor paged_decode(at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                           at::Tensor context_lens, double scale, at::Tensor out, int64_t window, double softcap,
                           at::Tensor sinks) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: shapes");
  int64_t b = q.size(0), h = q.size(1), d = q.size(2), S = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d + (quantized_kv(k_cache) ? 4 : 0) && h % hkv == 0, "paged_decode: heads / head dim");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) >= b &&
                  block_tables.stride(1) == 1, "paged_decode: block_tables int32 [B, M]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() && context_lens.numel() >= b,
              "paged_decode: context_lens int32 [B]");
  if (q.stride(2) != 1) q = q.contiguous();
  TORCH_CHECK(softcap >= 0.0, "paged_decode: softcap >= 0");
  const bool has_sinks = sinks.defined() && sinks.numel() > 0;
  TORCH_CHECK(!has_sinks || (sinks.scalar_type() == at::kFloat && sinks.is_contiguous() && sinks.numel() == h),
              "paged_decode: sinks float32 [H]");
  const ScoreMods mods{(float)softcap, has_sinks ? sinks.data_ptr<float>() : nullptr};
  if (!out.defined() || out.numel() == 0) out = at::empty({b, h, d}, q.options());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1,
              "paged_decode: out");
  by_dtype(q, "paged_decode: q", [&](auto qtag) {
    by_kv_dtype(k_cache, "paged_decode: cache", [&](auto ctag) {
      using Q = decltype(qtag);
      using C = decltype(ctag);
      paged_decode_rows<Q, C>(data<Q>(q), q.stride(0), q.stride(1), data<C>(k_cache), data<C>(v_cache), S, hkv, d,
                              block_tables.data_ptr<int32_t>(), block_tables.stride(0), context_lens.data_ptr<int32_t>(),
                              b, h, (float)scale, data<Q>(out), out.stride(0), out.stride(1), window, mods);
    });
  });
  return out;
}

// MLA's absorbed decode: q [B, H, d] over the latent cache [N, S, 1, d] (int8 / fp8: d + 4), the values the
// first v_dim features of each row (latent_decode_rows) -> [B, H, v_dim] in q's dtype
at::Tensor latent_decode(at::Tensor q, at::Tensor cache, at::Tensor block_tables, at::Tensor context_lens,
                         double scale, int64_t v_dim) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 4 && cache.is_contiguous() && cache.size(2) == 1,
              "latent_decode: q [B, H, d], cache [N, S, 1, d]");
  const int64_t b = q.size(0), h = q.size(1), d = q.size(2);
  TORCH_CHECK(cache.size(3) == d + (quantized_kv(cache) ? 4 : 0), "latent_decode: the cache's rows are q's width");
  TORCH_CHECK(v_dim > 0 && v_dim <= d, "latent_decode: 0 < v_dim <= d");
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.size(0) >= b &&
                  block_tables.stride(1) == 1, "latent_decode: block_tables int32 [B, M]");
  TORCH_CHECK(context_lens.scalar_type() == at::kInt && context_lens.is_contiguous() && context_lens.numel() >= b,
              "latent_decode: context_lens int32 [B]");
  if (q.stride(2) != 1) q = q.contiguous();
  auto out = at::empty({b, h, v_dim}, q.options());
  by_dtype(q, "latent_decode: q", [&](auto qtag) {
    by_kv_dtype(cache, "latent_decode: cache", [&](auto ctag) {
      using Q = decltype(qtag);
      using C = decltype(ctag);
      latent_decode_rows<Q, C>(data<Q>(q), q.stride(0), q.stride(1), data<C>(cache), cache.size(1), d, v_dim,
                               block_tables.data_ptr<int32_t>(), block_tables.stride(0),
                               context_lens.data_ptr<int32_t>(), b, h, (float)scale, data<Q>(out), out.stride(0),
                               out.stride(1));
    });
  });
  return out;
}

// x [M, K] (any float dtype; widened to float32), w [N, K] float32 | bfloat16 | int8,
// scale [N] float32 (int8 only, else empty), bias [N] float32 or empty -> y [M, N] float32.
// Packed weights (float16 group scales) go to quant_gemv.
at::Tensor gemv(at::Tensor x, at::Tensor w, at::Tensor scale, at::Tensor bias) {
  if (scale.scalar_type() == at::kHalf || scale.scalar_type() == at::kByte) return quant_gemv(x, w, scale, bias, 0);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: shapes");
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous");
  if (scale.numel() == 0 && gemv_bf16_dot_applies(x, w)) {
    auto y = at::empty({x.size(0), w.size(0)}, x.options().dtype(at::kFloat));
    gemv_bf16_dot_into(x, w, bias.numel() ? bias.data_ptr<float>() : nullptr, data<float>(y));
    return y;
  }
  auto xf = x.to(at::kFloat).contiguous();
  int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  auto y = at::empty({M, N}, xf.options());
  const float* s = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (w.scalar_type() == at::kFloat) {
    gemv_rows<float>(data<float>(xf), M, K, data<float>(w), N, s, b, data<float>(y));
  } else if (w.scalar_type() == at::kBFloat16) {
    gemv_rows<bf16>(data<float>(xf), M, K, data<bf16>(w), N, s, b, data<float>(y));
  } else if (w.scalar_type() == at::kChar) {
    TORCH_CHECK(s != nullptr, "gemv: int8 weights need a scale");
    gemv_rows<int8_t>(data<float>(xf), M, K, data<int8_t>(w), N, s, b, data<float>(y));
  } else {
    TORCH_CHECK(false, "gemv: unsupported weight dtype");
  }
  return y;
}

// bfloat16 rows of x on a bfloat16 weight, 2 rows or more: bfloat16 dot products (kernels.h); one row keeps the
// float32 path, which streams the weight at the read rate already
bool gemv_bf16_dot_applies(const Tensor& rows, const Tensor& w) {
#if SERVESCOPE_HAS_BF16_DOT
  return rows.size(0) >= 2 && w.scalar_type() == at::kBFloat16 && rows.scalar_type() == at::kBFloat16;
#else
  return false;
#endif
}

bool gemv_bf16_dot_into(const Tensor& rows, const Tensor& w, const float* bias, float* y) {
  if (!gemv_bf16_dot_applies(rows, w)) return false;
#if SERVESCOPE_HAS_BF16_DOT
  const auto xb = rows.contiguous();
  gemv_rows_bf16_dot(data<bf16>(xb), xb.size(0), xb.size(1), data<bf16>(w), w.size(0), bias, y);
#endif
  return true;
}

// w [N, K] float32 | bfloat16 -> float32 [panel_count(N), K, PANEL_NB]: the layout of panel_gemm.h
at::Tensor pack_panels(at::Tensor w) {
  TORCH_CHECK(w.dim() == 2, "pack_panels: w [N, K]");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1);
  auto out = at::empty({panel_count(N), K, PANEL_NB}, w.options().dtype(at::kFloat));
  by_dtype(w, "pack_panels: w", [&](auto tag) {
    using T = decltype(tag);
    servescope_kernels::pack_panels<T>(data<T>(w), N, K, data<float>(out));
  });
  return out;
}

// x [M, K] float32, panels from pack_panels of a weight [n, K], bias [n] float32 or empty -> y [M, n] float32
at::Tensor panel_gemm(at::Tensor x, at::Tensor panels, int64_t n, at::Tensor bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0, "panel_gemm: x [M, K] float32, K > 0");
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kFloat && panels.is_contiguous() &&
                  panels.size(0) == panel_count(n) && panels.size(1) == x.size(1) && panels.size(2) == PANEL_NB,
              "panel_gemm: panels must come from this build's pack_panels of a [n, K] weight");
  TORCH_CHECK(!bias.numel() || (bias.numel() == n && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "panel_gemm: bias [n] float32");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  auto y = at::empty({M, n}, x.options());
  const float* b = bias.numel() ? data<float>(bias) : nullptr;
  if (M) servescope_kernels::panel_gemm(data<float>(x), M, K, data<float>(panels), n, b, data<float>(y));
  return y;
}

// which ISA this extension was compiled for, and its optional dot-product instructions
std::map<std::string, std::string> isa_info() {
  return {{"isa", kIsa}, {"lanes", std::to_string(W)}, {"bf16_dot", SERVESCOPE_HAS_BF16_DOT ? "1" : "0"},
          {"int8_dot", SERVESCOPE_HAS_INT8_DOT ? "1" : "0"},
          {"amx_int8", quant_amx_available() ? "1" : "0"},
          {"amx_bf16", quant_amx_bf16_available() ? "1" : "0"},
          {"qgemm_rows", quant_gemm_rows_from()},
          {"kept_panel", std::to_string(quant_kept_panel())},
          {"kept_int8", quant_kept_int8() ? "1" : "0"},
          {"panel", std::to_string(PANEL_MR) + "x" + std::to_string(PANEL_NB)}};
}

}  // namespace servescope_ops
