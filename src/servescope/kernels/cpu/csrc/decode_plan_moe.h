// A sparse MLP layer of the DecodePlan (decode_plan.h): model/moe.py's SparseMoeBlock.forward for the softmax
// top-k router over experts on a fused op (MoePacked: packed group-32 experts; MoeDense: float32, bfloat16 or
// per-channel int8 ones), with Qwen2-MoE's gated shared expert; gpt-oss's biased top-k-then-softmax router
// over its biased clamped-SwiGLU experts (either op, act 1).
#pragma once

#include <ATen/ops/linear.h>

#include <functional>
#include <memory>

#include "decode_plan_router.h"
#include "plan_linear.h"

namespace servescope_ops {

// Why: the block's forward is about a dozen torch ops around the one fused expert call (router, softmax,
// top-k, renormalisation, the counts, the shared expert and its gate), whose host time per layer is what
// the cost model's kernel table does not see. The same ops in the same order here: the router and the
// routing are the very ATen ops the module calls (so the same kernels and roundings: bit for bit), the
// experts the same MoePacked, the shared expert the plan's projections (the modules' kernels).
class PlanSparseMlp {
 public:
  // a fused experts op's run(x, ids, weights) -> [out, counts] (MoePacked::run, MoeDense::run)
  using Experts = std::function<std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&)>;

  // experts: the fused op's run over num_experts experts; router [E, Dm] (the module's nn.Linear weight, in the activation dtype); renormalise: the kept top-k
  // weights scaled to sum to 1; counts [E] int64: the block's routed_tokens, to which each call adds its
  // tokens per expert (the step record's source, model/moe.take_step_routing); shared: the shared expert's
  // gate_up and down plan_entry tensors (6 each) and their row limits (4), shared_gate [1, Dm] its sigmoid
  // gate's weight (all empty: no shared expert)
  PlanSparseMlp(Tensor router, int64_t top_k, bool renormalise, Experts experts, int64_t num_experts, Tensor counts,
                std::vector<Tensor> shared, std::vector<int64_t> shared_limits, Tensor shared_gate)
      : router_(std::move(router)), top_k_(top_k), renormalise_(renormalise), experts_(std::move(experts)),
        counts_(std::move(counts)), shared_gate_(std::move(shared_gate)) {
    TORCH_CHECK(router_.dim() == 2 && router_.size(0) == num_experts, "PlanSparseMlp: router [E, Dm]");
    TORCH_CHECK(counts_.numel() == num_experts && counts_.scalar_type() == at::kLong,
                "PlanSparseMlp: counts [E] int64");
    TORCH_CHECK(top_k_ > 0 && top_k_ <= num_experts, "PlanSparseMlp: 0 < top_k <= E");
    TORCH_CHECK(shared.empty() == !shared_gate_.numel(), "PlanSparseMlp: a shared expert comes with its gate");
    if (!shared.empty()) {
      TORCH_CHECK(shared.size() == 12 && shared_limits.size() == 4, "PlanSparseMlp: 12 shared tensors, 4 limits");
      shared_gate_up_ = plan_linear(&shared[0], shared_limits[0], shared_limits[1]);
      shared_down_ = plan_linear(&shared[6], shared_limits[2], shared_limits[3]);
    }
  }

  // DeepSeek's block (decode_plan_router.h) in place of the softmax top-k router and the gated shared expert
  void set_deepseek(std::shared_ptr<const PlanDeepseekMoe> d) {
    TORCH_CHECK(!shared_gate_.numel() && d->weight.size(0) == router_.size(0) && d->top_k <= router_.size(0),
                "PlanSparseMlp: DeepSeek's router over these experts, without a gated shared expert");
    deepseek_ = std::move(d);
  }

  // gpt-oss's block (router "gpt_oss"): the router's bias [E] (its nn.Linear's, in the activation dtype); run
  // routes as model/moe.route_gpt_oss does, over experts with their biases and clamped SwiGLU (the fused op's)
  void use_gpt_oss_router(Tensor router_bias) {
    TORCH_CHECK(router_bias.dim() == 1 && router_bias.size(0) == router_.size(0) &&
                    router_bias.scalar_type() == router_.scalar_type(),
                "PlanSparseMlp: gpt-oss's router bias [E] in the router's dtype");
    TORCH_CHECK(!renormalise_ && !shared_gate_.numel(), "PlanSparseMlp: gpt-oss's router renormalises nothing and "
                "has no shared expert");
    router_bias_ = std::move(router_bias);
  }

  // x [T, Dm] (the post-attention norm's output) -> the MLP's output [T, Dm] in x's dtype
  Tensor run(const Tensor& x) const {
    if (deepseek_) return deepseek_->run(x, experts_, counts_);  // DeepSeek's router and shared experts
    if (router_bias_.defined()) return run_gpt_oss(x);
    // route(): softmax in float32, the top k, renormalised where asked, back to the logits' dtype
    const Tensor logits = at::linear(x, router_);
    auto [weights, ids] = logits.softmax(-1, at::kFloat).topk(top_k_, -1);
    if (renormalise_) weights = weights.div(weights.sum(at::IntArrayRef{-1}, true));
    auto r = experts_(x, ids, weights.to(logits.scalar_type()));
    counts_.add_(r[1]);
    if (!shared_gate_.numel()) return r[0];
    const Tensor gate = at::linear(x, shared_gate_).sigmoid();
    return r[0].add(gate.mul(linear(silu_mul(linear(x, shared_gate_up_)), shared_down_)));
  }

 private:
  // route_gpt_oss's ops: the biased router's top k logits, softmaxed over those k in their own dtype
  Tensor run_gpt_oss(const Tensor& x) const {
    const Tensor logits = at::linear(x, router_, router_bias_);
    auto [top, ids] = logits.topk(top_k_, -1);
    auto r = experts_(x, ids, top.softmax(-1, top.scalar_type()));
    counts_.add_(r[1]);
    return r[0];
  }

  Tensor router_, router_bias_;  // router_bias_: gpt-oss's (undefined: the softmax top-k router's, no bias)
  int64_t top_k_;
  bool renormalise_;
  Experts experts_;
  Tensor counts_;
  PlanLinear shared_gate_up_{}, shared_down_{};
  Tensor shared_gate_;
  std::shared_ptr<const PlanDeepseekMoe> deepseek_;
};

}  // namespace servescope_ops
