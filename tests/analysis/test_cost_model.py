"""Hand-computed costs, exact causal attention counts, and the shape of decode cost vs batch."""

import math

import pytest

from servescope.analysis.cost_model import (
    OP_NAMES, attended_keys, attention_flops, critical_batch_size, decode_cost, kv_cache_bytes_per_token,
    matmul_flops, predict_tpot, predict_ttft, prefill_cost, step_cost, weight_bytes,
)
from servescope.analysis.hardware import HardwareSpec, get_hardware
from servescope.analysis.presets import load_preset
from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError

LLAMA3 = load_preset("llama-3-8b")
SMOL = load_preset("smollm2-135m")
H100 = get_hardware("H100-SXM")


def test_kv_bytes_per_token_hand_computed():
    assert kv_cache_bytes_per_token(LLAMA3, "bfloat16") == 131072  # 2 * 32 layers * 8 heads * 128 * 2 B
    assert kv_cache_bytes_per_token(LLAMA3, "float32") == 262144
    assert kv_cache_bytes_per_token(SMOL, "bfloat16") == 2 * 30 * 3 * 64 * 2 == 23040


def test_weight_bytes_hand_computed():
    assert LLAMA3.num_parameters() == 8_030_261_248
    assert weight_bytes(LLAMA3, "bfloat16") == 16_060_522_496
    assert weight_bytes(LLAMA3, "float32") == 32_121_044_992
    # int8: 218,103,808 linear params per layer at 1 B, 43,008 bf16 scales per layer,
    # embeddings + lm_head (2 * 128256 * 4096) and norms (32 * 2 * 4096 + 4096) in bf16
    assert weight_bytes(LLAMA3, "int8") == 32 * 218_103_808 + 32 * 43_008 * 2 + 2 * (1_050_673_152 + 266_240)
    assert SMOL.num_parameters() == 134_515_008  # tied embeddings counted once
    assert weight_bytes(SMOL, "bfloat16") == 269_030_016


@pytest.mark.parametrize("name", ["llama-2-7b", "qwen2.5-7b", "qwen3-8b", "mistral-7b", "smollm2-135m"])
def test_weight_bytes_float_is_params_times_size(name):
    cfg = load_preset(name)
    assert weight_bytes(cfg, "float16") == 2 * cfg.num_parameters()
    assert weight_bytes(cfg, "float32") == 4 * cfg.num_parameters()


def test_smollm2_single_token_decode_flops():
    mm = matmul_flops(SMOL, 1, 1)
    assert mm == {"qkv_proj": 2 * 576 * 960 * 30, "attn_out_proj": 2 * 576 * 576 * 30,
                  "mlp": 2 * 3 * 576 * 1536 * 30, "lm_head": 2 * 576 * 49152}
    assert attention_flops(SMOL, [(1, 0)]) == 4 * 9 * 64 * 1 * 30


def _brute_force_keys(n_new, ctx):
    # token at absolute position p sees keys 0..p; the new tokens sit at ctx..ctx+n_new-1
    return sum(1 for p in range(ctx, ctx + n_new) for j in range(ctx + n_new) if j <= p)


@pytest.mark.parametrize("n_new,ctx", [(1, 0), (1, 17), (5, 0), (7, 3), (16, 16), (3, 40)])
def test_causal_keys_brute_force(n_new, ctx):
    assert attended_keys(n_new, ctx) == _brute_force_keys(n_new, ctx)


def test_attention_flops_sum_over_sequences():
    seqs = [(4, 0), (1, 9), (6, 2)]
    keys = sum(_brute_force_keys(n, c) for n, c in seqs)
    H, D, L = SMOL.num_attention_heads, SMOL.head_dim, SMOL.num_hidden_layers
    assert attention_flops(SMOL, seqs) == 4 * H * D * keys * L


def test_step_has_every_op_and_consistent_totals():
    s = step_cost(LLAMA3, [(100, 0), (1, 500), (1, 20)], H100)
    assert [o.name for o in s.ops] == list(OP_NAMES)
    assert s.flops == sum(o.flops for o in s.ops)
    assert s.predicted_seconds == pytest.approx(sum(max(o.compute_seconds, o.memory_seconds) for o in s.ops))
    for o in s.ops:
        assert o.bound in ("compute", "memory")
        assert o.seconds == max(o.flops / H100.flops("bfloat16"), o.bytes / H100.memory_bandwidth)
    assert s.op("kv_read").bytes == 520 * 131072
    assert s.op("kv_write").bytes == 102 * 131072
    assert s.op("lm_head").flops == 3 * 2 * 4096 * 128256  # one logit row per sequence


def test_weights_read_once_per_step_whatever_the_batch():
    emb = LLAMA3.vocab_size * LLAMA3.hidden_size * 2
    for b in (1, 7, 64):
        s = decode_cost(LLAMA3, b, 0, H100)
        # every weight once, except the embedding table, of which only b rows are read
        assert s.weight_bytes == weight_bytes(LLAMA3) - emb + b * LLAMA3.hidden_size * 2
    tied = decode_cost(SMOL, 3, 10, H100)
    assert tied.weight_bytes == weight_bytes(SMOL) + 3 * SMOL.hidden_size * 2  # lm_head reads the table


