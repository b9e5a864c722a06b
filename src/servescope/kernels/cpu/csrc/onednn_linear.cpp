// oneDNN's GEMM on a prepacked weight, for the DecodePlan above the GEMV's rows. The op
// (torch.ops.mkldnn._linear_pointwise) is registered with the dispatcher, not declared in a header,
// and the dispatcher's header costs seconds of compile, so the call has this unit to itself (ops.h).
#include <ATen/core/dispatch/Dispatcher.h>

#include "ops.h"

namespace servescope_ops {

// torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], None)
Tensor onednn_linear(const Tensor& x, const Tensor& packed, const Tensor& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.numel() ? c10::IValue(bias) : c10::IValue(), c10::IValue(std::string("none")),
                          c10::IValue(c10::impl::GenericList(c10::OptionalType::create(c10::NumberType::get()))),
                          c10::IValue()};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace servescope_ops
