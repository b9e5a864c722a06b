// The DecodePlan (bound in bindings.cpp): every decoder layer of a decode-only step in one call,
// issuing the entry points of ops.h.
#pragma once

#include "ops.h"

namespace servescope_ops {

// Why: each layer is about a dozen kernel calls (norms, 4 GEMVs, rotary, KV store, attention); issued
// from Python through nn.Module dispatch their host time was a large share of a float32 batch-1 step
// of SmolLM2 (docs/BENCHMARKS.md). The plan holds the layers' weights and issues the very same
// kernels, in the same order with the same roundings, from C++: the result equals the module path
// bit for bit (tests/model/test_decode_plan.py), only the host time goes.
struct PlanLinear {
  at::Tensor w, scale, bias;  // w [N, K] float32 | bfloat16 | int8; scale [N] f32 (int8) or empty; bias [N] f32 or empty
  at::Tensor packed, packed_bias;  // oneDNN's prepacked weight and the bias in the model dtype (or empty)
  at::Tensor panels;               // float32 weights as column panels (panel_gemm.h) or empty
  int64_t gemv_rows, panel_rows;   // the GEMV up to gemv_rows rows, the panel GEMM up to panel_rows, oneDNN
                                   // above (CpuLinear's dispatch)
};

struct PlanLayer {
  at::Tensor ln1, ln2, q_norm, k_norm;  // q_norm / k_norm empty unless the model normalises q, k per head
  PlanLinear qkv, o, gate_up, down;
  int64_t window;  // attention over the last `window` positions (a sliding layer), 0: the whole context
};

class DecodePlan {
 public:
  // layers: per layer [ln1, ln2, q_norm, k_norm, then for qkv, o, gate_up, down each: w, scale, bias, packed,
  // packed_bias, panels] (empty tensors where absent); limits: per layer, the four projections' row limits
  // (gemv_rows, panel_rows) in turn; windows: per layer, its attention window (0: the whole context)
  DecodePlan(std::vector<std::vector<at::Tensor>> layers, std::vector<std::vector<int64_t>> limits,
             std::vector<int64_t> windows, int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(limits.size() == layers.size() && windows.size() == layers.size(), "DecodePlan: limits per layer");
    for (size_t i = 0; i < layers.size(); ++i) {
      const auto& t = layers[i];
      const auto& r = limits[i];
      TORCH_CHECK(t.size() == 28 && r.size() == 8, "DecodePlan: 28 tensors and 8 limits per layer");
      PlanLayer l;
      l.window = windows[i];
      l.ln1 = t[0];
      l.ln2 = t[1];
      l.q_norm = t[2];
      l.k_norm = t[3];
      PlanLinear* lins[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
      for (int j = 0; j < 4; ++j) {
        const at::Tensor* e = &t[4 + 6 * j];
        *lins[j] = {e[0], e[1], e[2], e[3], e[4], e[5], r[2 * j], r[2 * j + 1]};
        TORCH_CHECK(!e[5].numel() || e[0].scalar_type() == at::kFloat, "DecodePlan: panels of float32 weights only");
      }
      TORCH_CHECK(l.qkv.w.size(0) == (heads + 2 * kv_heads) * head_dim, "DecodePlan: qkv rows");
      layers_.push_back(l);
    }
  }

  // The layers: from (h, residual) [T, Dm] (residual empty: h is the embeddings; else as the previous
  // pipeline stage handed them on) -> [h, residual] for the next stage or the model's final norm.
  // cos/sin [T, 1, D/2] float32, kv_caches per layer (K, V) [N, S, Hkv, D] (the ModelRunner's list as it
  // is), slots [T] int64, block_tables [T, M] int32, context_lens [T] int32 (one decode token per sequence).
  std::vector<at::Tensor> run_layers(at::Tensor h, at::Tensor residual, at::Tensor cos, at::Tensor sin,
                                        const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
                                        at::Tensor slots, at::Tensor block_tables,
                                        at::Tensor context_lens) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodePlan: caches per layer");
    const int64_t t = h.size(0), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const PlanLayer& l = layers_[i];
      at::Tensor x;
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
      auto o = paged_decode(qk[0], k_cache, v_cache, block_tables, context_lens, scale_, at::Tensor(), l.window);
      auto r = add_rms_norm(linear(o.reshape({t, qs}), l.o), residual, l.ln2, eps_);
      residual = r[1];
      h = linear(silu_mul(linear(r[0], l.gate_up)), l.down);
    }
    return {h, residual};
  }

 private:
  static at::Tensor linear(const at::Tensor& x, const PlanLinear& l) {
    if (x.size(0) <= l.gemv_rows) return gemv(x, l.w, l.scale, l.bias).to(x.scalar_type());
    if (x.size(0) <= l.panel_rows && l.panels.numel()) return panel_gemm(x, l.panels, l.w.size(0), l.bias);
    TORCH_CHECK(l.packed.defined() && l.packed.numel(), "DecodePlan: no prepacked weight for this batch");
    return onednn_linear(x, l.packed, l.packed_bias);
  }

  std::vector<PlanLayer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace servescope_ops
