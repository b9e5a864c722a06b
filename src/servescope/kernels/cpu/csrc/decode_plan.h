// The DecodePlan (bound in bindings.cpp): every decoder layer of a decode-only step in one call,
// issuing the entry points of ops.h.
#pragma once

#include <memory>

#include "decode_plan_gemma.h"
#include "decode_plan_mla.h"
#include "decode_plan_moe.h"

namespace servescope_ops {

// Why: each layer is about a dozen kernel calls (norms, 4 GEMVs, rotary, KV store, attention); issued
// from Python through nn.Module dispatch their host time was a large share of a float32 batch-1 step
// of SmolLM2 (docs/BENCHMARKS.md). The plan holds the layers' weights and issues the very same
// kernels, in the same order with the same roundings, from C++: the result equals the module path
// bit for bit (tests/model/test_decode_plan.py), only the host time goes. A sparse layer's MLP is a
// PlanSparseMlp (decode_plan_moe.h); q/k norms per head (Qwen3) or over all heads at once (OLMoE); q/k/v and
// o_proj biases in the projections (Qwen2, gpt-oss), gpt-oss's sinks in the paged decode kernel; Gemma 2 / 3's
// sandwich norms, GELU-tanh MLP, soft-caps and local rotary tables (decode_plan_gemma.h).
struct PlanLayer {
  // q_norm / k_norm: empty unless the model normalises q, k; [D]: per head, [H D] / [Hkv D]: over all heads
  at::Tensor ln1, ln2, q_norm, k_norm;
  PlanLinear qkv, o, gate_up, down;          // gate_up, down: the dense MLP's (unused where `sparse`)
  std::shared_ptr<const PlanSparseMlp> sparse;  // a sparse layer's MLP, else null
  int64_t window;  // attention over the last `window` positions (a sliding layer), 0: the whole context
  std::shared_ptr<const PlanLatentAttention> latent;  // a latent layer's attention (set_latent), else null
  at::Tensor sinks;  // [H] float32: gpt-oss's learned sinks (one more logit per head in the softmax), empty: none
  PlanGemmaLayer gemma;  // Gemma's parts (set_gemma); default: none of them
};

class DecodePlan {
 public:
  // layers: per layer [ln1, ln2, q_norm, k_norm, then for qkv, o, gate_up, down each: w, scale, bias, packed,
  // packed_bias, panels] (empty tensors where absent); limits: per layer, the four projections' row limits
  // (gemv_rows, panel_rows) in turn; windows: per layer, its attention window (0: the whole context);
  // sparse: per layer, its sparse MLP (None: the dense one of gate_up and down); sinks: per layer, its attention
  // sinks [H] float32 (empty: none)
  DecodePlan(std::vector<std::vector<at::Tensor>> layers, std::vector<std::vector<int64_t>> limits,
             std::vector<int64_t> windows, std::vector<std::shared_ptr<PlanSparseMlp>> sparse, int64_t heads,
             int64_t kv_heads, int64_t head_dim, double eps, double scale, std::vector<at::Tensor> sinks)
      : heads_(heads), kv_heads_(kv_heads), head_dim_(head_dim), eps_(eps), scale_(scale) {
    TORCH_CHECK(limits.size() == layers.size() && windows.size() == layers.size() && sparse.size() == layers.size(),
                "DecodePlan: limits, windows and sparse MLPs per layer");
    TORCH_CHECK(sinks.size() == layers.size(), "DecodePlan: sinks per layer");
    for (const auto& s : sinks)
      TORCH_CHECK(!s.numel() || (s.scalar_type() == at::kFloat && s.numel() == heads && s.is_contiguous()),
                  "DecodePlan: sinks [H] float32");
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
      l.sparse = sparse[i];
      l.sinks = sinks[i];
      PlanLinear* lins[4] = {&l.qkv, &l.o, &l.gate_up, &l.down};
      for (int j = 0; j < 4; ++j) *lins[j] = plan_linear(&t[4 + 6 * j], r[2 * j], r[2 * j + 1]);
      const at::Tensor& qkv = l.qkv.w;  // (kept panels: [N / NP, ., NP, 4])
      TORCH_CHECK(!qkv.numel() || (qkv.dim() == 4 ? qkv.size(0) * qkv.size(2) : qkv.size(0)) ==
                                      (heads + 2 * kv_heads) * head_dim,
                  "DecodePlan: qkv rows");
      layers_.push_back(l);
    }
  }

  // Layer i's attention is latent (DeepSeek's MLA): its qkv and o entries unused (empty)
  void set_latent(int64_t i, std::shared_ptr<PlanLatentAttention> latent) {
    TORCH_CHECK(i >= 0 && i < (int64_t)layers_.size() && !layers_[i].qkv.w.numel() && layers_[i].window == 0 &&
                    !layers_[i].q_norm.numel() && !layers_[i].gemma.softcap && !layers_[i].gemma.local_rope,
                "DecodePlan: a latent layer has no qkv, window, q/k norms, soft-cap or local rotary tables");
    layers_[i].latent = std::move(latent);
  }

