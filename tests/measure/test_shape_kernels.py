"""measure/shape_kernels.py: the engine's kernels timed at the loaded model's shapes, cached, and read by the
engine's step predictions (with_kernel_table). A tiny random model and small grids: seconds."""

import json

import pytest

from servescope.analysis.hardware import LOCAL_CPU, get_hardware
from servescope.analysis.kernel_table import PROJECTIONS, KernelTable, table_key
from servescope.config import EngineConfig, SamplingParams
from servescope.engine.llm_engine import LLMEngine
from servescope.kernels.cpu import ops as cpu_ops
from servescope.measure import local_hardware, shape_kernels

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2, "hidden_size": 128,
        "intermediate_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 512, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="the CPU kernel extension is not built here")


@pytest.fixture
def small_grids(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(shape_kernels, "ROWS", (1, 2, 9, 64))
    monkeypatch.setattr(shape_kernels, "HEAD_ROWS", (1, 4))
    monkeypatch.setattr(shape_kernels, "RUNS", 1)
    monkeypatch.setattr(shape_kernels, "BUSY_SHARE", 0.0)  # a test run at low priority is never "quiet"
    monkeypatch.setattr(shape_kernels, "MISC_TOKENS", (1, 16))
    monkeypatch.setattr(shape_kernels, "LAYER_TOKENS", (16, 64))
    monkeypatch.setattr(shape_kernels, "PAGED_GRID", ((1, 16), (4, 64), (8, 32)))
    monkeypatch.setattr(shape_kernels, "SHORT_GRID", ((16, 0), (32, 16)))
    monkeypatch.setattr(shape_kernels, "LONG_GRID", ((128, 0), (130, 64), (256, 0)))


def tiny_engine(tmp_path, dtype: str, quantization=None) -> LLMEngine:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
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
    assert table.long_min_tokens == (128 if dtype == "bfloat16" else 2)
    assert [t for t, _ in table.prefill_factor] == [16, 64] and all(f >= 0.5 for _, f in table.prefill_factor)
    assert len(table.grid["paged"]) == 3 + (2 if dtype == "bfloat16" else 0) and len(table.grid["long"]) == 3
    # the engine's own predictions now come from it: its StepRecords carry them
    engine.add_request("r", list(range(3, 40)), SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    cost = engine.step_cost_predictor.predict([(1, 40)], 1)
    assert cost.op("qkv_proj").measured and not cost.op("embedding").measured
    assert cost.op("qkv_proj").seconds == pytest.approx(2 * table.linear_seconds("qkv_proj", 1))
    assert engine.step_records[-1].predicted_seconds == pytest.approx(
        engine.step_cost_predictor.predictor.predict([(1, engine.step_records[-1].context_lens[0] - 1)], 1).seconds)
    # cached under this CPU, thread count, kernels' sources and shape: a second engine reads it back
    monkeypatch.setattr(shape_kernels, "measure_kernel_table", lambda e: pytest.fail("measured twice"))
    again = local_hardware.with_kernel_table(tiny_engine(tmp_path, dtype, quantization))
    assert again.hardware.kernel_tables[key] == engine.hardware.kernel_tables[key]


def test_engines_on_other_specs_are_left_alone(small_grids, tmp_path, monkeypatch):
    monkeypatch.setattr(shape_kernels, "measure_kernel_table", lambda e: pytest.fail("measured"))
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    engine = LLMEngine(EngineConfig(model=f"random:{path}", num_kv_blocks=64, max_model_len=256,
                                    skip_tokenizer_init=True, hardware="H100-SXM"))
    assert local_hardware.with_kernel_table(engine).hardware.kernel_tables == {}


def test_a_table_measured_on_a_busy_machine_serves_the_run_but_is_not_cached(small_grids, tmp_path, monkeypatch):
    monkeypatch.setattr(shape_kernels, "BUSY_SHARE", 1e6)  # no run gets a million CPUs per thread
    monkeypatch.setattr(shape_kernels, "BUSY_MIN_WINDOW_S", 0.0)
    engine = local_hardware.with_kernel_table(tiny_engine(tmp_path, "float32"))
    assert len(engine.hardware.kernel_tables) == 1
    assert not shape_kernels.cache_path().exists()
