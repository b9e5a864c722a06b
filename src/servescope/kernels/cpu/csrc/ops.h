// The CPU op extension's entry points, declared once for its translation units: cpu_ops.cpp (the
// small per-layer ops of kernels.h), quant_ops.cpp (packed weights), moe_dense.cpp (float and int8
// experts), prefill_attention.cpp, onednn_linear.cpp, host_cache.cpp (torch's CPU allocator), and
// bindings.cpp, the only one that sees Python (decode_plan.h issues them all for a decode step).
//
// Why the split and these headers: <torch/extension.h> (the whole C++ frontend and its pybind11 casters)
// is by far the slowest header to compile, and the extension used to include it in three units, most
// of a first run's wait. The kernels' units include only ATen's tensor header and the ops they call;
// the Python binding is one unit with torch's pybind11 casters; oneDNN's prepacked GEMM goes through
// the dispatcher in a unit of its own. ninja compiles them in parallel (docs/BENCHMARKS.md has the
// build times).
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace servescope_moe {
struct MoeWeights;  // moe_experts.h
struct MoeRoute;
}

namespace servescope_ops {

using at::Tensor;

// host_cache.cpp: torch's CPU allocator kept from returning large blocks to the OS between steps
void host_cache_install(int64_t limit_bytes);
std::map<std::string, int64_t> host_cache_stats();

// cpu_ops.cpp
Tensor rms_norm(Tensor x, Tensor w, double eps);
std::vector<Tensor> add_rms_norm(Tensor x, Tensor residual, Tensor w, double eps);
std::vector<Tensor> rotary(Tensor q, Tensor k, Tensor cos, Tensor sin);
Tensor silu_mul(Tensor gate_up);
void store_kv(Tensor k, Tensor v, Tensor k_cache, Tensor v_cache, Tensor slots);
Tensor paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, double scale,
                    Tensor out, int64_t window = 0, double softcap = 0.0, Tensor sinks = Tensor());
// MLA's absorbed decode over the latent cache, the values its rows' first v_dim features -> [B, H, v_dim]
Tensor latent_decode(Tensor q, Tensor cache, Tensor block_tables, Tensor context_lens, double scale, int64_t v_dim);
Tensor gemv(Tensor x, Tensor w, Tensor scale, Tensor bias);
// bfloat16 rows [m, K], m >= 2, on a bfloat16 weight [N, K] through kernels.h's dot-product GEMV where the CPU has
// AVX512-BF16: y [m, N] float32 written (bias [N] float32 or null) and true; false, nothing written, anywhere else.
// The one place that rule lives (gemv_bf16_dot_applies): gemv() and moe_dense's experts both ask it.
bool gemv_bf16_dot_applies(const Tensor& rows, const Tensor& w);
bool gemv_bf16_dot_into(const Tensor& rows, const Tensor& w, const float* bias, float* y);
Tensor pack_panels(Tensor w);
Tensor panel_gemm(Tensor x, Tensor panels, int64_t n, Tensor bias);
std::map<std::string, std::string> isa_info();

// quant_ops.cpp: packed int4 / int8 weights with float16 group scales (quant_gemv.h)
Tensor quant_gemv(Tensor x, Tensor w, Tensor scales, Tensor bias, int64_t order = 0);  // order: QOrder
Tensor quant_gemm(Tensor x, Tensor w, Tensor scales, Tensor bias);
bool quant_amx_available();  // the AMX-INT8 kernel (quant_amx.h) compiled in and granted the tiles
bool quant_amx_bf16_available();  // the AMX-BF16 kernel (quant_amx_bf16.h) likewise
// "int4/int8": from how many rows order 0 takes the panel GEMM where no AMX runs ("-" where it never does)
std::string quant_gemm_rows_from();
int64_t quant_kept_panel();  // the columns of a kept panel in this build (quant_kept.h), 0: none
bool quant_kept_int8();       // whether int8 weights are kept too (quant_kept.h's KEPT_INT8)
Tensor quant_dequantize(Tensor w, Tensor scales, int64_t k);
void quant_dequantize_into(Tensor w, Tensor scales, int64_t row0, Tensor out);

