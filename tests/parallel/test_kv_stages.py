"""Pipeline stages' KV pools (analysis/kv_stages.py) as the memory planner and `explain --pp` report them, against
what the engine's stages allocate: each stage's runner built by the engine's own code (ModelRunner over the stage's
layers, the pools of engine/kv_sizing.kv_group_blocks, the blocks of engine/kv_sizing.num_kv_blocks sized from
stage 0's layers as rank 0 does). Tiny random Gemma 2 (alternating) and Gemma 3 (two local to one global) shapes
whose stages hold different mixes of kinds, at PP = 2 and 3 (uneven splits)."""

import pytest
import torch

from servescope.analysis.hardware import get_hardware
from servescope.analysis.kv_layout import layers_per_window
from servescope.analysis.kv_stages import binding_stage, stage_layers
from servescope.analysis.memory_planner import plan_memory
from servescope.analysis.parallel_explain import explain_parallel
from servescope.analysis.collectives import LINKS
from servescope.config import EngineConfig, ModelConfig
from tiny_models import tiny_model_config
from servescope.engine.kv_sizing import kv_group_blocks, num_kv_blocks
from servescope.engine.model_runner import ModelRunner

S = 16


def gemma2(layers: int):  # sliding, full, sliding, ...
    return tiny_model_config("gemma2", num_hidden_layers=layers, sliding_window=64, max_position_embeddings=4096)


def gemma3(layers: int, pattern: int = 3):  # pattern - 1 local layers, then a global one
    return tiny_model_config("gemma3", num_hidden_layers=layers, sliding_window_pattern=pattern, sliding_window=64,
                             max_position_embeddings=4096)


CASES = [
    ("gemma2", gemma2(5), 2),  # stages of 3 and 2 layers: stage 1 (one full of two) binds, not stage 0
    ("gemma2", gemma2(4), 2),  # even: both kinds on each stage
    ("gemma3", gemma3(8), 3),  # 3 / 3 / 2 layers: the last stage holds no global layer
    ("gemma3", gemma3(6, pattern=6), 2),  # five local to one global: stage 0 is all local
]
MEMORY = 64 << 20  # bytes per rank, a little KV for a tiny model


def _engine_stages(cfg: ModelConfig, pp: int, budget: int, max_num_seqs: int, chunk: int):
    """(blocks, pools, per stage the runner the engine builds for its layers), by the engine's code."""
    config = EngineConfig(kv_cache_memory_bytes=budget, pipeline_parallel_size=pp, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=chunk, max_model_len=cfg.max_position_embeddings)
    ranges = stage_layers(cfg.num_hidden_layers, pp)
    # rank 0 sizes the blocks from its own (stage 0's) layers and sends them to every rank
    blocks = num_kv_blocks(config.cache, config.batching, cfg.layers_config(ranges[0]), torch.float32,
                           torch.device("cpu"))
    pools = kv_group_blocks(config, cfg, blocks)
    runners = [ModelRunner(None, cfg.layers_config(r), None, blocks, S, torch.float32, torch.device("cpu"),
                           group_blocks=pools) for r in ranges]
    return blocks, pools, runners


@pytest.mark.parametrize("name, cfg, pp", CASES, ids=[f"{n}-L{c.num_hidden_layers}-pp{p}" for n, c, p in CASES])
def test_the_planners_stage_pools_are_what_the_engines_stages_allocate(name, cfg, pp):
    seqs, chunk = 4, 64
    plan = plan_memory(cfg, MEMORY, "float32", "float32", context_len=1024, block_size=S, max_num_seqs=seqs,
                       max_num_batched_tokens=chunk, pp=pp)
    blocks, pools, runners = _engine_stages(cfg, pp, plan.free_for_kv_bytes, seqs, chunk)
    assert plan.num_kv_blocks == blocks and plan.group_pool_blocks == pools and len(pools) == 2
    assert len(plan.stages) == pp
    for st, runner, r in zip(plan.stages, runners, stage_layers(cfg.num_hidden_layers, pp)):
        assert (st.first_layer, st.num_layers) == (r.start, len(r))
        assert st.group_layers == layers_per_window(cfg.layers_config(r))
        assert st.kv_bytes == runner.kv_cache_bytes  # what the stage's process allocates
        assert st.kv_bytes_per_token == runner.kv_bytes_per_token
        assert st.kv_bytes <= st.budget_bytes  # no stage holds more than num_blocks blocks of each of its layers
        # each of its layers' caches is its group's pool
        assert [k.shape[0] for k, _ in runner.kv_caches] == [st.pool_blocks[w] for w in runner.layer_windows]
    # the full pool is the least any stage leaves for it: one more block would overfill the binding stage alone
    b = plan.stages[plan.binding_stage]
    assert b.first_group_limit == pools[0] == min(s.first_group_limit for s in plan.stages
                                                   if s.first_group_limit is not None)
    row = b.bytes_per_token[0] * S  # one block of the stage's full layers
    assert b.kv_bytes + row > b.budget_bytes
    assert plan.binding_stage == binding_stage(plan.stages)