def test_decode_is_flat_then_compute_bound_around_critical_batch():
    ctx = 64
    crit = critical_batch_size(LLAMA3, H100, "bfloat16", ctx)
    assert 100 < crit < 1000  # ridge of H100 bf16 is ~295 FLOP/B
    lo, hi = decode_cost(LLAMA3, int(crit / 2), ctx, H100), decode_cost(LLAMA3, int(crit * 2), ctx, H100)
    assert lo.compute_seconds < lo.memory_seconds and lo.bound == "memory"
    assert hi.compute_seconds > hi.memory_seconds and hi.bound == "compute"
    at = decode_cost(LLAMA3, 2, ctx, H100)
    b = crit  # at the crossover compute time equals memory time (affine in b, so interpolate)
    f = lambda s: s.compute_seconds - s.memory_seconds  # noqa: E731
    one = decode_cost(LLAMA3, 1, ctx, H100)
    assert f(one) + (f(at) - f(one)) * (b - 1) == pytest.approx(0, abs=1e-9)
    # memory-bound decode: batch 1 and batch 8 take nearly the same time
    assert predict_tpot(LLAMA3, 8, ctx, H100) < 1.1 * predict_tpot(LLAMA3, 1, ctx, H100)


def test_critical_batch_infinite_at_long_context():
    assert math.isinf(critical_batch_size(LLAMA3, H100, "bfloat16", 32768))


def test_prefill_compute_bound_and_chunking_adds_up():
    s = prefill_cost(LLAMA3, 2048, 1, H100)
    assert s.bound == "compute"
    one = predict_ttft(LLAMA3, 2048, H100)
    assert one == pytest.approx(s.predicted_seconds)
    chunked = predict_ttft(LLAMA3, 2048, H100, chunk_size=512)
    manual = sum(step_cost(LLAMA3, [(512, 512 * k)], H100).predicted_seconds for k in range(4))
    assert chunked == pytest.approx(manual)
    assert chunked > one  # weights are read four times


def test_efficiency_and_overhead():
    base = decode_cost(LLAMA3, 1, 0, H100)
    slow = decode_cost(LLAMA3, 1, 0, H100, efficiency={"memory": 0.5})
    assert slow.predicted_seconds == pytest.approx(2 * base.predicted_seconds, rel=1e-3)
    hw = H100.replace(step_overhead_s=1e-3, layer_overhead_s=1e-5)
    s = decode_cost(LLAMA3, 1, 0, hw)
    assert s.overhead_seconds == pytest.approx(1e-3 + 32 * 1e-5)
    assert s.predicted_seconds == pytest.approx(base.predicted_seconds + s.overhead_seconds)
    assert decode_cost(LLAMA3, 1, 0, hw, overhead_s=0.0).predicted_seconds == pytest.approx(base.predicted_seconds)
    with pytest.raises(InvalidParameterError):
        decode_cost(LLAMA3, 1, 0, H100, efficiency={"flops": 0.5})
    with pytest.raises(InvalidParameterError):
        H100.replace(seq_overhead_s=-1e-6)
    with pytest.raises(InvalidParameterError):
        decode_cost(LLAMA3, 1, 0, H100, efficiency={"compute": 0})


def test_int8_halves_decode_weight_traffic_and_computes_in_bf16():
    bf = decode_cost(LLAMA3, 1, 0, H100, "bfloat16")
    q = decode_cost(LLAMA3, 1, 0, H100, "int8")
    assert q.op("mlp").weight_bytes < 0.51 * bf.op("mlp").weight_bytes
    assert q.op("mlp").flops == bf.op("mlp").flops
    assert q.peak_flops == H100.flops("bfloat16")


def test_bad_inputs_raise():
    with pytest.raises(InvalidParameterError):
        step_cost(LLAMA3, [], H100)
    with pytest.raises(InvalidParameterError):
        step_cost(LLAMA3, [(0, 3)], H100)
    with pytest.raises(InvalidParameterError):
        weight_bytes(LLAMA3, "int3")  # int4 is a packed format (test_packed_weights.py)
    with pytest.raises(InvalidParameterError):
        kv_cache_bytes_per_token(LLAMA3, "int4")
    # int8 is a KV dtype: 128 values and a 4-byte scale per row (32 layers x 8 KV heads x K and V)
    assert kv_cache_bytes_per_token(LLAMA3, "int8") == 2 * 32 * 8 * (128 + 4)


def test_cpu_spec_prediction_uses_its_own_peaks():
    cpu = HardwareSpec(name="toy", kind="cpu", memory_bandwidth=20e9, memory_bytes=2**34,
                       peak_flops={"float32": 150e9, "bfloat16": 600e9, "float16": 5e9, "int8": 600e9})
    s = decode_cost(SMOL, 1, 0, cpu, "float32")
    assert s.bound == "memory"
    assert s.predicted_seconds == pytest.approx(sum(o.seconds for o in s.ops))
    assert s.predicted_seconds > weight_bytes(SMOL, "float32") / 20e9 * 0.9