// quant_ops.cpp: one MoE layer's routed experts over packed group-32 weights in one call (moe_experts.h).
// Built once per layer from the experts' packed tensors (held here, so the descriptors stay valid):
// gate_up [2I, H] and down [H, I] per local expert, local expert e being the router's expert first + e.
class MoePacked {
 public:
  // (gate_up_b / down_b: per expert float32 [2I] / [H] biases or empty; act 0: silu(gate) * up, 1: gpt-oss's
  // clamped SwiGLU with alpha and limit)
  MoePacked(std::vector<Tensor> gate_up_w, std::vector<Tensor> gate_up_s, std::vector<Tensor> down_w,
            std::vector<Tensor> down_s, int64_t first, std::vector<Tensor> gate_up_b, std::vector<Tensor> down_b,
            int64_t act, double alpha, double limit);
  // x [T, H] float32 | bfloat16, ids [T, k] int64, weights [T, k] -> [out [T, H] in x's dtype, counts [E] int64]
  std::vector<Tensor> run(Tensor x, Tensor ids, Tensor weights) const;
  int64_t num_experts() const;

 private:
  std::vector<Tensor> tensors_;
  std::shared_ptr<const servescope_moe::MoeWeights> weights_;
};

// moe_dense.cpp: one MoE layer's routed experts over float32 | bfloat16 or per-channel int8 weights in one call,
// each expert's rows on the kernel its module chooses (the GEMV up to gemv_rows rows, ATen's linear above).
class MoeDense {
 public:
  // gate_up [2I, H] and down [H, I] per local expert (local expert e: the router's first + e); int8: a float32
  // scale [N] per matrix (the GEMV's) and the same in the activation dtype (the eager path's); float: none.
  // gpt-oss's float experts (ClampedExperts): gate_up_bias [E, 2I] and down_bias [E, H] in the weights' dtype
  // (empty: none), act 1 (MOE_ACT_CLAMPED_SWIGLU) with alpha and limit
  MoeDense(std::vector<Tensor> gate_up, std::vector<Tensor> down, std::vector<Tensor> gate_up_scale,
           std::vector<Tensor> down_scale, std::vector<Tensor> gate_up_scale_act, std::vector<Tensor> down_scale_act,
           int64_t first, int64_t gemv_rows, Tensor gate_up_bias, Tensor down_bias, int64_t act, double alpha,
           double limit);
  // as MoePacked::run; x in the activation dtype (the float weights' own)
  std::vector<Tensor> run(Tensor x, Tensor ids, Tensor weights) const;
  int64_t num_experts() const;

 private:
  struct Proj {
    std::vector<Tensor> w, scale, scale_act;
  };
  // gpt-oss's experts: the stacked biases and the clamped SwiGLU's constants (act 1)
  struct Clamped {
    Tensor gate_up_bias, down_bias;
    double alpha = 0, limit = 0;
  };
  void project(const Proj& p, const servescope_moe::MoeRoute& r, const Tensor& xs, float* y) const;
  Tensor clamped_hidden(const Tensor& g, const Tensor& expert_of) const;
  Proj gate_up_, down_;
  int64_t first_, gemv_rows_, act_;
  Clamped clamped_;
};

// moe_dense.cpp: gpt-oss's clamped SwiGLU of gate_up [n, 2I] float32 | bfloat16 -> [n, I] (moe_experts.h's
// kernel: gate = min(gate, limit), up = clamp(up, -limit, limit), (up + 1) * gate * sigmoid(alpha * gate))
Tensor clamped_swiglu(const Tensor& gate_up, double limit, double alpha);

// prefill_attention.cpp (bfloat16: AVX512-BF16 only, elsewhere "unsupported"; float32: every ISA)
Tensor prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, int64_t ctx, double scale);
bool prefill_attention_supported(int64_t group, int64_t head_dim, bool float32);

// onednn_linear.cpp: oneDNN's GEMM on a prepacked weight (bias empty: none)
Tensor onednn_linear(const Tensor& x, const Tensor& packed, const Tensor& bias);

}  // namespace servescope_ops