  // Layer i is Gemma's (decode_plan_gemma.h): post_attn, post_ff its post_attention_layernorm and
  // post_feedforward_layernorm weights (empty: none; the layer's ln2 is its pre_feedforward_layernorm), the dense
  // MLP's GELU-tanh, the attention soft-cap, the local rotary tables
  void set_gemma(int64_t i, at::Tensor post_attn, at::Tensor post_ff, bool gelu_tanh, double softcap, bool local_rope) {
    TORCH_CHECK(i >= 0 && i < (int64_t)layers_.size() && !layers_[i].latent, "DecodePlan: set_gemma of a layer");
    const PlanLayer& l = layers_[i];
    TORCH_CHECK(!gelu_tanh || !l.sparse, "DecodePlan: GELU-tanh in a dense MLP only");
    TORCH_CHECK(post_attn.numel() == post_ff.numel() && (!post_attn.numel() || post_attn.numel() == l.ln2.numel()),
                "DecodePlan: both sandwich norms [Dm] or neither");
    TORCH_CHECK(softcap >= 0.0, "DecodePlan: softcap >= 0");
    layers_[i].gemma = {std::move(post_attn), std::move(post_ff), gelu_tanh, softcap, local_rope};
  }

  // The layers: from (h, residual) [T, Dm] (residual empty: h is the embeddings; else as the previous
  // pipeline stage handed them on) -> [h, residual] for the next stage or the model's final norm.
  // cos/sin [T, 1, D/2] float32 (cos_local / sin_local: the local layers' tables, empty where none is local),
  // kv_caches per layer (K, V) [N, S, Hkv, D] (the ModelRunner's list as it is), slots [T] int64, block_tables
  // [T, M] int32, context_lens [T] int32 (one decode token per sequence).
  std::vector<at::Tensor> run_layers(at::Tensor h, at::Tensor residual, at::Tensor cos, at::Tensor sin,
                                        const std::vector<std::tuple<at::Tensor, at::Tensor>>& kv_caches,
                                        at::Tensor slots, at::Tensor block_tables, at::Tensor context_lens,
                                        at::Tensor cos_local, at::Tensor sin_local) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "DecodePlan: caches per layer");
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
      at::Tensor a;
      if (l.latent || !l.qkv.w.numel()) {  // DeepSeek's latent attention (decode_plan_mla.h)
        TORCH_CHECK(l.latent, "DecodePlan: layer ", i, " has no attention (set_latent)");
        a = l.latent->run(x, cos, sin, std::get<0>(kv_caches[i]), slots, block_tables, context_lens);
      } else {
        const bool local = l.gemma.local_rope;
        TORCH_CHECK(!local || (cos_local.defined() && cos_local.numel()), "DecodePlan: layer ", i,
                    " is rotated with the local tables: none given");
        a = attention(l, x, local ? cos_local : cos, local ? sin_local : sin, kv_caches[i], slots, block_tables,
                      context_lens);
      }
      if (l.gemma.post_attn.numel()) a = rms_norm(a, l.gemma.post_attn, eps_);
      auto r = add_rms_norm(a, residual, l.ln2, eps_);
      residual = r[1];
      h = mlp(l, r[0]);
    }
    return {h, residual};
  }

 private:
  // the layer's attention of its normed input x [T, Dm] -> o_proj's output [T, Dm] (K, V of the step stored)
  at::Tensor attention(const PlanLayer& l, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                       const std::tuple<at::Tensor, at::Tensor>& kv, const at::Tensor& slots,
                       const at::Tensor& block_tables, const at::Tensor& context_lens) const {
    const int64_t t = x.size(0), qs = heads_ * head_dim_, kvs = kv_heads_ * head_dim_;
    auto qkv = linear(x, l.qkv);  // [T, (H + 2 Hkv) D]
    auto q = qk_normed(qkv.narrow(1, 0, qs), l.q_norm, heads_);
    auto k = qk_normed(qkv.narrow(1, qs, kvs), l.k_norm, kv_heads_);
    auto v = qkv.narrow(1, qs + kvs, kvs).view({t, kv_heads_, head_dim_});
    auto qk = rotary(q, k, cos, sin);
    const auto& [k_cache, v_cache] = kv;
    store_kv(qk[1], v, k_cache, v_cache, slots);
    auto o = paged_decode(qk[0], k_cache, v_cache, block_tables, context_lens, scale_, at::Tensor(), l.window,
                          l.gemma.softcap, l.sinks);
    return linear(o.reshape({t, qs}), l.o);
  }

  // the layer's MLP of its normed input x [T, Dm] -> [T, Dm] (Gemma's: post_feedforward_layernorm's output)
  at::Tensor mlp(const PlanLayer& l, const at::Tensor& x) const {
    at::Tensor out;
    if (l.sparse) {
      out = l.sparse->run(x);
    } else {
      auto gate_up = linear(x, l.gate_up);
      out = linear(l.gemma.gelu_tanh ? gelu_tanh_mul(gate_up) : silu_mul(gate_up), l.down);
    }
    return l.gemma.post_ff.numel() ? rms_norm(out, l.gemma.post_ff, eps_) : out;
  }

  // one part of the qkv row [T, n Hd] -> [T, n, D], normalised as the module does: per head ([D] weight),
  // over the whole part before the head split ([n D] weight: OLMoE), or not at all (empty)
  at::Tensor qk_normed(const at::Tensor& part, const at::Tensor& w, int64_t n) const {
    const int64_t t = part.size(0);
    if (!w.numel()) return part.view({t, n, head_dim_});
    if (w.numel() == head_dim_) return rms_norm(part.view({t, n, head_dim_}), w, eps_);
    return rms_norm(part, w, eps_).view({t, n, head_dim_});
  }

  std::vector<PlanLayer> layers_;
  int64_t heads_, kv_heads_, head_dim_;
  double eps_, scale_;
};

}  // namespace servescope_ops
