// Torch entry points of the packed-weight kernels (quant_gemv.h), compiled into the CPU op extension
// beside cpu_ops.cpp (whose `gemv` routes float16-scaled packed weights here, so the DecodePlan issues
// them like any other projection); declared in ops.h, bound in bindings.cpp.
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include "moe_experts.h"
#include "quant_amx_bf16.h"
#include "ops.h"

using servescope_quant::QBLOCK;
using servescope_quant::QMatrix;

namespace {

// kept panels (quant_kept.h): w uint8 | int8 [N / NP, row_bytes / 4, NP, 4], scales float16 [N / NP, nb, NP]
// (symmetric) | [N / NP, nb, 2, NP] (asymmetric), NP this build's panel width
QMatrix describe_kept(const at::Tensor& w, const at::Tensor& scales) {
  constexpr int64_t NP = servescope_quant::KEPT_PANEL;
  TORCH_CHECK(NP && w.size(2) == NP && w.size(3) == 4 && w.is_contiguous() && scales.is_contiguous(),
              "quant: kept panels [N / ", NP, ", row_bytes / 4, ", NP, ", 4] (this build's panel width; none on ",
              "builds without vector panels)");
  TORCH_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kChar, "quant: w uint8 (int4) or int8");
  QMatrix q;
  q.w = (const uint8_t*)w.data_ptr();
  q.int4 = w.scalar_type() == at::kByte;
  q.n = w.size(0) * NP;
  q.kp = w.size(1) * 4 * (q.int4 ? 2 : 1);
  q.group = QBLOCK;
  q.asym = scales.dim() == 4;
  const int64_t nb = q.kp / QBLOCK;
  TORCH_CHECK(scales.scalar_type() == at::kHalf && scales.size(0) == w.size(0) && scales.size(1) == nb &&
                  scales.size(-1) == NP && (scales.dim() == 3 || (q.asym && scales.size(2) == 2)),
              "quant: kept panels' scales float16 [N / NP, nb, NP] or [N / NP, nb, 2, NP]");
  q.scales = (const uint16_t*)scales.data_ptr();
  q.panel = NP;
  return q;
}

// w uint8 [N, kp/2] (int4) | int8 [N, kp]; scales float16 [N, G] (symmetric) | [N, G, 2] (asymmetric);
// MXFP4: w uint8 [N, kp/2] of e2m1 nibbles, scales uint8 [N, kp/32] (E8M0)
QMatrix describe(const at::Tensor& w, const at::Tensor& scales) {
  if (w.dim() == 4) return describe_kept(w, scales);
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && scales.is_contiguous(), "quant: w [N, bytes], contiguous");
  TORCH_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kChar, "quant: w uint8 (int4) or int8");
  if (scales.scalar_type() == at::kByte) {
    TORCH_CHECK(w.scalar_type() == at::kByte && scales.dim() == 2 && scales.size(0) == w.size(0) &&
                    scales.size(1) * 16 == w.size(1),
                "quant: MXFP4 w uint8 [N, kp/2] with E8M0 scales uint8 [N, kp/32]");
    QMatrix q{(const uint8_t*)w.data_ptr(), w.size(0), 2 * w.size(1), QBLOCK, true, false, nullptr};
    q.e8m0 = (const uint8_t*)scales.data_ptr();
    return q;
  }
  TORCH_CHECK(scales.scalar_type() == at::kHalf && (scales.dim() == 2 || (scales.dim() == 3 && scales.size(2) == 2)) &&
                  scales.size(0) == w.size(0),
              "quant: scales float16 [N, G] or [N, G, 2]");
  QMatrix q;
  q.w = (const uint8_t*)w.data_ptr();
  q.int4 = w.scalar_type() == at::kByte;
  q.asym = scales.dim() == 3;
  q.n = w.size(0);
  q.kp = q.int4 ? 2 * w.size(1) : w.size(1);
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && q.kp % G == 0 && (q.kp / G) % QBLOCK == 0, "quant: groups must be whole blocks of 32");
  q.group = q.kp / G;
  q.scales = (const uint16_t*)scales.data_ptr();
  return q;
}

// x [M, K] (K <= kp) as [M, kp] (zeros past K), checked against q and the bias, for `what`: bfloat16 kept
// as it is where keep_bf16 (the integer kernels round it straight to int8), anything else as float32
at::Tensor padded_rows(const at::Tensor& x, const QMatrix& q, const at::Tensor& bias, const char* what,
                       bool keep_bf16 = false) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= q.kp && x.size(1) > q.kp - q.group, what, ": x [M, K] against the packed K");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == q.n && bias.scalar_type() == at::kFloat), what, ": bias");
  auto xf = (keep_bf16 && x.scalar_type() == at::kBFloat16 ? x : x.to(at::kFloat)).contiguous();
  return xf.size(1) == q.kp ? xf : at::constant_pad_nd(xf, {0, q.kp - xf.size(1)});
}

}  // namespace