def test_the_binding_stage_is_not_always_stage_0():
    """Gemma 2's five layers over two stages: stage 0 holds three (one full), stage 1 two (one full): stage 1's
    budget is the smaller and its full layer takes the larger share of it, so stage 1 sets the full pool."""
    plan = plan_memory(gemma2(5), MEMORY, "float32", "float32", context_len=1024, block_size=S, max_num_seqs=4,
                       max_num_batched_tokens=64, pp=2)
    assert plan.binding_stage == 1
    assert plan.stages[1].first_group_limit < plan.stages[0].first_group_limit


def test_with_one_table_every_stage_holds_num_blocks_in_every_layer():
    cfg, pp = gemma3(8), 3
    plan = plan_memory(cfg, MEMORY, "float32", "float32", context_len=1024, block_size=S, pp=pp, group_tables=False)
    assert plan.group_pool_blocks == {} and plan.binding_stage == 0  # the largest stage sized the blocks
    per_layer = plan.kv_bytes_per_token // plan.stages[0].num_layers
    for st in plan.stages:
        assert set(st.pool_blocks.values()) == {plan.num_kv_blocks}
        assert st.kv_bytes == plan.num_kv_blocks * S * per_layer * st.num_layers == st.budget_bytes


def test_sequences_per_group_tables_are_the_binding_stages():
    """Per group tables, the sequences of a context that fit: each stage's share of the bytes over what its own
    layers need per sequence (a full layer the context, a windowed one its window); the stage that holds fewest
    binds -- here the one with the global layer, as its stage cannot lend it the local stage's saved bytes."""
    cfg, ctx = gemma3(6, pattern=6), 2048
    plan = plan_memory(cfg, MEMORY, "float32", "float32", context_len=ctx, block_size=S, pp=2)
    per_layer = plan.kv_bytes_per_token // plan.stages[0].num_layers
    window = (64 // S + 1) * S  # a windowed layer's blocks per sequence
    local_only = plan.free_for_kv_bytes // (3 * window * per_layer)
    with_global = plan.free_for_kv_bytes // ((ctx + 2 * window) * per_layer)
    assert plan.max_concurrent_sequences_per_group_tables == min(local_only, with_global) == with_global


def test_explain_pp_reports_each_stages_pool():
    from rich.console import Console

    from servescope.cli.lab import kv_stage_table

    cfg = gemma3(8)
    hw = get_hardware("h100")
    r = explain_parallel(cfg, hw, LINKS["nvlink4"], 1, 3, batch=4, prompt_len=512, output_len=64)
    plan = plan_memory(cfg, hw.memory_bytes, "bfloat16", "bfloat16", context_len=576, act_dtype="bfloat16",
                       max_num_batched_tokens=2048, max_num_seqs=4, pp=3)
    assert r["kv_stages"] == plan.to_dict()["stages"] and r["kv_binding_stage"] == plan.binding_stage
    assert r["kv_cache_bytes_per_token_per_rank"] == plan.stages[0].kv_bytes_per_token
    assert [s["group_layers"] for s in r["kv_stages"]] == [{0: 1, 64: 2}, {0: 1, 64: 2}, {64: 2}]
    console = Console(record=True, width=250)
    console.print(kv_stage_table(r))
    text = console.export_text()
    assert f"stage {plan.binding_stage} runs out first" in text and "(binds)" in text
    assert f"{plan.group_pool_blocks[64]} blocks" in text and "window 64: 2" in text


def test_bad_stage_counts_are_refused():
    from servescope.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError, match="pipeline stages"):
        plan_memory(gemma2(4), MEMORY, pp=5)
    with pytest.raises(InvalidParameterError, match="pipeline stages"):
        plan_memory(gemma2(4), MEMORY, pp=0)


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("pp", [2, 3])
def test_each_stages_weight_bytes_are_what_keep_stage_leaves_its_rank(tied, pp):
    # the model each rank keeps (parallel/pipeline.keep_stage), its distinct tensors' bytes, against the planner's
    from servescope.analysis.kv_stages import stage_weight_bytes
    from servescope.model.decoder import CausalLM
    from servescope.parallel.groups import DistContext
    from servescope.parallel.layout import ParallelLayout
    from servescope.parallel.pipeline import keep_stage

    cfg = tiny_model_config("llama", num_hidden_layers=5, tie_word_embeddings=tied)
    whole = sum(p.numel() * 4 for p in CausalLM(cfg).parameters())
    assert stage_weight_bytes(cfg, "float32", "float32", 1, 0) == whole
    layout = ParallelLayout(tp=1, pp=pp, num_layers=cfg.num_hidden_layers)
    held = []
    for stage in range(pp):
        model = keep_stage(CausalLM(cfg), DistContext(layout, rank=layout.rank_of(stage, 0)))
        tensors = {id(t): t for t in list(model.parameters()) + ([model.lm_head.weight] if model.lm_head else [])}
        held.append(sum(t.numel() * 4 for t in tensors.values()))
        assert stage_weight_bytes(cfg, "float32", "float32", pp, stage) == held[-1], stage
    table = cfg.vocab_size * cfg.hidden_size * 4
    # every piece once, but a tied table on both end stages (the first embeds with it, the last reads it as its
    # head) and the final norm's vector on every stage
    assert sum(held) == whole + (table if tied else 0) + (pp - 1) * cfg.hidden_size * 4
    plan = plan_memory(cfg, MEMORY, "float32", "float32", context_len=256, block_size=S, pp=pp)
    assert plan.weight_bytes == held[0]
