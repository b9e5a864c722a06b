// The packed-weight kernels' check program, one build per ISA path (tests/kernels/test_quant_gemv_isas.py):
// its two parts share one compile of the kernels they test (quant_gemv_check.cpp: the GEMV orders, AMX
// panels, prefill GEMM and dequantisation; moe_experts_check.cpp: the fused MoE op over them).
#include "quant_gemv_check.cpp"
#include "moe_experts_check.cpp"

int main() {
  double moe_worst = 0;
  const int gemv_bad = quant_gemv_check::run(), moe_bad = moe_experts_check::run(&moe_worst);
  std::printf("%s int8_dot=%d amx=%d amx_bf16=%d gemv_bad=%d moe_bad=%d moe_worst=%.4f bad=%d\n",
              servescope_quant::kIsa, SERVESCOPE_HAS_INT8_DOT, (int)servescope_quant::amx_available(),
              (int)servescope_quant::amx_bf16_available(), gemv_bad, moe_bad, moe_worst,
              gemv_bad + moe_bad);
  return gemv_bad + moe_bad != 0;
}
