"""The cost model, the memory planner and explain count KV per layer kind: a sliding layer attends over and
reads min(context, window) keys; an all-windowed model's sequences hold at most a window of KV."""

import dataclasses

import pytest

from servescope.analysis.cost_model import attended_keys, step_cost
from servescope.analysis.explain import explain
from servescope.analysis.memory_planner import plan_memory
from servescope.analysis.op_counts import kv_cache_bytes_per_token
from servescope.analysis.presets import load_preset


@pytest.mark.parametrize("n,c,w", [(1, 0, 4), (1, 9, 4), (5, 2, 4), (7, 0, 3), (10, 100, 16), (3, 1, 100)])
def test_windowed_attended_keys_count_each_query_capped(n, c, w):
    assert attended_keys(n, c, w) == sum(min(p + 1, w) for p in range(c, c + n))
    assert attended_keys(n, c) == sum(p + 1 for p in range(c, c + n))


def _mistral(window, layer_types=()):
    cfg = load_preset("mistral-7b")
    return dataclasses.replace(cfg, sliding_window=window, layer_types=layer_types)


def _op(cost, name):
    return next(o for o in cost.ops if o.name == name)


def _hw():
    from servescope.analysis.hardware import get_hardware

    return get_hardware("h100")


def test_a_windowed_decode_reads_the_window_not_the_context():
    full, windowed, hybrid = _mistral(None), _mistral(4096), _mistral(4096, ("sliding", "full") * 16)
    per_tok = kv_cache_bytes_per_token(full, "bfloat16")
    for cfg, read in ((full, 8192), (windowed, 4096), (hybrid, (4096 + 8192) / 2)):
        cost = step_cost(cfg, [(1, 8192)], _hw(), "bfloat16")
        assert _op(cost, "kv_read").bytes == pytest.approx(read * per_tok)
    # at 8k a batch of 32 windowed decodes is predicted as at 4k (the window); a full model's grows with
    # the context (its KV read then outweighs the weights)
    w8, w4 = (step_cost(windowed, [(1, n)] * 32, _hw()).predicted_seconds for n in (8192, 4096))
    assert w8 == pytest.approx(w4, rel=1e-3)
    assert step_cost(full, [(1, 8192)] * 32, _hw()).predicted_seconds > 1.3 * w4


def test_memory_planner_and_explain_cap_a_windowed_sequence():
    full, windowed, hybrid = _mistral(None), _mistral(4096), _mistral(4096, ("sliding", "full") * 16)
    plans = [plan_memory(c, 80 * 2**30, context_len=32768) for c in (full, windowed, hybrid)]
    assert plans[0].blocks_per_sequence == plans[2].blocks_per_sequence == 32768 // 16  # hybrid keeps all
    assert plans[1].blocks_per_sequence == 4096 // 16 + 1
    assert plans[1].max_concurrent_sequences > 7 * plans[0].max_concurrent_sequences
    per_tok = kv_cache_bytes_per_token(full, "bfloat16")
    ex = [explain(c, _hw(), prompt_len=30000, output_len=2768) for c in (full, windowed)]
    assert ex[0]["kv_cache_bytes_per_sequence"] == per_tok * 32768
    assert ex[1]["kv_cache_bytes_per_sequence"] == per_tok * 4096
