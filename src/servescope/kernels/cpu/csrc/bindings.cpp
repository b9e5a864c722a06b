// The Python module of the CPU op extension (one per ISA: kernels/cpu_extension.py): the entry
// points of ops.h and the DecodePlan. The only unit that includes torch's pybind11 casters.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include "decode_plan.h"

namespace py = pybind11;
using namespace servescope_ops;

namespace {

// PlanSparseMlp over either fused experts op (a copy of the handle: it shares the weights)
template <typename Op>
std::shared_ptr<PlanSparseMlp> sparse_mlp(Tensor router, int64_t top_k, bool renormalise, const Op& experts,
                                          Tensor counts, std::vector<Tensor> shared, std::vector<int64_t> limits,
                                          Tensor shared_gate) {
  auto run = [experts](const Tensor& x, const Tensor& ids, const Tensor& w) { return experts.run(x, ids, w); };
  return std::make_shared<PlanSparseMlp>(std::move(router), top_k, renormalise, run, experts.num_experts(),
                                         std::move(counts), std::move(shared), std::move(limits),
                                         std::move(shared_gate));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("isa", &isa_info, "isa() -> {isa, lanes, bf16_dot, int8_dot} of this build");
  m.def("rms_norm", &rms_norm, "rms_norm(x, w, eps)");
  m.def("add_rms_norm", &add_rms_norm, "add_rms_norm(x, residual, w, eps) -> [y, x + residual]");
  m.def("rotary", &rotary, "rotary(q, k, cos, sin) -> [q', k'] (rotate-half)");
  m.def("silu_mul", &silu_mul, "silu_mul(gate_up) -> silu(gate) * up");
  m.def("clamped_swiglu", &clamped_swiglu,
        "clamped_swiglu(gate_up, limit, alpha) -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, "
        "limit): gpt-oss's activation");
  m.def("store_kv", &store_kv, "store_kv(k, v, k_cache, v_cache, slot_mapping), in place");
  m.def("quant_gemv", &quant_gemv,
        "quant_gemv(x, w, scales, bias, order=0): packed int4/int8 weights -> float32; order 1 / 2 / 3 / 4 forces "
        "the streaming / weight-stationary VNNI order, AMX-INT8 or AMX-BF16 (0: by rows)",
        py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("bias"), py::arg("order") = 0);
  m.def("quant_gemm", &quant_gemm, "quant_gemm(x, w, scales, bias): group-32 packed weights, int8 activations -> float32");
  m.def("quant_dequantize", &quant_dequantize, "quant_dequantize(w, scales, k) -> float32 [N, k]");
  m.def("quant_dequantize_into", &quant_dequantize_into,
        "quant_dequantize_into(w, scales, row0, out): rows row0.. into out [rows, k] float32 | bfloat16");
  m.def("gemv", &gemv, "gemv(x, w, scale, bias): decode GEMV (float32/bfloat16/int8 weights) -> float32");
  m.def("pack_panels", &pack_panels, "pack_panels(w [N, K] float32 | bfloat16) -> float32 panels for panel_gemm");
  m.def("panel_gemm", &panel_gemm, "panel_gemm(x, panels, n, bias): float32 GEMM on packed panels -> [M, n]");
  py::class_<MoePacked>(m, "MoePacked")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, int64_t,
                    std::vector<Tensor>, std::vector<Tensor>, int64_t, double, double>(),
           "MoePacked(gate_up_w, gate_up_s, down_w, down_s, first, gate_up_b, down_b, act, alpha, limit): one layer's "
           "packed group-32 experts (int4 / int8 / MXFP4), biases optional, act 0 silu or 1 clamped SwiGLU")
      .def("run", &MoePacked::run, "run(x, ids, weights) -> [out, counts]: the routed experts' weighted sum")
      .def("num_experts", &MoePacked::num_experts);
  py::class_<MoeDense>(m, "MoeDense")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                    std::vector<Tensor>, std::vector<Tensor>, int64_t, int64_t, Tensor, Tensor, int64_t, double,
                    double>(),
           "MoeDense(gate_up, down, gate_up_scale, down_scale, gate_up_scale_act, down_scale_act, first, gemv_rows, "
           "gate_up_bias, down_bias, act, alpha, limit): one layer's float32 / bfloat16 / per-channel int8 experts "
           "(float ones with gpt-oss's biases and clamped SwiGLU: act 1)")
      .def("run", &MoeDense::run, "run(x, ids, weights) -> [out, counts]: the routed experts' weighted sum")
      .def("num_experts", &MoeDense::num_experts);
  py::class_<PlanSparseMlp, std::shared_ptr<PlanSparseMlp>>(m, "PlanSparseMlp")
      .def(py::init(&sparse_mlp<MoePacked>))
      .def(py::init(&sparse_mlp<MoeDense>),
           "PlanSparseMlp(router, top_k, renormalise, experts, counts, shared, shared_limits, shared_gate): a sparse "
           "layer's MLP for the DecodePlan (softmax top-k router, MoePacked or MoeDense experts, optional gated "
           "shared expert)")
      .def("use_gpt_oss_router", &PlanSparseMlp::use_gpt_oss_router,
           "use_gpt_oss_router(router_bias): route as gpt-oss does (top k of the biased logits, softmax over those)")
      .def("run", &PlanSparseMlp::run, "run(x) -> the MLP's output; adds the tokens per expert to counts");
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<std::vector<std::vector<Tensor>>, std::vector<std::vector<int64_t>>, std::vector<int64_t>,
                    std::vector<std::shared_ptr<PlanSparseMlp>>, int64_t, int64_t, int64_t, double, double,
                    std::vector<Tensor>>())
      .def("run_layers", &DecodePlan::run_layers,
           "run_layers(h, residual, cos, sin, kv_caches, slots, block_tables, context_lens) -> [h, residual]");
  m.def("paged_decode", &paged_decode,
        "paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, window, softcap, sinks): window 0 = "
        "whole context, softcap 0 = none, sinks empty = none");
  m.def("prefill_attention", &prefill_attention,
        "prefill_attention(q, k_cache, v_cache, block_table, ctx, scale): causal, one sequence, bfloat16");
  m.def("prefill_attention_supported", &prefill_attention_supported, "prefill_attention_supported(group, head_dim)");
}
