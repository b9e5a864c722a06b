"""KV per group of layers of one attention kind (analysis/kv_layout.py) in the memory planner and explain:
bytes per token per group, what one block table for all layers holds per sequence (a hybrid keeps every block,
an all-windowed model a window's) and what each kind needs (the engine's table per group), counted here from the
layer shapes."""

import math

from servescope.analysis.explain import explain, render_explain_table
from servescope.analysis.hardware import get_hardware
from servescope.analysis.kv_layout import kv_groups
from servescope.analysis.memory_planner import plan_memory
from servescope.analysis.presets import load_preset

CTX, S = 8192, 16


def _per_layer(cfg, dtype_bytes=2):
    return 2 * cfg.num_key_value_heads * cfg.head_dim * dtype_bytes


def test_gemma3_hybrid_groups():
    cfg = load_preset("gemma-3-1b")  # 26 layers, every sixth global, window 512
    full, sliding = kv_groups(cfg, "bfloat16", CTX, S)
    assert (full.kind, full.layers, sliding.kind, sliding.layers, sliding.window) == ("full", 4, "sliding", 22, 512)
    assert full.bytes_per_token == 4 * _per_layer(cfg) and sliding.bytes_per_token == 22 * _per_layer(cfg)
    # one block table for all layers: the windowed layers hold the whole context too
    assert full.engine_tokens_per_sequence == sliding.engine_tokens_per_sequence == CTX
    assert sliding.needed_tokens_per_sequence == (math.ceil(512 / S) + 1) * S
    plan = plan_memory(cfg, 80e9, context_len=CTX, block_size=S)
    need = full.bytes_per_token * CTX + sliding.bytes_per_token * sliding.needed_tokens_per_sequence
    assert plan.max_concurrent_sequences_per_group_tables == plan.free_for_kv_bytes // need
    assert plan.max_concurrent_sequences_per_group_tables > 4 * plan.max_concurrent_sequences


def test_all_windowed_model_holds_the_window_already():
    cfg = load_preset("mistral-7b")
    (group,) = kv_groups(cfg, "bfloat16", CTX, S)
    assert group.engine_tokens_per_sequence == group.needed_tokens_per_sequence == (4096 // S + 1) * S
    plan = plan_memory(cfg, 80e9, context_len=CTX, block_size=S)
    assert plan.max_concurrent_sequences_per_group_tables == plan.max_concurrent_sequences


def test_explain_shows_the_groups_of_a_hybrid_only():
    from rich.console import Console

    hw = get_hardware("h100")
    text = {}
    for name in ("gemma-2-2b", "llama-3-8b"):
        console = Console(record=True, width=200)
        console.print(render_explain_table(explain(load_preset(name), hw, prompt_len=6000, output_len=100)))
        text[name] = console.export_text()
    assert "KV window 4096 (13 layers)" in text["gemma-2-2b"] and "KV full (13 layers)" in text["gemma-2-2b"]
    assert "block tables per group" in text["gemma-2-2b"] and "block tables per group" not in text["llama-3-8b"]
