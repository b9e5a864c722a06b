// Torch entry points of the packed-weight kernels (quant_gemv.h), compiled into the CPU op extension
// beside cpu_ops.cpp (whose `gemv` routes float16-scaled packed weights here, so the DecodePlan issues
// them like any other projection); declared in ops.h, bound in bindings.cpp.
#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>

#include "quant_amx.h"
#include "quant_gemm.h"
#include "ops.h"

using servescope_quant::QBLOCK;
using servescope_quant::QMatrix;

namespace {

// w uint8 [N, kp/2] (int4) | int8 [N, kp]; scales float16 [N, G] (symmetric) | [N, G, 2] (asymmetric)
QMatrix describe(const at::Tensor& w, const at::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && scales.is_contiguous(), "quant: w [N, bytes], contiguous");
  TORCH_CHECK(w.scalar_type() == at::kByte || w.scalar_type() == at::kChar, "quant: w uint8 (int4) or int8");
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
// or empty, order (QOrder: 0 by rows, 1 streaming, 2 weight-stationary, 3 AMX) -> y [M, N] float32
at::Tensor quant_gemv(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor bias, int64_t order) {
  const QMatrix q = describe(w, scales);
  TORCH_CHECK(order >= 0 && order <= 3, "quant_gemv: order must be 0 (by rows), 1 (streaming), 2 (tiled) or 3 (AMX)");
  TORCH_CHECK(order != 3 || (servescope_quant::amx_available() && q.group == QBLOCK),
              "quant_gemv: the AMX kernel needs AMX-INT8 here and group-32 weights");
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

// the same for group-32 weights and many rows: the prefill GEMM with integer dot products (quant_gemm.h)
at::Tensor quant_gemm(at::Tensor x, at::Tensor w, at::Tensor scales, at::Tensor bias) {
  const QMatrix q = describe(w, scales);
  TORCH_CHECK(q.group == QBLOCK, "quant_gemm: group-32 scales only");
  const auto xf = padded_rows(x, q, bias, "quant_gemm");
  auto y = at::empty({xf.size(0), q.n}, xf.options());
  servescope_quant::quant_gemm_rows(q, xf.data_ptr<float>(), xf.size(0), bias.numel() ? bias.data_ptr<float>() : nullptr,
                                    y.data_ptr<float>());
  return y;
}

// rows row0 .. row0 + out.size(0) of the packed matrix into out [rows, k] float32 | bfloat16 (contiguous)
void quant_dequantize_into(at::Tensor w, at::Tensor scales, int64_t row0, at::Tensor out) {
  const QMatrix q = describe(w, scales);
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

}  // namespace servescope_ops
