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

// DeepSeek's router and shared experts into a PlanSparseMlp (decode_plan_router.h)
void set_deepseek(PlanSparseMlp& mlp, Tensor router, Tensor bias, bool v3, int64_t top_k, int64_t n_group,
                  int64_t topk_group, bool norm, double scaling, std::vector<Tensor> shared, std::vector<int64_t> limits) {
  TORCH_CHECK(shared.empty() || (shared.size() == 12 && limits.size() == 4), "set_deepseek: 12 shared tensors, 4 limits");
  TORCH_CHECK(router.scalar_type() == at::kFloat && (!v3 || bias.numel() == router.size(0)) && n_group > 0 &&
                  router.size(0) % n_group == 0 && topk_group <= n_group, "set_deepseek: router, bias, groups");
  PlanDeepseekMoe d{router, bias, v3, top_k, n_group, topk_group, norm, scaling};
  if (!shared.empty()) {
    d.shared_gate_up = plan_linear(&shared[0], limits[0], limits[1]);
    d.shared_down = plan_linear(&shared[6], limits[2], limits[3]);
  }
  mlp.set_deepseek(std::make_shared<const PlanDeepseekMoe>(std::move(d)));
}

// PlanLatentAttention (decode_plan_mla.h) as DecodePlan.set_latent takes it
std::shared_ptr<PlanLatentAttention> latent_attention(std::vector<Tensor> linears, std::vector<int64_t> limits,
                                                      Tensor q_a_norm, Tensor kv_a_norm, Tensor w_uk, Tensor w_uv,
                                                      int64_t nope, int64_t rope, bool interleave, double eps,
                                                      double scale) {
  return std::make_shared<PlanLatentAttention>(std::move(linears), std::move(limits), std::move(q_a_norm),
                                               std::move(kv_a_norm), std::move(w_uk), std::move(w_uv), nope, rope,
                                               interleave, eps, scale);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the interpreter lock (its tensors are converted before, its results after): a
  // decode step in the C++ plan leaves the server's event loop and the 1P1D receiver thread free to run.
  // Scratch is thread_local in every kernel, and an engine's steps run on one thread.
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("isa", &isa_info, "isa() -> {isa, lanes, bf16_dot, int8_dot, amx_int8, amx_bf16, qgemm_rows, panel} of this build");
  m.def("host_cache_install", &host_cache_install, "host_cache_install(limit_bytes): cache torch's large CPU blocks");
  m.def("host_cache_stats", &host_cache_stats, "host_cache_stats() -> {installed, limit_bytes, cached_bytes, ...}");
  m.def("rms_norm", &rms_norm, nogil, "rms_norm(x, w, eps)");
  m.def("add_rms_norm", &add_rms_norm, nogil, "add_rms_norm(x, residual, w, eps) -> [y, x + residual]");
  m.def("rotary", &rotary, nogil, "rotary(q, k, cos, sin) -> [q', k'] (rotate-half)");
  m.def("silu_mul", &silu_mul, nogil, "silu_mul(gate_up) -> silu(gate) * up");
  m.def("clamped_swiglu", &clamped_swiglu, nogil,
        "clamped_swiglu(gate_up, limit, alpha) -> (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = min(gate, "
        "limit): gpt-oss's activation");
  m.def("store_kv", &store_kv, nogil, "store_kv(k, v, k_cache, v_cache, slot_mapping), in place");
  m.def("quant_gemv", &quant_gemv, nogil,
        "quant_gemv(x, w, scales, bias, order=0): packed int4/int8 weights -> float32; order 1 / 2 / 3 / 4 / 5 "
        "forces the streaming / weight-stationary VNNI order, AMX-INT8, AMX-BF16 or the panel GEMM (0: by rows)",
        py::arg("x"), py::arg("w"), py::arg("scales"), py::arg("bias"), py::arg("order") = 0);
  m.def("quant_gemm", &quant_gemm, nogil,
        "quant_gemm(x, w, scales, bias): group-32 packed weights, int8 activations -> float32");
  m.def("quant_dequantize", &quant_dequantize, nogil, "quant_dequantize(w, scales, k) -> float32 [N, k]");
  m.def("quant_dequantize_into", &quant_dequantize_into, nogil,
        "quant_dequantize_into(w, scales, row0, out): rows row0.. into out [rows, k] float32 | bfloat16");
  m.def("gemv", &gemv, nogil, "gemv(x, w, scale, bias): decode GEMV (float32/bfloat16/int8 weights) -> float32");
  m.def("pack_panels", &pack_panels, nogil,
        "pack_panels(w [N, K] float32 | bfloat16) -> float32 panels for panel_gemm");
  m.def("panel_gemm", &panel_gemm, nogil, "panel_gemm(x, panels, n, bias): float32 GEMM on packed panels -> [M, n]");
  py::class_<MoePacked>(m, "MoePacked")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, int64_t,
                    std::vector<Tensor>, std::vector<Tensor>, int64_t, double, double>(),
           "MoePacked(gate_up_w, gate_up_s, down_w, down_s, first, gate_up_b, down_b, act, alpha, limit): one layer's "
           "packed group-32 experts (int4 / int8 / MXFP4), biases optional, act 0 silu or 1 clamped SwiGLU")
      .def("run", &MoePacked::run, nogil, "run(x, ids, weights) -> [out, counts]: the routed experts' weighted sum")
      .def("num_experts", &MoePacked::num_experts);
  py::class_<MoeDense>(m, "MoeDense")
      .def(py::init<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>,
                    std::vector<Tensor>, std::vector<Tensor>, int64_t, int64_t, Tensor, Tensor, int64_t, double,
                    double>(),
           "MoeDense(gate_up, down, gate_up_scale, down_scale, gate_up_scale_act, down_scale_act, first, gemv_rows, "
           "gate_up_bias, down_bias, act, alpha, limit): one layer's float32 / bfloat16 / per-channel int8 experts "
           "(float ones with gpt-oss's biases and clamped SwiGLU: act 1)")
      .def("run", &MoeDense::run, nogil, "run(x, ids, weights) -> [out, counts]: the routed experts' weighted sum")
      .def("num_experts", &MoeDense::num_experts);
  py::class_<PlanSparseMlp, std::shared_ptr<PlanSparseMlp>>(m, "PlanSparseMlp")
      .def(py::init(&sparse_mlp<MoePacked>))
      .def(py::init(&sparse_mlp<MoeDense>),
           "PlanSparseMlp(router, top_k, renormalise, experts, counts, shared, shared_limits, shared_gate): a sparse "
           "layer's MLP for the DecodePlan (softmax top-k router, MoePacked or MoeDense experts, optional gated "
           "shared expert)")
      .def("set_deepseek", &set_deepseek,
           "set_deepseek(router_f32, bias, v3, top_k, n_group, topk_group, norm, scaling, shared, shared_limits): "
           "DeepSeek's router and ungated shared experts (shared empty: none)")
      .def("use_gpt_oss_router", &PlanSparseMlp::use_gpt_oss_router,
           "use_gpt_oss_router(router_bias): route as gpt-oss does (top k of the biased logits, softmax over those)")
      .def("run", &PlanSparseMlp::run, nogil, "run(x) -> the MLP's output; adds the tokens per expert to counts");
  py::class_<PlanLatentAttention, std::shared_ptr<PlanLatentAttention>>(m, "PlanLatentAttention")
      .def(py::init(&latent_attention),
           "PlanLatentAttention(linears, limits, q_a_norm, kv_a_norm, w_uk, w_uv, nope, rope, interleave, eps, scale): "
           "a latent layer's attention for the DecodePlan (DeepSeek-V2/V3's MLA, absorbed decode)");
  py::class_<DecodePlan>(m, "DecodePlan")
      .def(py::init<std::vector<std::vector<Tensor>>, std::vector<std::vector<int64_t>>, std::vector<int64_t>,
                    std::vector<std::shared_ptr<PlanSparseMlp>>, int64_t, int64_t, int64_t, double, double,
                    std::vector<Tensor>>())
      .def("set_latent", &DecodePlan::set_latent, "set_latent(i, latent): layer i's attention is MLA's")
      .def("set_gemma", &DecodePlan::set_gemma,
           "set_gemma(i, post_attn, post_ff, gelu_tanh, softcap, local_rope): layer i's Gemma 2 / 3 parts (the "
           "sandwich's extra norms or empty, the GELU-tanh MLP, the attention soft-cap, the local rotary tables)")
      .def("run_layers", &DecodePlan::run_layers, nogil,
           "run_layers(h, residual, cos, sin, kv_caches, slots, block_tables, context_lens, cos_local, sin_local) -> "
           "[h, residual] (cos_local, sin_local: the local layers' tables, empty where no layer is local)");
  m.def("paged_decode", &paged_decode, nogil,
        "paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, out, window, softcap, sinks): window 0 = "
        "whole context, softcap 0 = none, sinks empty = none");
  m.def("latent_decode", &latent_decode, nogil,
        "latent_decode(q, cache, block_tables, context_lens, scale, v_dim): MLA's decode, values the rows' first v_dim");
  m.def("prefill_attention", &prefill_attention, nogil,
        "prefill_attention(q, k_cache, v_cache, block_table, ctx, scale): causal, one sequence, bfloat16 or float32");
  m.def("prefill_attention_supported", &prefill_attention_supported, nogil,
        "prefill_attention_supported(group, head_dim, float32)");
}
