// The extension's entry points: torch tensors in, the kernels of kernels.h (written once against the
// portable vector layer, simd.h) on their raw pointers, and the DecodePlan that issues them for all
// layers of a decode step. One extension is compiled per ISA (kernels/cpu_extension.py); `isa()`
// says which this one is.
//
// Why C++ for these small ops: at batch 1 each of them is 3..14 eager PyTorch ops of 3-10 us of
// dispatch overhead apiece over a few hundred numbers; a decoder layer spent more time in that
// overhead than in arithmetic.
#include <torch/extension.h>

#include "kernels.h"

// defined in prefill_attention.cpp (AVX512-BF16 only; elsewhere "unsupported")
torch::Tensor prefill_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table,
                                int64_t ctx, double scale);
bool prefill_attention_supported(int64_t group, int64_t head_dim);
// defined in quant_ops.cpp: packed int4 / int8 weights with float16 group scales (quant_gemv.h)
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor bias);
torch::Tensor quant_dequantize(torch::Tensor w, torch::Tensor scales, int64_t k);

namespace {

using namespace servescope_kernels;

// the tensor's data as the kernels' element type (servescope_simd::bf16 is layout-compatible with c10::BFloat16)
template <typename T>
T* data(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// Calls fn(T()) with T = float or bf16 for the tensor's dtype; anything else is a clear error.
template <typename F>
void by_dtype(const torch::Tensor& t, const char* what, const F& fn) {
  if (t.scalar_type() == torch::kFloat32)
    fn(float());
  else if (t.scalar_type() == torch::kBFloat16)
    fn(bf16());
  else
    TORCH_CHECK(false, what, ": float32 or bfloat16 only");
}

// Calls fn(C()) with the KV cache's element type: float, bf16, or a quantised cache's int8_t / fp8e4m3
// (whose rows carry their scale: kv_quant.h)
template <typename F>
void by_kv_dtype(const torch::Tensor& cache, const char* what, const F& fn) {
  if (cache.scalar_type() == at::kChar)
    fn(int8_t());
  else if (cache.scalar_type() == at::ScalarType::Float8_e4m3fn)
    fn(fp8e4m3());
  else
    by_dtype(cache, what, fn);
}

bool quantized_kv(const torch::Tensor& cache) {
  return cache.scalar_type() == at::kChar || cache.scalar_type() == at::ScalarType::Float8_e4m3fn;
}

// ---------------------------------------------------------------------------------------------
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
  by_dtype(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    norm_rows<T>(data<T>(x2), x2.stride(0), residual ? data<T>(r2) : nullptr, residual ? r2.stride(0) : 0,
                 residual ? data<T>(h) : nullptr, data<T>(y), data<T>(w), rows, n, (float)eps);
  });
  if (residual) return {y, h};
  return {y};
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor w, double eps) { return norm_common(x, c10::nullopt, w, eps)[0]; }

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor w, double eps) {
  return norm_common(x, residual, w, eps);
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
  by_dtype(q, "rotary", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(data<T>(q), q.stride(0), q.stride(1), data<T>(k), k.stride(0), k.stride(1), data<T>(qo), data<T>(ko),
                   t, q.size(1), k.size(1), q.size(2), data<float>(c2), data<float>(s2), c2.stride(0));
  });
  return {qo, ko};
}

torch::Tensor silu_mul(torch::Tensor x) {
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_mul: last dim must be even");
  auto x2 = rows2d(x);
  int64_t rows = x2.size(0), inner = x2.size(1) / 2;
  auto sizes = x.sizes().vec();
  sizes.back() = inner;
  auto y = torch::empty(sizes, x.options());
  by_dtype(x, "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_mul_rows<T>(data<T>(x2), x2.stride(0), data<T>(y), rows, inner);
  });
  return y;
}

template <typename C>
void store_one(torch::Tensor src, torch::Tensor cache, const int64_t* slots) {
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
void store_quantized(torch::Tensor x, const torch::Tensor& cache, const int64_t* slots) {
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

void store_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots) {
  TORCH_CHECK(k.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "store_kv: shapes");
  const int64_t pad = quantized_kv(k_cache) ? 4 : 0;
  TORCH_CHECK(k.size(1) == k_cache.size(2) && k.size(2) + pad == k_cache.size(3) && v.sizes() == k.sizes() &&
              v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "store_kv: shapes");
  TORCH_CHECK(slots.scalar_type() == torch::kInt64 && slots.is_contiguous() && slots.numel() == k.size(0),
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
// `out`, when given (numel > 0), is written instead of a new tensor.
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_tables,
                           torch::Tensor context_lens, double scale, torch::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                  v_cache.sizes() == k_cache.sizes() && v_cache.scalar_type() == k_cache.scalar_type(),
              "paged_decode: shapes");
  int64_t b = q.size(0), h = q.size(1), d = q.size(2), S = k_cache.size(1), hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == d + (quantized_kv(k_cache) ? 4 : 0) && h % hkv == 0, "paged_decode: heads / head dim");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.dim() == 2 && block_tables.size(0) >= b &&
                  block_tables.stride(1) == 1, "paged_decode: block_tables int32 [B, M]");
  TORCH_CHECK(context_lens.scalar_type() == torch::kInt32 && context_lens.is_contiguous() && context_lens.numel() >= b,
              "paged_decode: context_lens int32 [B]");
  if (q.stride(2) != 1) q = q.contiguous();
  if (!out.defined() || out.numel() == 0) out = torch::empty({b, h, d}, q.options());
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() && out.stride(2) == 1,
              "paged_decode: out");
  by_dtype(q, "paged_decode: q", [&](auto qtag) {
    by_kv_dtype(k_cache, "paged_decode: cache", [&](auto ctag) {
      using Q = decltype(qtag);
      using C = decltype(ctag);
      paged_decode_rows<Q, C>(data<Q>(q), q.stride(0), q.stride(1), data<C>(k_cache), data<C>(v_cache), S, hkv, d,
                              block_tables.data_ptr<int32_t>(), block_tables.stride(0), context_lens.data_ptr<int32_t>(),
                              b, h, (float)scale, data<Q>(out), out.stride(0), out.stride(1));
    });
  });
  return out;
}

