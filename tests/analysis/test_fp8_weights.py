"""FP8 weights (vLLM's --quantization fp8: e4m3 weights with a scale per output channel, activations rounded to FP8
per token, the matmuls on FP8 tensor cores) in the cost model, `explain` and the simulator: one byte per weight
like int8, the linear layers at the FP8 peak where int8 weight-only multiplies at the activations' bfloat16 peak;
refused on parts without FP8 tensor cores."""

import pytest

from servescope.analysis.cost_model import decode_cost, prefill_cost
from servescope.analysis.hardware import get_hardware
from servescope.analysis.op_counts import weight_bytes
from servescope.analysis.presets import load_preset
from servescope.config.engine import ParallelConfig
from servescope.errors import InvalidParameterError
from servescope.sim.spec import instance_spec


def test_fp8_weights_take_int8_bytes_and_the_fp8_peak():
    cfg, h100 = load_preset("llama-3-70b"), get_hardware("h100")
    # (the embedding and the head stay bfloat16)
    assert weight_bytes(cfg, "fp8") == weight_bytes(cfg, "int8") < 0.53 * weight_bytes(cfg, "bfloat16")
    pre = {w: prefill_cost(cfg, 4096, 1, h100, w) for w in ("bfloat16", "int8", "fp8")}
    names = ("qkv_proj", "attn_out_proj", "mlp")
    linear = {w: sum(o.seconds for o in c.ops if o.name in names) for w, c in pre.items()}
    assert linear["int8"] == pytest.approx(linear["bfloat16"])  # weight-only: the bfloat16 peak
    assert linear["fp8"] == pytest.approx(linear["bfloat16"] / 2, rel=0.01)  # H100: FP8 at twice BF16's rate
    dec = {w: decode_cost(cfg, 1, 1024, h100, w).predicted_seconds for w in ("int8", "fp8")}
    assert dec["fp8"] == pytest.approx(dec["int8"])  # one row: both read the same bytes
    with pytest.raises(InvalidParameterError, match="A100-80GB has no FP8 tensor cores"):
        decode_cost(cfg, 1, 1024, get_hardware("a100"), "fp8")


def test_the_simulator_fits_deepseek_v3_on_eight_h200s_in_fp8_not_in_bfloat16():
    parallel = ParallelConfig(tensor_parallel_size=8)
    with pytest.raises(InvalidParameterError, match="does not fit on H200"):
        instance_spec("deepseek-v3", "h200", parallel=parallel, ep=8)
    spec = instance_spec("deepseek-v3", "h200", parallel=parallel, ep=8, quantization="fp8")
    assert spec.dtypes[:3] == ("fp8", "bfloat16", "bfloat16") and spec.num_blocks > 0
    int8 = instance_spec("deepseek-v3", "h200", parallel=parallel, ep=8, quantization="int8")
    assert int8.num_blocks == spec.num_blocks  # the same bytes
    with pytest.raises(InvalidParameterError, match="no FP8 tensor cores"):
        instance_spec("llama-3-8b", "a100", quantization="fp8")
    with pytest.raises(InvalidParameterError, match="weight dtype must be one of"):
        instance_spec("llama-3-8b", "h100", quantization="fp4")
