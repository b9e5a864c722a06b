// One MoE layer's routed experts over float (float32 | bfloat16) or per-channel int8 weights in one call: the
// fused op for the experts most checkpoints load as (Mixtral, Qwen2/3-MoE, OLMoE from HF in bfloat16 or
// float32, or --quantization int8), beside moe_experts.h's for packed group-32 ones; gpt-oss's biases and clamped
// SwiGLU over either (ClampedExperts; PackedClampedExperts of Int8Linears). Declared in ops.h.
//
// Why: model/moe.py's grouped_experts, the reference, issues about four torch ops per active expert and layer
// from Python (plus the grouping's and the sum's), whose host time a decode step pays with no weight moved.
// Here the grouping (moe_route), the gathers and the weighted sum (moe_combine) are loops, and each active
// expert's two projections issue, from C++, the kernel its module would choose for that many rows: the
// decode GEMV of kernels.h (gemv_rows, or gemv_rows_bf16_dot for 2+ bfloat16 rows on bfloat16 weights where the CPU
// has AVX512-BF16: as cpu_linear.gemv calls them) up to the module's row limit (float
// experts: model/moe_fused.py's EXPERT_GEMV_ROWS; Int8Linear: cpu_linear.MAX_ROWS), above it ATen's linear (what Experts.run and Int8Linear's eager path call: over the int8 weight
// dequantised to the activation dtype, times the scale in that dtype). Each expert's rows go through the
// same call with the same row count and thread count as in the reference, every intermediate is rounded
// where the reference's tensors are (the GEMV's float32 result to the activation dtype before silu, the down
// projection's before the weighted sum), and a token's sum runs in expert order: the output equals
// grouped_experts' bit for bit (tests/model/test_moe_dense.py).
//
// The experts run one after the other (each GEMV splits its columns over the threads as a dense linear
// does), not in one shared loop as the packed op does: the GEMV's result for a column depends on where the
// thread split falls, so a shared loop would no longer equal the module's call.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/linear.h>

#include "moe_experts.h"
#include "ops.h"

