// DeepSeek's part of a sparse layer of the DecodePlan (decode_plan_moe.h's PlanSparseMlp): model/moe.py's
// route_deepseek (V2's softmax, V3's sigmoid with the correction bias, group-limited top-k, normalisation,
// routed_scaling_factor) and the ungated shared experts added to the routed ones.
#pragma once

#include <ATen/ops/linear.h>
#include <ATen/ops/zeros_like.h>

#include <functional>
#include <limits>

#include "plan_linear.h"

namespace servescope_ops {

// Why: DeepSeek's routing is a score function, group scores, a mask and two top-k in float32, about fifteen
// torch ops per layer; they are the very ATen ops route_deepseek calls, in its order (so the same bits), and
// the block's own fused experts handle and the plan's projections for the shared experts.
struct PlanDeepseekMoe {
  Tensor weight;  // [E, Dm] float32: the router's weight as the block routes with it (SparseMoeBlock._float32_router)
  Tensor bias;    // [E] float32: V3's e_score_correction_bias, or empty (V2)
  bool v3;        // sigmoid scores with the bias for the choice; else softmax scores
  int64_t top_k, n_group, topk_group;
  bool norm;       // norm_topk_prob: the kept weights scaled to sum to 1
  double scaling;  // routed_scaling_factor
  PlanLinear shared_gate_up{}, shared_down{};  // the shared experts' MLP (gate_up empty: none)

  // x [T, Dm] -> (weights [T, k] float32, ids [T, k]): route_deepseek(F.linear(x.float(), weight), spec, bias)
  std::tuple<Tensor, Tensor> route(const Tensor& x) const {
    const Tensor logits = at::linear(x.to(at::kFloat), weight);
    const Tensor scores = v3 ? logits.sigmoid() : logits.softmax(-1, at::kFloat);
    Tensor choice = v3 ? scores.add(bias) : scores;
    if (n_group > 1) {
      const Tensor grouped = choice.view({-1, n_group, weight.size(0) / n_group});  // [T, G, E/G]
      const Tensor group_scores =
          v3 ? std::get<0>(grouped.topk(2, -1)).sum(at::IntArrayRef{-1}) : std::get<0>(grouped.max(-1));
      Tensor keep = at::zeros_like(group_scores).scatter_(1, std::get<1>(group_scores.topk(topk_group, -1)), 1);
      keep = keep.to(at::kBool).unsqueeze(2).expand_as(grouped).reshape(choice.sizes());
      choice = choice.masked_fill(keep.bitwise_not(), v3 ? -std::numeric_limits<double>::infinity() : 0.0);
    }
    const Tensor ids = std::get<1>(choice.topk(top_k, -1));
    Tensor w = scores.gather(1, ids);
    if (norm) w = w.div(w.sum(at::IntArrayRef{-1}, true).add(1e-20));
    return {w.mul(scaling), ids};
  }

  // the block's forward: the routed experts (run, the fused op's; their tokens per expert added to counts), then
  // the shared experts' output added
  Tensor run(const Tensor& x,
             const std::function<std::vector<Tensor>(const Tensor&, const Tensor&, const Tensor&)>& experts,
             const Tensor& counts) const {
    auto [w, ids] = route(x);
    auto r = experts(x, ids, w);
    counts.add_(r[1]);
    if (!shared_gate_up.w.numel()) return r[0];
    return r[0].add(linear(silu_mul(linear(x, shared_gate_up)), shared_down));
  }
};

}  // namespace servescope_ops
