// Gemma 2 / Gemma 3's parts of a DecodePlan layer (decode_plan.h): four norms a layer (the sandwich), the
// GELU-tanh MLP, soft-capped attention scores and a layer's own rotary tables (Gemma 3's local layers).
#pragma once

#include <ATen/ops/gelu.h>
#include <ATen/ops/mul.h>

#include "ops.h"

namespace servescope_ops {

// Why: Gemma's layers ran op by op in Python while every other dense family ran its layers in one call. The
// parts are few and the module path's own: post_attention_layernorm on attention's output before the residual
// add (the layer's ln2 is then pre_feedforward_layernorm), post_feedforward_layernorm on the MLP's output (its
// residual add fused into the next layer's first norm, as the modules do), the MLP's activation the very ATen
// ops of kernels/fused_ops.gelu_tanh_mul, the soft-cap the paged decode kernel's own argument. Gemma's (1 + w)
// norms are stored with the 1 added at load (loader/build.py) and its scaled embeddings are the model's embed:
// neither is in the layers.
struct PlanGemmaLayer {
  at::Tensor post_attn, post_ff;  // the sandwich's extra norms [Dm] (empty: a pre-norm layer)
  bool gelu_tanh = false;         // the dense MLP's activation gelu(gate, tanh) * up, else silu(gate) * up
  double softcap = 0.0;           // attention scores softcap * tanh(s / softcap) (0: none)
  bool local_rope = false;        // rotated with the plan's second (local) cos / sin tables
};

// kernels/fused_ops.gelu_tanh_mul: [T, 2I] (gate | up) -> [T, I], the same ATen ops in the same order
inline at::Tensor gelu_tanh_mul(const at::Tensor& gate_up) {
  auto parts = gate_up.chunk(2, -1);
  return at::mul(at::gelu(parts[0], "tanh"), parts[1]);
}

}  // namespace servescope_ops
