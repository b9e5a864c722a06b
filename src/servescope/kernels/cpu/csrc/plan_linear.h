// One projection of the DecodePlan (decode_plan.h, decode_plan_moe.h): its weights as the module holds
// them and the kernel the module would choose for the step's rows.
#pragma once

#include "ops.h"

namespace servescope_ops {

struct PlanLinear {
  at::Tensor w, scale, bias;  // w [N, K] float32 | bfloat16 | int8; scale [N] f32 (int8) or empty; bias [N] f32 or empty
  at::Tensor packed, packed_bias;  // oneDNN's prepacked weight and the bias in the model dtype (or empty)
  at::Tensor panels;               // float32 weights as column panels (panel_gemm.h) or empty
  int64_t gemv_rows, panel_rows;   // the GEMV up to gemv_rows rows, the panel GEMM up to panel_rows, oneDNN
                                   // above (CpuLinear's dispatch)
};

// e: the module's plan_entry tensors [w, scale, bias, packed, packed_bias, panels]; limits (gemv_rows, panel_rows)
inline PlanLinear plan_linear(const at::Tensor* e, int64_t gemv_rows, int64_t panel_rows) {
  TORCH_CHECK(!e[5].numel() || e[0].scalar_type() == at::kFloat, "DecodePlan: panels of float32 weights only");
  return {e[0], e[1], e[2], e[3], e[4], e[5], gemv_rows, panel_rows};
}

// x [T, K] -> [T, N] in x's dtype: the module's forward (CpuLinear, Int8Linear, QuantLinear) by rows
inline at::Tensor linear(const at::Tensor& x, const PlanLinear& l) {
  if (x.size(0) <= l.gemv_rows) return gemv(x, l.w, l.scale, l.bias).to(x.scalar_type());
  if (x.size(0) <= l.panel_rows && l.panels.numel()) return panel_gemm(x, l.panels, l.w.size(0), l.bias);
  TORCH_CHECK(l.packed.defined() && l.packed.numel(), "DecodePlan: no prepacked weight for this batch");
  return onednn_linear(x, l.packed, l.packed_bias);
}

}  // namespace servescope_ops
