// Torch entry points of the packed-weight kernels (quant_gemv.h), compiled into the CPU op extension
// beside cpu_ops.cpp (which binds them and routes its `gemv` here for float16-scaled packed weights,
// so the DecodePlan issues them like any other projection).
#include <torch/extension.h>

#include "quant_dot.h"

using servescope_quant::QBLOCK;
using servescope_quant::QMatrix;

namespace {

// w uint8 [N, kp/2] (int4) | int8 [N, kp]; scales float16 [N, G] (symmetric) | [N, G, 2] (asymmetric)
QMatrix describe(const torch::Tensor& w, const torch::Tensor& scales) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous() && scales.is_contiguous(), "quant: w [N, bytes], contiguous");
  TORCH_CHECK(w.scalar_type() == torch::kUInt8 || w.scalar_type() == torch::kInt8, "quant: w uint8 (int4) or int8");
  TORCH_CHECK(scales.scalar_type() == torch::kHalf && (scales.dim() == 2 || (scales.dim() == 3 && scales.size(2) == 2)) &&
                  scales.size(0) == w.size(0),
              "quant: scales float16 [N, G] or [N, G, 2]");
  QMatrix q;
  q.w = (const uint8_t*)w.data_ptr();
  q.int4 = w.scalar_type() == torch::kUInt8;
  q.asym = scales.dim() == 3;
  q.n = w.size(0);
  q.kp = q.int4 ? 2 * w.size(1) : w.size(1);
  const int64_t G = scales.size(1);
  TORCH_CHECK(G > 0 && q.kp % G == 0 && (q.kp / G) % QBLOCK == 0, "quant: groups must be whole blocks of 32");
  q.group = q.kp / G;
  q.scales = (const uint16_t*)scales.data_ptr();
  return q;
}

}  // namespace

// x [M, K] (K <= kp; widened to float32), bias [N] float32 or empty -> y [M, N] float32
torch::Tensor quant_gemv(torch::Tensor x, torch::Tensor w, torch::Tensor scales, torch::Tensor bias) {
  const QMatrix q = describe(w, scales);
  TORCH_CHECK(x.dim() == 2 && x.size(1) <= q.kp && x.size(1) > q.kp - q.group, "quant_gemv: x [M, K] against the packed K");
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == q.n && bias.scalar_type() == torch::kFloat32), "quant_gemv: bias");
  auto xf = x.to(torch::kFloat32).contiguous();
  if (xf.size(1) != q.kp) xf = torch::constant_pad_nd(xf, {0, q.kp - xf.size(1)});
  const int64_t M = xf.size(0);
  auto y = torch::empty({M, q.n}, xf.options());
  servescope_quant::quant_matvec(q, xf.data_ptr<float>(), M, bias.numel() ? bias.data_ptr<float>() : nullptr,
                                    y.data_ptr<float>());
  return y;
}

// the packed matrix as float32 [N, k]
torch::Tensor quant_dequantize(torch::Tensor w, torch::Tensor scales, int64_t k) {
  const QMatrix q = describe(w, scales);
  TORCH_CHECK(k <= q.kp && k > 0, "quant_dequantize: k");
  auto out = torch::empty({q.n, k}, torch::dtype(torch::kFloat32));
  servescope_quant::dequantize_rows(q, k, out.data_ptr<float>());
  return out;
}