// x [M, K] (any float dtype; widened to float32), w [N, K] float32 | bfloat16 | int8,
// scale [N] float32 (int8 only, else empty), bias [N] float32 or empty -> y [M, N] float32.
// Packed weights (float16 group scales) go to quant_gemv.
torch::Tensor gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scale, torch::Tensor bias) {
  if (scale.scalar_type() == torch::kHalf) return quant_gemv(x, w, scale, bias);
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "gemv: shapes");
  TORCH_CHECK(w.is_contiguous(), "gemv: w must be contiguous");
  auto xf = x.to(torch::kFloat32).contiguous();
  int64_t M = xf.size(0), K = xf.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, xf.options());
  const float* s = scale.numel() ? scale.data_ptr<float>() : nullptr;
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  if (w.scalar_type() == torch::kFloat32) {
    gemv_rows<float>(data<float>(xf), M, K, data<float>(w), N, s, b, data<float>(y));
  } else if (w.scalar_type() == torch::kBFloat16) {
    gemv_rows<bf16>(data<float>(xf), M, K, data<bf16>(w), N, s, b, data<float>(y));
  } else if (w.scalar_type() == torch::kInt8) {
    TORCH_CHECK(s != nullptr, "gemv: int8 weights need a scale");
    gemv_rows<int8_t>(data<float>(xf), M, K, data<int8_t>(w), N, s, b, data<float>(y));
  } else {
    TORCH_CHECK(false, "gemv: unsupported weight dtype");
  }
  return y;
}

// which ISA this extension was compiled for, and its optional dot-product instructions
std::map<std::string, std::string> isa_info() {
  return {{"isa", kIsa}, {"lanes", std::to_string(W)}, {"bf16_dot", SERVESCOPE_HAS_BF16_DOT ? "1" : "0"},
          {"int8_dot", SERVESCOPE_HAS_INT8_DOT ? "1" : "0"}};
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
    auto out = run_layers(h, torch::Tensor(), cos, sin, kv_caches, slots, block_tables, context_lens);
    return add_rms_norm(out[0], out[1], final_norm_, eps_)[0];
  }

  // The layers alone, for a pipeline stage: from (h, residual) [T, Dm] as the previous stage handed them
  // on (residual empty: the first stage, h the embeddings) -> [h, residual] for the next stage or the
  // final norm; the same kernels in the same order as run().
  std::vector<torch::Tensor> run_layers(torch::Tensor h, torch::Tensor residual, torch::Tensor cos, torch::Tensor sin,
                                        const std::vector<std::tuple<torch::Tensor, torch::Tensor>>& kv_caches,
                                        torch::Tensor slots, torch::Tensor block_tables,
                                        torch::Tensor context_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodePlan: caches per layer");
    const int64_t t = h.size(0), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const PlanLayer& l = layers_[i];
      torch::Tensor x;
      if (!residual.defined() || residual.numel() == 0) {
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
    return {h, residual};
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
  m.def("isa", &isa_info, "isa() -> {isa, lanes, bf16_dot, int8_dot} of this build");
  m.def("rms_norm", &rms_norm, "rms_norm(x, w, eps)");
  m.def("add_rms_norm", &add_rms_norm, "add_rms_norm(x, residual, w, eps) -> [y, x + residual]");
  m.def("rotary", &rotary, "rotary(q, k, cos, sin) -> [q', k'] (rotate-half)");
  m.def("silu_mul", &silu_mul, "silu_mul(gate_up) -> silu(gate) * up");
  m.def("store_kv", &store_kv, "store_kv(k, v, k_cache, v_cache, slot_mapping), in place");
  m.def("quant_gemv", &quant_gemv, "quant_gemv(x, w, scales, bias): packed int4/int8 weights -> float32");
  m.def("quant_dequantize", &quant_dequantize, "quant_dequantize(w, scales, k) -> float32 [N, k]");
  m.def("gemv", &gemv, "gemv(x, w, scale, bias): decode GEMV (float32/bfloat16/int8 weights) -> float32");
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<std::vector<std::vector<torch::Tensor>>, std::vector<std::vector<int64_t>>, torch::Tensor, int64_t,
                    int64_t, int64_t, double, double>())
      .def("run", &DecodePlan::run, "run(h, cos, sin, kv_caches, slots, block_tables, context_lens)")
      .def("run_layers", &DecodePlan::run_layers,
           "run_layers(h, residual, cos, sin, kv_caches, slots, block_tables, context_lens) -> [h, residual]");
  m.def("paged_decode", &paged_decode, "paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out)");
  m.def("prefill_attention", &prefill_attention,
        "prefill_attention(q, k_cache, v_cache, block_table, ctx, scale): causal, one sequence, bfloat16");
  m.def("prefill_attention_supported", &prefill_attention_supported, "prefill_attention_supported(group, head_dim)");
}