def test_measured_linear_rates_bound_the_linear_ops():
    """A spec with measured kernel rates: a linear op takes at least weight bytes / rate(M), M = rows
    (log-log interpolated between measured M), other ops and uncovered M keep the roofline."""
    cpu = HardwareSpec(name="toy", kind="cpu", memory_bandwidth=20e9, memory_bytes=2**34,
                       peak_flops={"float32": 150e9, "bfloat16": 600e9, "float16": 5e9, "int8": 600e9})
    assert cpu.linear_rate("float32", 4) is None
    rates = cpu.replace(linear_rates={"float32": [[1, 10e9], [4, 10e9], [16, 2.5e9]]})
    assert rates.linear_rate("float32", 4) == pytest.approx(10e9)
    assert rates.linear_rate("float32", 8) == pytest.approx(5e9)  # halfway in log M: geometric mean
    assert rates.linear_rate("float32", 32) is None and rates.linear_rate("bfloat16", 1) is None
    plain, slow = decode_cost(SMOL, 8, 0, cpu, "float32"), decode_cost(SMOL, 8, 0, rates, "float32")
    for name in ("qkv_proj", "attn_out_proj", "mlp"):
        op = slow.op(name)
        assert op.kernel_seconds == pytest.approx(op.weight_bytes / 5e9)
        assert op.seconds == pytest.approx(max(op.kernel_seconds, plain.op(name).seconds))
    assert slow.op("lm_head").kernel_seconds == pytest.approx(slow.op("lm_head").weight_bytes / 5e9)
    assert slow.op("attention").kernel_seconds == 0 and slow.op("kv_read").seconds == plain.op("kv_read").seconds
    big = step_cost(SMOL, [(64, 0)], rates, "float32")  # 64 rows: beyond the table, roofline only
    assert big.op("mlp").kernel_seconds == 0
    with pytest.raises(InvalidParameterError):
        cpu.replace(linear_rates={"float32": [[4, 1e9], [2, 1e9]]})
    assert HardwareSpec.from_dict(rates.to_dict()) == rates


def test_measured_decode_attention_rate_prices_decode_sequences_only():
    cpu = HardwareSpec(name="toy", kind="cpu", memory_bandwidth=20e9, memory_bytes=2**34,
                       peak_flops={"float32": 150e9, "bfloat16": 600e9, "float16": 5e9, "int8": 600e9})
    slow = cpu.replace(decode_attention_flops={"float32": 10e9})
    seqs = [(1, 300), (1, 40), (64, 100)]
    plain, s = step_cost(SMOL, seqs, cpu, "float32"), step_cost(SMOL, seqs, slow, "float32")
    dec, pre = attention_flops(SMOL, seqs[:2]), attention_flops(SMOL, seqs[2:])
    assert s.op("attention").kernel_seconds == pytest.approx(dec / 10e9 + pre / 150e9)
    assert plain.op("attention").kernel_seconds == 0
    assert s.op("attention").seconds == pytest.approx(max(plain.op("attention").seconds, dec / 10e9 + pre / 150e9))
    assert step_cost(SMOL, [(8, 0)], slow, "float32").op("attention").kernel_seconds == 0  # no decode sequence
    with pytest.raises(InvalidParameterError):
        cpu.replace(decode_attention_flops={"float32": 0.0})


def test_model_config_roundtrip_tiny():
    cfg = ModelConfig(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=16,
                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=4)
    assert weight_bytes(cfg, "float32") == 4 * cfg.num_parameters()


def test_the_host_overhead_per_sequence_grows_with_the_steps_rows_alone():
    """B * seq_overhead_s on top of the per-step and per-layer overhead: the same for a decode row as for a
    prefill chunk, whatever its tokens or context; nothing on a spec without it; overhead_s replaces it all."""
    hw = H100.replace(step_overhead_s=1e-3, layer_overhead_s=1e-5, seq_overhead_s=4e-5)
    fixed = 1e-3 + 32 * 1e-5
    for seqs in ([(1, 100)], [(1, 100)] * 8, [(1, 2000)] * 8, [(300, 0), (1, 50), (1, 900)]):
        with_seq = step_cost(LLAMA3, seqs, hw)
        without = step_cost(LLAMA3, seqs, hw.replace(seq_overhead_s=0.0))
        assert with_seq.overhead_seconds == pytest.approx(fixed + len(seqs) * 4e-5)
        assert with_seq.predicted_seconds - without.predicted_seconds == pytest.approx(len(seqs) * 4e-5)
        assert [o.seconds for o in with_seq.ops] == [o.seconds for o in without.ops]  # the ops are unchanged
    assert step_cost(LLAMA3, [(1, 100)] * 8, hw, overhead_s=0.0).overhead_seconds == 0.0
