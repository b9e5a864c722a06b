"""The memory plan adds up, counts whole blocks, and agrees with max_context_for_concurrency."""

import math

import pytest

from servescope.analysis.cost_model import kv_cache_bytes_per_token, weight_bytes
from servescope.analysis.memory_planner import activation_bytes, max_context_for_concurrency, plan_memory
from servescope.analysis.presets import load_preset
from servescope.errors import InvalidParameterError

LLAMA3 = load_preset("llama-3-8b")
SMOL = load_preset("smollm2-135m")


def test_llama3_on_80gb_hand_computed():
    plan = plan_memory(LLAMA3, 80_000_000_000, "bfloat16", context_len=8192, block_size=16,
                       activation_reserve_bytes=0)
    free = 80_000_000_000 - 16_060_522_496
    assert plan.weight_bytes == 16_060_522_496
    assert plan.free_for_kv_bytes == free
    assert plan.kv_bytes_per_block == 16 * 131072
    assert plan.num_kv_blocks == free // (16 * 131072) == 30488
    assert plan.blocks_per_sequence == 512
    assert plan.kv_bytes_per_sequence == 8192 * 131072  # 1 GiB per 8k-token sequence
    assert plan.max_concurrent_sequences == 30488 // 512 == 59
    assert plan.fits


@pytest.mark.parametrize("cfg,mem,ctx,bs", [(LLAMA3, 24e9, 4000, 16), (SMOL, 2**31, 1000, 32), (SMOL, 2**30, 8192, 16)])
def test_plan_is_consistent(cfg, mem, ctx, bs):
    plan = plan_memory(cfg, int(mem), "bfloat16", context_len=ctx, block_size=bs, max_num_batched_tokens=512)
    assert plan.activation_bytes == activation_bytes(cfg, 512, "bfloat16")
    assert plan.blocks_per_sequence == math.ceil(ctx / bs)
    used = plan.weight_bytes + plan.activation_bytes + plan.num_kv_blocks * plan.kv_bytes_per_block
    assert used <= mem
    assert mem - used < plan.kv_bytes_per_block  # no whole block left unused
    assert plan.max_concurrent_sequences * plan.blocks_per_sequence <= plan.num_kv_blocks
    assert (plan.max_concurrent_sequences + 1) * plan.blocks_per_sequence > plan.num_kv_blocks
    assert plan.kv_cache_tokens == plan.num_kv_blocks * bs


def test_too_small_memory_does_not_fit():
    plan = plan_memory(LLAMA3, 10**9, "bfloat16", context_len=100)
    assert not plan.fits and plan.num_kv_blocks == 0 and plan.free_for_kv_bytes == 0


def test_int8_and_fp32_kv_change_the_budget():
    bf = plan_memory(LLAMA3, 40_000_000_000, "bfloat16", context_len=4096)
    q = plan_memory(LLAMA3, 40_000_000_000, "int8", context_len=4096)
    f32kv = plan_memory(LLAMA3, 40_000_000_000, "bfloat16", "float32", context_len=4096)
    assert q.weight_bytes == weight_bytes(LLAMA3, "int8") and q.max_concurrent_sequences > bf.max_concurrent_sequences
    assert f32kv.kv_bytes_per_token == kv_cache_bytes_per_token(LLAMA3, "float32")
    assert f32kv.max_concurrent_sequences < bf.max_concurrent_sequences


@pytest.mark.parametrize("concurrency", [1, 3, 16, 100])
def test_max_context_for_concurrency_is_tight(concurrency):
    mem, bs = 24_000_000_000, 16
    ctx = max_context_for_concurrency(LLAMA3, mem, concurrency, block_size=bs, cap_at_model_max=False)
    assert ctx % bs == 0 and ctx > 0
    assert plan_memory(LLAMA3, mem, context_len=ctx, block_size=bs).max_concurrent_sequences >= concurrency
    assert plan_memory(LLAMA3, mem, context_len=ctx + bs, block_size=bs).max_concurrent_sequences < concurrency
    capped = max_context_for_concurrency(LLAMA3, mem, concurrency, block_size=bs)
    assert capped == min(ctx, LLAMA3.max_position_embeddings)


def test_bad_arguments():
    with pytest.raises(InvalidParameterError):
        plan_memory(SMOL, 0)
    with pytest.raises(InvalidParameterError):
        plan_memory(SMOL, 10**9, memory_utilization=1.5)
    with pytest.raises(InvalidParameterError):
        max_context_for_concurrency(SMOL, 10**9, 0)
