"""Presets load; the roofline is min(peak, I * BW) and plots; explain's JSON has what the CLI needs."""

import json

import pytest

from servescope.analysis.explain import explain, render_explain_table
from servescope.analysis.hardware import get_hardware
from servescope.analysis.presets import list_presets, load_preset
from servescope.analysis.roofline import attainable_flops, plot_roofline
from servescope.errors import InvalidParameterError

PRESETS = ["llama-2-7b", "llama-3-8b", "llama-3-70b", "mistral-7b", "qwen2.5-7b", "qwen3-8b", "smollm2-135m"]


def test_all_presets_listed_and_load():
    assert set(PRESETS) <= set(list_presets())
    for name in PRESETS:
        cfg = load_preset(name)
        assert cfg.name == name and cfg.num_parameters() > 1e8


def test_preset_details():
    smol = load_preset("smollm2-135m")
    shape = (smol.hidden_size, smol.num_hidden_layers, smol.num_attention_heads, smol.num_key_value_heads)
    assert shape == (576, 30, 9, 3)
    assert smol.tie_word_embeddings and smol.rope_theta == 100000 and smol.vocab_size == 49152
    assert load_preset("mistral-7b").sliding_window == 4096
    assert load_preset("qwen2.5-7b").attention_bias and load_preset("qwen3-8b").qk_norm
    assert load_preset("llama-3-8b").rope_scaling is None and load_preset("llama-3-8b").rope_theta == 500000
    assert 70e9 < load_preset("llama-3-70b").num_parameters() < 71e9


def test_load_preset_from_path(tmp_path):
    d = tmp_path / "my-model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(load_preset("smollm2-135m").to_hf_dict()))
    assert load_preset(d).hidden_size == 576
    assert load_preset(d / "config.json").name == "my-model"
    with pytest.raises(InvalidParameterError):
        load_preset("gpt-17")


def test_attainable_flops_roofline():
    hw = get_hardware("A100-80GB")
    ridge = hw.ridge_point("bfloat16")
    assert attainable_flops(hw, ridge / 10) == pytest.approx(ridge / 10 * hw.memory_bandwidth)
    assert attainable_flops(hw, ridge * 10) == hw.flops("bfloat16")
    assert attainable_flops(hw, 1.0, "float32") == hw.memory_bandwidth


def test_plot_roofline_writes_png(tmp_path):
    hw = get_hardware("H100")
    out = plot_roofline(hw, [("decode b=1", 1.0, 3e12), ("prefill", 2000.0, 8e14), ("empty", 0.0, 0.0)],
                        tmp_path / "sub" / "roofline.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_explain_structure_and_rendering():
    cfg, hw = load_preset("llama-3-8b"), get_hardware("H100")
    r = explain(cfg, hw, batch=4, prompt_len=512, output_len=65)
    json.dumps(r, allow_nan=False)  # strict JSON: no inf or nan
    assert r["kv_cache_bytes_per_token"] == 131072
    assert r["weight_bytes"] == 16_060_522_496
    assert r["max_concurrent_sequences"] > 4
    assert r["critical_batch_size"] is None or r["critical_batch_size"] > 0
    assert r["critical_batch_size_no_context"] > 100
    names = [p["name"] for p in r["phases"]]
    assert names == ["prefill", "decode"]
    for p in r["phases"]:
        for key in ("flops", "bytes", "arithmetic_intensity", "predicted_seconds", "bound", "ops"):
            assert key in p
        assert {o["name"] for o in p["ops"]} >= {"qkv_proj", "attention", "mlp", "kv_read", "lm_head"}
    prefill, decode = r["phases"]
    assert prefill["bound"] == "compute" and decode["bound"] == "memory"
    assert decode["context_len"] == 512 + 63 // 2
    assert r["ttft_seconds"] == prefill["predicted_seconds"]
    assert r["e2e_seconds"] == pytest.approx(r["ttft_seconds"] + 64 * r["tpot_seconds"])
    from rich.console import Console

    console = Console(width=120, record=True)
    console.print(render_explain_table(r))
    text = console.export_text()
    assert "prefill" in text and "mlp" in text and "TTFT" in text


def test_explain_single_output_token_has_no_decode():
    r = explain(load_preset("smollm2-135m"), get_hardware("L4"), batch=1, prompt_len=10, output_len=1,
                weight_dtype="float32", memory_bytes=2**30)
    assert [p["name"] for p in r["phases"]] == ["prefill"] and r["tpot_seconds"] is None
    assert r["e2e_seconds"] == r["ttft_seconds"]
    render_explain_table(r)