namespace servescope_ops {

// x [M, K] (K <= kp; float32, or bfloat16 for group-32 weights, else widened to float32), bias [N] float32
// or empty, order (QOrder: 0 by rows, 1 streaming, 2 weight-stationary, 3 AMX-INT8, 4 AMX-BF16, 5 panel GEMM)
// -> y [M, N]
// float32
at::Tensor quant_gemv(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor bias, int64_t order) {
  const QMatrix q = describe(w, scales);
  TORCH_CHECK(order >= 0 && order <= 5,
              "quant_gemv: order must be 0 (by rows), 1 (streaming), 2 (tiled), 3 (AMX-INT8), 4 (AMX-BF16) or 5 "
              "(the panel GEMM)");
  TORCH_CHECK(order != 5 || q.group == QBLOCK, "quant_gemv: the panel GEMM needs group-32 weights");
  TORCH_CHECK(!q.panel || order == 0 || order == 5, "quant_gemv: kept panels run the panel GEMM (order 0 or 5)");
  TORCH_CHECK(order != 3 || (servescope_quant::amx_available() && q.group == QBLOCK),
              "quant_gemv: the AMX kernel needs AMX-INT8 here and group-32 weights");
  TORCH_CHECK(order != 4 || (servescope_quant::amx_bf16_available() && q.group == QBLOCK),
              "quant_gemv: the AMX-BF16 kernel needs AMX-BF16 here and group-32 weights");
  const auto xp = padded_rows(x, q, bias, "quant_gemv", q.group == QBLOCK);
  auto y = at::empty({xp.size(0), q.n}, at::TensorOptions().dtype(at::kFloat));
  const float* b = bias.numel() ? bias.data_ptr<float>() : nullptr;
  const auto how = (servescope_quant::QOrder)order;
  if (xp.scalar_type() == at::kBFloat16)
    servescope_quant::quant_rows(q, (const servescope_simd::bf16*)xp.data_ptr(), xp.size(0), b, y.data_ptr<float>(),
                                 how);
  else
    servescope_quant::quant_rows(q, xp.data_ptr<float>(), xp.size(0), b, y.data_ptr<float>(), how);
  return y;
}

bool quant_amx_available() { return servescope_quant::amx_available(); }
bool quant_amx_bf16_available() { return servescope_quant::amx_bf16_available(); }
int64_t quant_kept_panel() { return servescope_quant::KEPT_PANEL; }
bool quant_kept_int8() { return servescope_quant::KEPT_INT8; }
std::string quant_gemm_rows_from() {
  using servescope_quant::QGEMM_ROWS_INT4, servescope_quant::QGEMM_ROWS_INT8;
  if (QGEMM_ROWS_INT4 == INT64_MAX) return "-";
  return std::to_string(QGEMM_ROWS_INT4) + "/" + std::to_string(QGEMM_ROWS_INT8);
}

// the same for group-32 weights and many rows: the prefill GEMM with integer dot products (quant_gemm.h)
at::Tensor quant_gemm(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor bias) {
  const QMatrix q = describe(w, scales);
  TORCH_CHECK(q.group == QBLOCK, "quant_gemm: group-32 scales only");
  const auto xf = padded_rows(x, q, bias, "quant_gemm");
  auto y = at::empty({xf.size(0), q.n}, xf.options());
  if (q.panel) {
    servescope_quant::quant_gemm_kept(q, xf.data_ptr<float>(), xf.size(0), bias.numel() ? bias.data_ptr<float>() : nullptr,
                                      y.data_ptr<float>());
    return y;
  }
  servescope_quant::quant_gemm_rows(q, xf.data_ptr<float>(), xf.size(0), bias.numel() ? bias.data_ptr<float>() : nullptr,
                                    y.data_ptr<float>());
  return y;
}

// rows row0 .. row0 + out.size(0) of the packed matrix into out [rows, k] float32 | bfloat16 (contiguous)
void quant_dequantize_into(at::Tensor w, at::Tensor scales, int64_t row0, at::Tensor out) {
  const QMatrix q = describe(w, scales);
  TORCH_CHECK(!q.panel, "quant_dequantize: kept panels (QuantLinear.plain_weights gives the rows)");
  TORCH_CHECK(out.dim() == 2 && out.is_contiguous() && out.device().is_cpu(), "quant_dequantize: out [rows, k], contiguous");
  const int64_t rows = out.size(0), k = out.size(1);
  TORCH_CHECK(k <= q.kp && k > q.kp - q.group, "quant_dequantize: k against the packed K");
  TORCH_CHECK(row0 >= 0 && row0 + rows <= q.n, "quant_dequantize: rows past the matrix");
  if (out.scalar_type() == at::kFloat)
    servescope_quant::dequantize_rows(q, row0, rows, k, out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16)
    servescope_quant::dequantize_rows(q, row0, rows, k, (servescope_simd::bf16*)out.data_ptr());
  else
    TORCH_CHECK(false, "quant_dequantize: out must be float32 or bfloat16");
}

// the packed matrix as float32 [N, k]
at::Tensor quant_dequantize(at::Tensor w, at::Tensor scales, int64_t k) {
  auto out = at::empty({w.size(0), k}, at::TensorOptions().dtype(at::kFloat));
  quant_dequantize_into(w, scales, 0, out);
  return out;
}

namespace {

// every matrix of one projection: group 32, one format and shape; K its packed width
std::vector<QMatrix> describe_all(const std::vector<at::Tensor>& w, const std::vector<at::Tensor>& s,
                                  const char* what, std::vector<at::Tensor>& bias, std::vector<const float*>& bp) {
  TORCH_CHECK(!w.empty() && w.size() == s.size(), "MoePacked: ", what, ": one weight and one scale tensor per expert");
  std::vector<QMatrix> out;
  for (size_t e = 0; e < w.size(); ++e) {
    out.push_back(describe(w[e], s[e]));
    const QMatrix &q = out.back(), &q0 = out[0];
    TORCH_CHECK(q.group == QBLOCK, "MoePacked: ", what, ": group-32 scales only");
    TORCH_CHECK(q.int4 == q0.int4 && q.asym == q0.asym && q.mx() == q0.mx() && q.n == q0.n && q.kp == q0.kp &&
                    q.panel == q0.panel,
                "MoePacked: ", what, ": every expert in one format, shape and layout");
  }
  TORCH_CHECK(bias.empty() || bias.size() == w.size(), "MoePacked: ", what, ": one bias per expert or none");
  for (auto& b : bias) {
    b = b.to(at::kFloat).contiguous();
    TORCH_CHECK(b.dim() == 1 && b.size(0) == out[0].n, "MoePacked: ", what, ": bias [N] per expert");
    bp.push_back(b.data_ptr<float>());
  }
  return out;
}

}  // namespace

MoePacked::MoePacked(std::vector<Tensor> gate_up_w, std::vector<Tensor> gate_up_s, std::vector<Tensor> down_w,
                     std::vector<Tensor> down_s, int64_t first, std::vector<Tensor> gate_up_b,
                     std::vector<Tensor> down_b, int64_t act, double alpha, double limit) {
  auto ex = std::make_shared<servescope_moe::MoeWeights>();
  ex->gate_up = describe_all(gate_up_w, gate_up_s, "gate_up", gate_up_b, ex->gate_up_bias);
  ex->down = describe_all(down_w, down_s, "down", down_b, ex->down_bias);
  ex->first = first;
  TORCH_CHECK(act == servescope_moe::MOE_ACT_SILU || act == servescope_moe::MOE_ACT_CLAMPED_SWIGLU,
              "MoePacked: act 0 (silu) or 1 (clamped SwiGLU)");
  ex->act = act;
  ex->alpha = (float)alpha;
  ex->limit = (float)limit;
  const QMatrix &g = ex->gate_up[0], &d = ex->down[0];
  TORCH_CHECK(ex->gate_up.size() == ex->down.size(), "MoePacked: as many down as gate_up matrices");
  TORCH_CHECK(first >= 0, "MoePacked: first must be >= 0");
  TORCH_CHECK(g.n % 2 == 0 && d.kp == g.n / 2 && d.n == g.kp,
              "MoePacked: gate_up [2I, H] and down [H, I] with H, I multiples of 32");
  for (auto* l : {&gate_up_w, &gate_up_s, &down_w, &down_s, &gate_up_b, &down_b}) tensors_.insert(tensors_.end(), l->begin(), l->end());
  weights_ = ex;
}

int64_t MoePacked::num_experts() const { return (int64_t)weights_->gate_up.size(); }

std::vector<Tensor> MoePacked::run(Tensor x, Tensor ids, Tensor weights) const {
  const int64_t hdim = weights_->gate_up[0].kp;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == hdim && x.device().is_cpu(), "MoePacked: x [T, H] on the CPU");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "MoePacked: x float32 or bfloat16");
  TORCH_CHECK(ids.dim() == 2 && ids.size(0) == x.size(0) && ids.scalar_type() == at::kLong,
              "MoePacked: ids [T, k] int64");
  TORCH_CHECK(weights.sizes() == ids.sizes(), "MoePacked: weights [T, k] like ids");
  x = x.contiguous();
  ids = ids.contiguous();
  const auto w = weights.to(at::kFloat).contiguous();
  auto out = at::empty_like(x);
  auto counts = at::empty({num_experts()}, ids.options());
  const int64_t t = x.size(0), k = ids.size(1);
  if (x.scalar_type() == at::kFloat)
    servescope_moe::moe_packed(*weights_, x.data_ptr<float>(), t, ids.data_ptr<int64_t>(), w.data_ptr<float>(), k,
                               out.data_ptr<float>(), counts.data_ptr<int64_t>());
  else
    servescope_moe::moe_packed(*weights_, (const servescope_simd::bf16*)x.data_ptr(), t, ids.data_ptr<int64_t>(),
                               w.data_ptr<float>(), k, (servescope_simd::bf16*)out.data_ptr(),
                               counts.data_ptr<int64_t>());
  return {out, counts};
}

}  // namespace servescope_ops
