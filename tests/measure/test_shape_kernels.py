"""measure/shape_kernels.py (+ linear_kernels.py, moe_kernels.py, kernel_cache.py): the engine's kernels timed at
the loaded model's shapes, cached, and read by the engine's step predictions (with_kernel_table). Tiny random models
and small grids: seconds."""

import json

import pytest
import torch

from servescope.analysis import busy
from servescope.analysis.hardware import LOCAL_CPU, get_hardware
from servescope.analysis.kernel_table import PROJECTIONS, KernelTable, table_key
from servescope.analysis.op_counts import routed_expert_bytes
from servescope.config import EngineConfig, SamplingParams
from servescope.engine.llm_engine import LLMEngine
from servescope.kernels.cpu import ops as cpu_ops
from servescope.measure import decode_plan, kernel_cache, linear_kernels, local_hardware, moe_kernels, shape_kernels
from servescope.model.attention.cpu import TILED_F32_MIN_TOKENS

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the CPU kernel extension is not built here")


@pytest.fixture
def small_grids(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(linear_kernels, "ROWS", (1, 2, 9, 64))
    monkeypatch.setattr(linear_kernels, "HEAD_ROWS", (1, 4))
    monkeypatch.setattr(shape_kernels, "RUNS", 1)
    monkeypatch.setattr(moe_kernels, "RUNS", 1)
    monkeypatch.setattr(moe_kernels, "MOE_TOKENS", (1, 4, 32))
    monkeypatch.setattr(busy, "BUSY_SHARE", 0.0)  # a test run at low priority is never "quiet"
    monkeypatch.setattr(busy, "OTHERS_MAX", float("inf"))
    monkeypatch.setattr(shape_kernels, "MISC_TOKENS", (1, 16))
    monkeypatch.setattr(shape_kernels, "LAYER_TOKENS", (16, 64))
    monkeypatch.setattr(shape_kernels, "PAGED_GRID", ((1, 16), (4, 64), (8, 32)))
    monkeypatch.setattr(shape_kernels, "SHORT_GRID", ((16, 0), (32, 16), (48, 0)))
    monkeypatch.setattr(shape_kernels, "SHORT_F32_GRID", ((2, 0), (16, 0), (4, 32), (20, 64)))
    monkeypatch.setattr(shape_kernels, "LONG_GRID", ((128, 0), (130, 64), (256, 0)))
    monkeypatch.setattr(decode_plan, "DECODE_ROWS", (1, 4))
    monkeypatch.setattr(decode_plan, "DECODE_CONTEXT", 32)


def tiny_engine(tmp_path, dtype: str, quantization=None, config=TINY) -> LLMEngine:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    # any spec named local-cpu: with_kernel_table only times engines that predict on the local probe
    spec = get_hardware("H100-SXM").replace(name=LOCAL_CPU, kind="cpu")
    return LLMEngine(EngineConfig(model=f"random:{path}", dtype=dtype, quantization=quantization, num_kv_blocks=256,
                                  max_model_len=1024, skip_tokenizer_init=True), hardware_spec=spec)


@pytest.mark.parametrize("dtype,quantization", [("float32", None), ("bfloat16", None), ("bfloat16", "int4")])
def test_the_table_is_measured_once_cached_and_prices_the_steps(small_grids, tmp_path, monkeypatch, dtype,
                                                                 quantization):
    engine = local_hardware.with_kernel_table(tiny_engine(tmp_path, dtype, quantization))
    wdt, kdt, adt, _ = engine.step_cost_predictor.predictor.dtypes
    key = table_key(engine.model_config, wdt, adt, kdt)
    assert wdt == ("int4" if quantization else dtype)
    table = KernelTable.from_dict(engine.hardware.kernel_tables[key])  # validates its form
    assert set(table.linear) == set(PROJECTIONS)
    assert [r for r, _ in table.linear["qkv_proj"]] == [1, 2, 9, 64]
    assert all(t > 0 for pts in table.linear.values() for _, t in pts)
    assert table.long_min_tokens == (128 if dtype == "bfloat16" else TILED_F32_MIN_TOKENS)
    assert [t for t, _ in table.prefill_factor] == [16, 64] and all(f >= 0.5 for _, f in table.prefill_factor)
    # the engine's own decode plan timed over its layers at the decode rows it serves
    assert engine.executor.decode_plan is not None and table.decode_rows == engine.executor.decode_plan.max_rows
    assert [r for r, *_ in table.decode_plan] == [1, 4] and all(min(p) > 0 for p in table.decode_plan)
    assert len(table.grid["paged"]) == 3 and len(table.grid["long"]) == 3
    # short prefill chunks, a fit of their own: bfloat16's on the paged kernel (one call for all of them), float32's
    # on SDPA (a call each, over its gathered context: the fit has a term per cached token)
    assert len(table.grid["short"]) == (3 if dtype == "bfloat16" else 4) and table.short is not None
    assert table.short_per_sequence == (dtype == "float32")
    assert all(len(p) == (4 if dtype == "float32" else 3) for p in table.grid["short"])
    # the sampler over the model's vocabulary, measured at the head's rows, priced with the head
    assert [r for r, _ in table.sample] == [1, 4] and all(t > 0 for _, t in table.sample)
    # the engine's own predictions now come from it: its StepRecords carry them
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    cost = engine.step_cost_predictor.predict([(1, 40)], 1)
    assert cost.op("qkv_proj").measured and not cost.op("embedding").measured
    layers_host = 2 * engine.hardware.layer_overhead_s  # the plan's per-layer host time, priced beside its layers
    assert cost.op("qkv_proj").seconds == pytest.approx(2 * table.linear_seconds("qkv_proj", 1)
                                                        * table.layers_factor([(1, 40)], layers_host))
    assert cost.op("lm_head").seconds == pytest.approx(table.linear_seconds("lm_head", 1) + table.sample_seconds(1))
    assert engine.step_records[-1].predicted_seconds == pytest.approx(
        engine.step_cost_predictor.predictor.predict([(1, engine.step_records[-1].context_lens[0] - 1)], 1).seconds)
    # cached under this CPU, thread count, kernels' sources and shape: a second engine reads it back
    monkeypatch.setattr(kernel_cache, "measure_kernel_table", lambda e: pytest.fail("measured twice"))
    again = local_hardware.with_kernel_table(tiny_engine(tmp_path, dtype, quantization))
    assert again.hardware.kernel_tables[key] == engine.hardware.kernel_tables[key]


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32, torch.int8])
def test_attention_is_timed_over_caches_whose_every_page_is_written(kv_dtype):
    # calloc's zero pages all map one physical page until written: a context read from them comes from L1
    cache = shape_kernels.written_cache((4, 16, 2, 32), kv_dtype)
    assert cache.shape[:3] == (4, 16, 2) and cache.dtype == kv_dtype
    assert bool((cache.view(torch.uint8) != 0).all())
    if kv_dtype.is_floating_point:  # the fill reads as a normal, finite number
        v = cache.float()
        assert bool(torch.isfinite(v).all()) and bool((v.abs() >= torch.finfo(kv_dtype).tiny).all())