namespace servescope_ops {

namespace {

// y [m, N] float32 = the expert's projection of rows [m, K] (its float32 copy xf for the GEMV), as the module
// computes it: the GEMV up to gemv_rows rows, else ATen's linear (int8: over the dequantised weight, times the
// scale in the rows' dtype)
void expert_rows(const Tensor& w, const Tensor& scale, const Tensor& scale_act, const Tensor& rows, const float* xf,
                 int64_t gemv_rows, float* y) {
  const int64_t m = rows.size(0), k = w.size(1), n = w.size(0);
  if (m <= gemv_rows) {
    if (gemv_bf16_dot_into(rows, w, nullptr, y)) return;  // 2+ bfloat16 rows: as cpu_linear.gemv chooses
    const float* s = scale.numel() ? scale.data_ptr<float>() : nullptr;
    if (w.scalar_type() == at::kFloat)
      servescope_kernels::gemv_rows<float>(xf, m, k, w.data_ptr<float>(), n, s, nullptr, y);
    else if (w.scalar_type() == at::kBFloat16)
      servescope_kernels::gemv_rows<servescope_simd::bf16>(xf, m, k, (const servescope_simd::bf16*)w.data_ptr(), n,
                                                           s, nullptr, y);
    else
      servescope_kernels::gemv_rows<int8_t>(xf, m, k, w.data_ptr<int8_t>(), n, s, nullptr, y);
    return;
  }
  Tensor out = w.scalar_type() == at::kChar ? at::linear(rows, w.to(rows.scalar_type())).mul(scale_act)
                                            : at::linear(rows, w);
  at::from_blob(y, {m, n}, rows.options().dtype(at::kFloat)).copy_(out);
}

}  // namespace

MoeDense::MoeDense(std::vector<Tensor> gate_up, std::vector<Tensor> down, std::vector<Tensor> gate_up_scale,
                   std::vector<Tensor> down_scale, std::vector<Tensor> gate_up_scale_act,
                   std::vector<Tensor> down_scale_act, int64_t first, int64_t gemv_rows, Tensor gate_up_bias,
                   Tensor down_bias, int64_t act, double alpha, double limit)
    : first_(first), gemv_rows_(gemv_rows), act_(act), clamped_{gate_up_bias, down_bias, alpha, limit} {
  TORCH_CHECK(!gate_up.empty() && gate_up.size() == down.size(), "MoeDense: as many down as gate_up matrices");
  TORCH_CHECK(first >= 0, "MoeDense: first must be >= 0");
  const auto dtype = gate_up[0].scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar,
              "MoeDense: float32, bfloat16 or int8 weights");
  const bool int8 = dtype == at::kChar;
  const size_t scales = int8 ? gate_up.size() : 0;
  TORCH_CHECK(gate_up_scale.size() == scales && down_scale.size() == scales && gate_up_scale_act.size() == scales &&
                  down_scale_act.size() == scales,
              "MoeDense: int8 weights take a float32 scale and one in the activation dtype per expert; float ones none");
  const int64_t two_i = gate_up[0].size(0), h = gate_up[0].size(1);
  TORCH_CHECK(two_i % 2 == 0 && down[0].dim() == 2 && down[0].size(0) == h && down[0].size(1) == two_i / 2,
              "MoeDense: gate_up [2I, H] and down [H, I]");
  for (size_t e = 0; e < gate_up.size(); ++e) {
    for (const auto* w : {&gate_up[e], &down[e]}) {
      TORCH_CHECK(w->dim() == 2 && w->is_contiguous() && w->device().is_cpu() && w->scalar_type() == dtype,
                  "MoeDense: every expert's matrices contiguous on the CPU in one dtype");
      TORCH_CHECK(w->sizes() == (w == &gate_up[e] ? gate_up[0].sizes() : down[0].sizes()),
                  "MoeDense: every expert in one shape");
    }
    if (int8)
      for (const auto& s : {gate_up_scale[e], down_scale[e]})
        TORCH_CHECK(s.scalar_type() == at::kFloat && s.is_contiguous(), "MoeDense: float32 scales [N]");
  }
  TORCH_CHECK(act == servescope_moe::MOE_ACT_SILU || act == servescope_moe::MOE_ACT_CLAMPED_SWIGLU,
              "MoeDense: act 0 (silu) or 1 (clamped SwiGLU)");
  const bool clamped = act == servescope_moe::MOE_ACT_CLAMPED_SWIGLU;
  TORCH_CHECK(clamped == (gate_up_bias.numel() > 0) && clamped == (down_bias.numel() > 0),
              "MoeDense: the clamped SwiGLU (act 1) comes with both biases, silu with none");
  if (clamped) {  // (int8 experts: the biases in their activation dtype, the scale_act's)
    const int64_t e = (int64_t)gate_up.size();
    TORCH_CHECK(gate_up_bias.sizes() == at::IntArrayRef({e, two_i}) && down_bias.sizes() == at::IntArrayRef({e, h}),
                "MoeDense: biases gate_up [E, 2I] and down [E, H]");
    const auto act_dtype = int8 ? gate_up_scale_act[0].scalar_type() : dtype;
    TORCH_CHECK(gate_up_bias.scalar_type() == act_dtype && down_bias.scalar_type() == act_dtype &&
                    gate_up_bias.device().is_cpu() && down_bias.device().is_cpu(),
                "MoeDense: biases on the CPU in the activation dtype");
  }
  gate_up_ = {gate_up, gate_up_scale, gate_up_scale_act};
  down_ = {down, down_scale, down_scale_act};
}

int64_t MoeDense::num_experts() const { return (int64_t)gate_up_.w.size(); }

// y [P, N] float32 = each active expert's projection of its rows of xs [P, K]
void MoeDense::project(const Proj& p, const servescope_moe::MoeRoute& r, const Tensor& xs, float* y) const {
  const Tensor xf = xs.to(at::kFloat).contiguous();  // (the GEMV reads float32 rows, as cpu_linear.gemv hands it)
  const int64_t n = p.w[0].size(0), k = xs.size(1);
  for (int64_t e = 0; e < num_experts(); ++e) {
    const int64_t s = r.start[e], m = r.start[e + 1] - s;
    if (m == 0) continue;
    expert_rows(p.w[e], p.scale.empty() ? Tensor() : p.scale[e], p.scale_act.empty() ? Tensor() : p.scale_act[e],
                xs.narrow(0, s, m), xf.data_ptr<float>() + s * k, gemv_rows_, y + s * n);
  }
}

