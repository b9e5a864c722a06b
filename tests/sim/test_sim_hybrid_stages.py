"""The simulator's KV cache for a hybrid model (windowed and full layers) is the engine's: a table per group of
layers, its pools sized over the pipeline's stages as the engine's stages size them (analysis/kv_stages.py), so
the simulator admits and preempts where the engine does -- under pipeline parallelism too, where a stage cannot
lend its windowed layers' saved bytes to another stage's full layers and the full pool is smaller than one
process's."""

import pytest
import torch

from servescope.analysis.kv_stages import stage_layers
from servescope.config import EngineConfig, ModelConfig
from servescope.config.engine import BatchingConfig, KVCacheConfig, ParallelConfig
from servescope.engine.kv_sizing import kv_group_blocks, num_kv_blocks
from servescope.kvcache.hybrid import HybridKVCacheManager
from servescope.kvcache.manager import KVCacheManager
from servescope.sim.cluster import Deployment
from servescope.sim.driver import drive
from servescope.sim.engine import SimEngine
from servescope.sim.spec import instance_spec
from servescope.sim.workload import SimRequest

from tiny_models import make_tiny_hf_model, tiny_model_config

# tiny Gemma 2 (alternating) and Gemma 3 (two local to one global, five to one) shapes over 2 and 3 stages
CASES = [("gemma2", dict(num_hidden_layers=5), 2), ("gemma3", dict(num_hidden_layers=8, sliding_window_pattern=3), 3),
         ("gemma3", dict(num_hidden_layers=6, sliding_window_pattern=6), 2), ("gemma2", dict(num_hidden_layers=5), 1)]
BATCHING = dict(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=640)


def _spec(cfg: ModelConfig, pp: int, cache: KVCacheConfig):
    return instance_spec(cfg, "h100", kv_cache_dtype="float32", cache=cache, batching=BatchingConfig(**BATCHING),
                         parallel=ParallelConfig(pipeline_parallel_size=pp), link="none")


@pytest.mark.parametrize("family, shape, pp", CASES)
def test_the_simulators_pools_are_the_engines(family, shape, pp):
    cfg = tiny_model_config(family, sliding_window=64, **shape)
    engine_cfg = EngineConfig(num_kv_blocks=40, pipeline_parallel_size=pp, **BATCHING)
    spec = _spec(cfg, pp, KVCacheConfig(num_kv_blocks=40))
    pools = kv_group_blocks(engine_cfg, cfg, 40)
    assert spec.group_blocks == pools
    km = SimEngine(spec).kv_manager
    assert isinstance(km, HybridKVCacheManager)
    assert {g["window"]: g["num_blocks"] for g in km.group_stats()} == pools
    # a byte budget: the blocks sized from stage 0's layers, as the engine's rank 0 does
    budget = KVCacheConfig(kv_cache_memory_bytes=1 << 20)
    stage0 = cfg.layers_config(stage_layers(cfg.num_hidden_layers, pp)[0])
    assert _spec(cfg, pp, budget).num_blocks == num_kv_blocks(budget, BatchingConfig(**BATCHING), stage0,
                                                              torch.float32, torch.device("cpu"))
    one_table = _spec(cfg, pp, KVCacheConfig(num_kv_blocks=40, disable_hybrid_kv_cache_manager=True))
    assert one_table.group_blocks is None and type(SimEngine(one_table).kv_manager) is KVCacheManager


def test_the_simulator_preempts_where_the_pipeline_engine_does(tmp_path):
    """Gemma 2's five layers over two processes (three and two layers, one full layer each): the full pool is
    stage 1's 71 blocks, not one process's 86, so two sequences of 560 + 64 tokens no longer fit together. The
    engine at PP=2 and the simulator at PP=2 take the same steps (tokens, preemptions, blocks in use) and both
    preempt; the simulator at PP=1 does not."""
    from servescope import LLM, SamplingParams

    path = make_tiny_hf_model(tmp_path, "gemma2", sliding_window=16, num_hidden_layers=5,
                              max_position_embeddings=2048)
    prompts = [list(range(1000 + 1000 * i, 1560 + 1000 * i)) for i in range(3)]
    llm = LLM(model=str(path), num_kv_blocks=40, num_threads=1, pipeline_parallel_size=2, **BATCHING)
    try:
        cfg = llm.engine.model_config
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        real = [(r.num_prefill_tokens, r.num_decode_tokens, r.num_preemptions_total, r.kv_blocks_used)
                for r in llm.engine.step_records if r.num_tokens]
        pools = {g["window"]: g["num_blocks"] for g in llm.engine.kv_manager.group_stats()}
    finally:
        llm.engine.shutdown()
    reqs = [SimRequest(0.0, tuple(p), 64) for p in prompts]
    sims = {}
    for pp in (1, 2):
        dep = Deployment(_spec(cfg, pp, KVCacheConfig(num_kv_blocks=40)))
        drive(dep, reqs)
        engine = dep.engines[0]
        sims[pp] = ([(r.num_prefill_tokens, r.num_decode_tokens, r.num_preemptions_total, r.kv_blocks_used)
                     for r in engine.steps if r.num_tokens], engine.kv_manager)
    assert pools == {0: 71, 16: 9} and sims[2][1].num_blocks == 71 and sims[1][1].num_blocks == 86
    assert sims[2][0] == real and real[-1][2] > 0
    assert sims[1][0][-1][2] == 0  # one process's full pool holds both sequences