def test_the_sampler_is_timed_over_the_models_vocabulary(monkeypatch):
    monkeypatch.setattr(linear_kernels, "HEAD_ROWS", (1, 3))
    monkeypatch.setattr(shape_kernels, "RUNS", 1)
    seen = []
    real = linear_kernels._sample_seconds
    monkeypatch.setattr(linear_kernels, "_sample_seconds", lambda v, r: seen.append((v, r)) or real(v, r))
    pts = linear_kernels.measure_sampling(type("Cfg", (), {"vocab_size": 4096})())
    assert [r for r, _ in pts] == [1, 3] and all(t > 0 for _, t in pts)
    assert seen == [(linear_kernels.TINY_VOCAB, 1), (4096, 1), (4096, 3)]  # the tiny call's cost taken off


def test_engines_on_other_specs_are_left_alone(small_grids, tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_cache, "measure_kernel_table", lambda e: pytest.fail("measured"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    engine = LLMEngine(EngineConfig(model=f"random:{path}", num_kv_blocks=64, max_model_len=256,
                                    skip_tokenizer_init=True, hardware="H100-SXM"))
    assert local_hardware.with_kernel_table(engine).hardware.kernel_tables == {}


def test_a_table_measured_on_a_busy_machine_serves_the_run_but_is_not_cached(small_grids, tmp_path, monkeypatch):
    monkeypatch.setattr(busy, "BUSY_SHARE", 1e6)  # no run gets a million CPUs per thread
    monkeypatch.setattr(busy, "BUSY_MIN_WINDOW_S", 0.0)
    engine = local_hardware.with_kernel_table(tiny_engine(tmp_path, "float32"))
    assert len(engine.hardware.kernel_tables) == 1
    assert not kernel_cache.cache_path().exists()


# a MoE whose first layer is dense (DeepSeek's first_k_dense_replace in Qwen2-MoE's terms: mlp_only_layers)
MOE = {**TINY, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_hidden_layers": 3,
       "moe_intermediate_size": 64, "shared_expert_intermediate_size": 128, "num_experts": 16,
       "num_experts_per_tok": 4, "mlp_only_layers": [0], "decoder_sparse_step": 1, "norm_topk_prob": False}


def test_a_moe_table_times_its_sparse_blocks_and_prices_the_mlp_by_the_steps_routing(small_grids, tmp_path):
    engine = local_hardware.with_kernel_table(tiny_engine(tmp_path, "float32", config=MOE))
    cfg = engine.model_config
    wdt, kdt, adt, _ = engine.step_cost_predictor.predictor.dtypes
    table = KernelTable.from_dict(engine.hardware.kernel_tables[table_key(cfg, wdt, adt, kdt)])
    assert [t for t, _ in table.moe] == [1, 4, 32] and all(s > 0 for _, s in table.moe)
    distinct = dict(table.moe_distinct)
    assert distinct[1] == 4 and 4 <= distinct[4] <= 16 and distinct[32] <= 16  # k at one row, at most E
    assert table.linear["gate_up_proj"][0][1] > 0  # the dense first layer's MLP is timed as a projection
    # the MLP of a step: the dense layer's projections plus two sparse blocks, their expert reads (one expert's
    # bytes at the bandwidth) scaled by the measured routing
    cost = engine.step_cost_predictor.predictor.predict([(1, 20)], 1, distinct_experts=2.0).cost
    read_s = routed_expert_bytes(cfg, wdt, adt) / engine.hardware.memory_bandwidth
    assert 0 < read_s and table.moe_seconds(1, 2.0, read_s) < table.moe_seconds(1)
    want = (table.linear_seconds("gate_up_proj", 1) + table.linear_seconds("down_proj", 1)
            + 2 * table.moe_seconds(1, 2.0, read_s)) * table.layers_factor(
                [(1, 20)], cfg.num_hidden_layers * engine.hardware.layer_overhead_s)  # a decode step on the plan
    assert cost.op("mlp").measured and cost.op("mlp").seconds == pytest.approx(want)
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert all(r.predicted_seconds and r.predicted_seconds > 0 for r in engine.step_records)


@pytest.mark.parametrize("quant", ["int4", None, "int8"])
def test_a_planned_moe_is_timed_as_its_decode_steps_run_it(small_grids, tmp_path, quant):
    """Experts on a fused op (packed, float as loaded, per-channel int8): the C++ decode plan runs the sparse
    MLPs of decode steps, so the table times the plan's (up to its rows), the blocks' forward above; the same
    routing either way."""
    engine = tiny_engine(tmp_path, "float32", quantization=quant, config=MOE)
    plan, model, cfg = engine.executor.decode_plan, engine.model, engine.model_config
    assert plan is not None and sorted(plan.sparse) == [1, 2]

    class Spy:
        def __init__(self, mlp):
            self.mlp, self.rows = mlp, []

        def run(self, x):
            self.rows.append(x.shape[0])
            return self.mlp.run(x)

    plan.sparse = {i: Spy(m) for i, m in plan.sparse.items()}
    plan.max_rows = 4
    times, distinct = moe_kernels.measure_moe_table(model, cfg, engine.dtype, plan)
    assert [t for t, _ in times] == [1, 4, 32] and all(s > 0 for _, s in times)
    assert all(set(s.rows) == {1, 4} for s in plan.sparse.values())
    assert distinct == moe_kernels.measure_moe_table(model, cfg, engine.dtype)[1]


def test_moe_seconds_scale_with_the_measured_experts_and_the_table_round_trips():
    t = KernelTable.from_dict({"key": "k", "linear": {p: [[1, 1e-4]] for p in PROJECTIONS}, "misc": [[1, 1e-5]],
                               "paged": {"fixed": 0.0, "per_row": 0.0, "per_key": 0.0},
                               "long": {"fixed": 0.0, "per_row": 0.0, "per_key": 0.0}, "long_min_tokens": 2,
                               "paged_max_context": 0, "moe": [[1, 2e-3], [8, 6e-3]],
                               "moe_distinct": [[1, 4.0], [8, 16.0]]})
    assert t.moe_seconds(1) == pytest.approx(2e-3) and t.moe_seconds(8, 8.0) == pytest.approx(3e-3)
    assert t.moe_seconds(4) == pytest.approx(2e-3 + 4e-3 * 3 / 7) and t.moe_seconds(0) == 0.0
    # only the share that reads the experts scales: at 8 rows, 16 experts at 0.1 ms each are 1.6 of the 6 ms
    assert t.moe_seconds(8, 8.0, 1e-4) == pytest.approx(6e-3 - 1.6e-3 / 2)
    assert t.moe_seconds(8, 8.0, 1e-3) == pytest.approx(3e-3)  # reads bound the whole block: all of it scales
    assert KernelTable.from_dict(t.to_dict()) == t
    with pytest.raises(ValueError, match="moe"):
        KernelTable.from_dict({**t.to_dict(), "moe": [[8, 1e-3], [1, 1e-3]]})  # rows must ascend


def test_a_row_count_slower_than_a_larger_one_is_flagged():
    assert linear_kernels.undercut_rows({1: 1.0, 2: 1.1, 64: 2.0, 128: 4.0, 192: 9.0, 256: 9.5, 320: 6.0}, 0.05) \
        == [192, 256]
    assert linear_kernels.undercut_rows({1: 1.0, 2: 1.04, 3: 1.0}, 0.05) == []  # within the tolerance
    assert linear_kernels.undercut_rows({1: 1.0, 2: 2.0, 4: 4.0}, 0.05) == []


def test_a_slow_spell_over_some_rows_is_timed_again_and_a_real_step_up_kept(monkeypatch):
    """The sweep's points that a larger row count undercuts are timed again after it, and keep the quicker
    timing; the others are timed once. Here rows 192 and 256 fall in a 'spell' (3x) on their first timing only,
    and 65 is a kernel's real step up (slower than 64, not than anything larger): it stays."""
    monkeypatch.setattr(linear_kernels, "ROWS", (16, 64, 65, 128, 192, 256, 320))
    monkeypatch.setattr(linear_kernels, "call_overhead", lambda dtype: 0.0)
    monkeypatch.setattr(linear_kernels, "_head_table", lambda *a: [[1, 1e-3]])
    timed: list = []

    def fake(layers, cfg, dtype, rows, overhead):
        timed.append(rows)
        t = rows * 1e-4 * (1.3 if rows == 65 else 1.0) * (3.0 if rows in (192, 256) and timed.count(rows) == 1 else 1)
        return {"qkv_proj": t, "o_proj": t / 2, "gate_up_proj": 2 * t, "down_proj": t}

    monkeypatch.setattr(linear_kernels, "_time_rows", fake)
    model = type("M", (), {"model": type("I", (), {"layers": []})()})()
    table, _ = linear_kernels.measure_linear_tables(model, None, torch.bfloat16)
    assert sorted(timed) == sorted(list(linear_kernels.ROWS) + [192, 256])
    qkv = dict((r, t) for r, t in table["qkv_proj"])
    assert qkv[192] == pytest.approx(192e-4) and qkv[256] == pytest.approx(256e-4)
    assert qkv[65] == pytest.approx(65e-4 * 1.3) and table["lm_head"] == [[1, 1e-3]]


def test_the_head_is_swept_the_same_way(monkeypatch):
    monkeypatch.setattr(linear_kernels, "HEAD_ROWS", (1, 8, 32, 64))
    monkeypatch.setattr(shape_kernels, "RUNS", 1)

    class Head:
        rows = 0

        def __call__(self, x):
            self.rows = x.shape[0]

    head, calls = Head(), []

    def fake_timed(fn):  # 32 rows in a 'spell' (3x) the first time only
        fn()
        calls.append(head.rows)
        return head.rows * 1e-4 * (3.0 if head.rows == 32 and calls.count(32) == 1 else 1.0)

    monkeypatch.setattr(linear_kernels, "_timed", fake_timed)
    cfg = type("Cfg", (), {"hidden_size": 8, "q_size": 8, "intermediate_size": 16})()
    model = type("M", (), {"lm_head": head})()
    pts = linear_kernels._head_table(model, [], cfg, torch.float32, 0.0)
    assert calls == [1, 8, 32, 64, 32]
    assert pts == [[1, pytest.approx(1e-4)], [8, pytest.approx(8e-4)], [32, pytest.approx(32e-4)],
                   [64, pytest.approx(64e-4)]]