// gpt-oss's hidden rows [P, I] of the gate|up products g [P, 2I] float32: rounded to the weights' dtype, plus
// each pair's expert's bias (ATen's add, as the module adds it), then clamped_swiglu, the kernel
// ClampedExperts.hidden calls (whose rows give the same bits in any batch: the same bits as the module)
Tensor MoeDense::clamped_hidden(const Tensor& g, const Tensor& expert_of) const {
  const Tensor gate_up = g.to(clamped_.gate_up_bias.scalar_type()).add(clamped_.gate_up_bias.index_select(0, expert_of));
  return clamped_swiglu(gate_up, clamped_.limit, clamped_.alpha);
}

Tensor clamped_swiglu(const Tensor& gate_up, double limit, double alpha) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.device().is_cpu(),
              "clamped_swiglu: gate_up [n, 2I] on the CPU");
  const Tensor g = gate_up.contiguous();
  const int64_t n = g.size(0), inner = g.size(1) / 2;
  Tensor h = at::empty({n, inner}, g.options());
  if (g.scalar_type() == at::kFloat)
    servescope_moe::moe_clamped_swiglu<float, float>(g.data_ptr<float>(), n, inner, (float)alpha, (float)limit,
                                                     h.data_ptr<float>());
  else if (g.scalar_type() == at::kBFloat16)
    servescope_moe::moe_clamped_swiglu<servescope_simd::bf16, servescope_simd::bf16>(
        (const servescope_simd::bf16*)g.data_ptr(), n, inner, (float)alpha, (float)limit,
        (servescope_simd::bf16*)h.data_ptr());
  else
    TORCH_CHECK(false, "clamped_swiglu: float32 or bfloat16");
  return h;
}

std::vector<Tensor> MoeDense::run(Tensor x, Tensor ids, Tensor weights) const {
  const int64_t hdim = gate_up_.w[0].size(1), inner = down_.w[0].size(1);
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hdim && x.device().is_cpu(), "MoeDense: x [T, H] on the CPU");
  const auto dtype = gate_up_.w[0].scalar_type();
  TORCH_CHECK(x.scalar_type() == (dtype == at::kChar ? gate_up_.scale_act[0].scalar_type() : dtype),
              "MoeDense: x in the experts' activation dtype");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong, "MoeDense: ids [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes(), "MoeDense: weights [T, k] like ids");
  x = x.contiguous();
  ids = ids.contiguous();
  const auto wts = weights.to(at::kFloat).contiguous();
  const int64_t t = x.size(0), k = ids.size(1), e = num_experts();
  servescope_moe::MoeRoute r;
  servescope_moe::moe_route(ids.data_ptr<int64_t>(), t, k, first_, e, r);
  auto counts = at::empty({e}, ids.options());
  for (int64_t i = 0; i < e; ++i) counts.data_ptr<int64_t>()[i] = r.start[i + 1] - r.start[i];
  const int64_t p = r.start[e];
  const auto f32 = x.options().dtype(at::kFloat);
  const Tensor xs = x.index_select(0, at::from_blob(r.token.data(), {p}, ids.options()));
  Tensor g = at::empty({p, 2 * inner}, f32), d = at::empty({p, hdim}, f32);
  project(gate_up_, r, xs, g.data_ptr<float>());
  if (act_ == servescope_moe::MOE_ACT_CLAMPED_SWIGLU) {
    std::vector<int64_t> expert(p);  // each pair's local expert (its biases' row)
    for (int64_t i = 0; i < e; ++i) std::fill(expert.begin() + r.start[i], expert.begin() + r.start[i + 1], i);
    const Tensor expert_of = at::from_blob(expert.data(), {p}, ids.options());
    project(down_, r, clamped_hidden(g, expert_of), d.data_ptr<float>());
    // the down projection rounded to x's dtype, plus its bias there (the module's `+ down_proj_bias[e]`)
    d.copy_(d.to(x.scalar_type()).add(clamped_.down_bias.index_select(0, expert_of)));
  } else {
    project(down_, r, silu_mul(g.to(x.scalar_type())), d.data_ptr<float>());
  }
  auto out = at::empty_like(x);
  if (x.scalar_type() == at::kFloat)
    servescope_moe::moe_combine(r, d.data_ptr<float>(), wts.data_ptr<float>(), t, k, hdim, out.data_ptr<float>());
  else
    servescope_moe::moe_combine(r, d.data_ptr<float>(), wts.data_ptr<float>(), t, k, hdim,
                                (servescope_simd::bf16*)out.data_ptr());
  return {out, counts};
}

}  // namespace servescope_ops
