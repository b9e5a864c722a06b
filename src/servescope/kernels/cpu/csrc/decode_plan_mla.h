// A latent attention layer of the DecodePlan (decode_plan.h): model/mla.py's LatentAttention.forward for
// decode rows (DeepSeek-V2/V3's MLA in the absorbed form), from the layer's normed input to o_proj's output.
#pragma once

#include <ATen/ops/cat.h>
#include <ATen/ops/einsum.h>

#include "plan_linear.h"

namespace servescope_ops {

// Why: a latent layer is about twenty torch ops in Python (the query's LoRA, the latent's split and norm, the
// rope parts' interleave and rotation, the cache write, the two absorbed products, the decode): DeepSeek
// decoded op by op while every other family ran its layers in one call. The same ops in the same order here:
// the projections, norms, rotary and the decode kernel are the ones the module's calls reach (CpuLinear and
// the other plan linears, fused_ops' C++ kernels, the CPU backend's latent_decode), the rest the very ATen
// ops it calls (cat, index_copy_, einsum): bit for bit (tests/model/test_decode_plan_mla.py).
class PlanLatentAttention {
 public:
  // linears: the plan_entry tensors (6 each) of the query's projections (q_proj; or q_a_proj then q_b_proj),
  // kv_a_proj_with_mqa and o_proj, their row limits (2 each) in the same order; q_a_norm: q_a_layernorm's
  // weight (empty: no query LoRA); kv_a_norm: kv_a_layernorm's; w_uk [H, n, r], w_uv [H, v, r]: kv_b_proj's
  // weight as the module views it; nope, rope: a head's n and R; interleave: DeepSeek's interleaved rope pairs
  PlanLatentAttention(std::vector<Tensor> linears, std::vector<int64_t> limits, Tensor q_a_norm, Tensor kv_a_norm,
                      Tensor w_uk, Tensor w_uv, int64_t nope, int64_t rope, bool interleave, double eps, double scale)
      : q_a_norm_(std::move(q_a_norm)), kv_a_norm_(std::move(kv_a_norm)), w_uk_(std::move(w_uk)),
        w_uv_(std::move(w_uv)), nope_(nope), rope_(rope), interleave_(interleave), eps_(eps), scale_(scale) {
    const size_t n = q_a_norm_.numel() ? 4 : 3;  // projections
    TORCH_CHECK(linears.size() == 6 * n && limits.size() == 2 * n,
                "PlanLatentAttention: 6 tensors and 2 limits per projection (q_a, q_b or q; kv_a; o)");
    TORCH_CHECK(w_uk_.dim() == 3 && w_uv_.dim() == 3 && w_uk_.size(0) == w_uv_.size(0) && w_uk_.size(1) == nope &&
                    w_uk_.size(2) == w_uv_.size(2) && kv_a_norm_.numel() == w_uk_.size(2),
                "PlanLatentAttention: W_UK [H, n, r], W_UV [H, v, r], kv_a_norm [r]");
    std::vector<PlanLinear> l;
    for (size_t j = 0; j < n; ++j) l.push_back(plan_linear(&linears[6 * j], limits[2 * j], limits[2 * j + 1]));
    if (n == 4) {
      q_a_ = l[0];
      q_b_ = l[1];
    } else {
      q_ = l[0];
    }
    kv_a_ = l[n - 2];
    o_ = l[n - 1];
    heads_ = w_uk_.size(0);
    rank_ = w_uk_.size(2);
    v_dim_ = w_uv_.size(1);
    TORCH_CHECK(rope % 2 == 0, "PlanLatentAttention: an even rope width");
  }

  // x [T, Dm] (the input norm's output, one decode token per sequence) -> o_proj's output [T, Dm]; the
  // latent rows [c | k_pe] written into cache [N, S, 1, r + R] at slots. cos/sin [T, 1, R/2] float32;
  // block_tables [T, M] int32, context_lens [T] int32.
  Tensor run(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& cache, const Tensor& slots,
             const Tensor& block_tables, const Tensor& context_lens) const {
    const int64_t t = x.size(0);
    const Tensor q = q_a_norm_.numel() ? linear(rms_norm(linear(x, q_a_), q_a_norm_, eps_), q_b_) : linear(x, q_);
    const Tensor qh = q.view({t, heads_, nope_ + rope_});
    const Tensor kv = linear(x, kv_a_);  // [T, r + R]
    auto qk = rotary(rope_part(qh.narrow(2, nope_, rope_)), rope_part(kv.narrow(1, rank_, rope_).unsqueeze(1)), cos,
                     sin);
    const Tensor latent = at::cat({rms_norm(kv.narrow(1, 0, rank_).contiguous(), kv_a_norm_, eps_), qk[1].select(1, 0)},
                                  -1);
    cache.view({-1, cache.size(-1)}).index_copy_(0, slots, latent.to(cache.scalar_type()));
    const Tensor q_lat = at::einsum("bhn,hnr->bhr", {qh.narrow(2, 0, nope_), w_uk_});  // W_UK folded into the query
    const Tensor qa = at::cat({q_lat, qk[0]}, -1).contiguous();                       // [T, H, r + R]
    const Tensor o = latent_decode(qa, cache, block_tables, context_lens, scale_, rank_);  // [T, H, r]
    const Tensor out = at::einsum("bhr,hvr->bhv", {o, w_uv_}).contiguous();             // W_UV after attention
    return linear(out.view({t, heads_ * v_dim_}), o_);
  }

 private:
  // the rope features as rotate-half takes them: DeepSeek's interleaved pairs laid out as the even features
  // then the odd ones (model/mla.py's _rotate), contiguous
  Tensor rope_part(const Tensor& p) const {
    if (!interleave_) return p.contiguous();
    return at::cat({p.slice(-1, 0, rope_, 2), p.slice(-1, 1, rope_, 2)}, -1).contiguous();
  }

  PlanLinear q_{}, q_a_{}, q_b_{}, kv_a_{}, o_{};
  Tensor q_a_norm_, kv_a_norm_, w_uk_, w_uv_;
  int64_t nope_, rope_, heads_ = 0, rank_ = 0, v_dim_ = 0;
  bool interleave_;
  double eps_, scale_;
};

}  // namespace servescope_ops
