"""A simulated step's kv_bytes_used is what the engine's StepRecord reports: the used blocks' tokens times one
token's K and V on rank 0 (its tensor-parallel KV heads, pipeline stage 0's layers), not the whole model's."""

from types import SimpleNamespace

import pytest
import torch

from servescope.analysis.op_counts import kv_cache_bytes_per_token
from servescope.analysis.presets import load_preset
from servescope.config.engine import BatchingConfig, ParallelConfig
from servescope.engine.kv_sizing import kv_bytes_per_token
from servescope.engine.parallel_executor import ParallelExecutor
from servescope.parallel.layout import ParallelLayout
from servescope.sim.driver import drive
from servescope.sim.engine import SimEngine
from servescope.sim.spec import instance_spec
from servescope.sim.workload import SimRequest


def _engine_rank0_bytes(cfg, tp: int, pp: int) -> int:
    """The engine's rank 0: ParallelExecutor.shard_config (stage 0's layers, its heads) priced by kv_sizing."""
    layout = ParallelLayout(tp=tp, pp=pp, num_layers=cfg.num_hidden_layers)
    layers = len(layout.stage_layers(0))
    rank0 = SimpleNamespace(ctx=SimpleNamespace(layout=layout, stage=0),
                            model=SimpleNamespace(model=SimpleNamespace(layers=[None] * layers)))
    return kv_bytes_per_token(ParallelExecutor.shard_config(rank0, cfg), torch.bfloat16)


@pytest.mark.parametrize("preset, tp, pp", [("llama-3-70b", 8, 1), ("llama-3-70b", 4, 2), ("gemma-2-2b", 2, 3),
                                            ("gemma-3-1b", 1, 1)])
def test_the_simulators_bytes_per_token_are_the_engines_rank_0s(preset, tp, pp):
    spec = instance_spec(preset, "H100", dtype="bfloat16", parallel=ParallelConfig(tensor_parallel_size=tp,
                                                                                   pipeline_parallel_size=pp))
    cfg = load_preset(preset)
    assert spec.kv_bytes_per_token == _engine_rank0_bytes(cfg, tp, pp)
    if tp * pp > 1:
        assert spec.kv_bytes_per_token < kv_cache_bytes_per_token(cfg, "bfloat16")


def test_step_records_count_rank_0s_bytes():
    spec = instance_spec("llama-3-70b", "H100", dtype="bfloat16",
                         parallel=ParallelConfig(tensor_parallel_size=4, pipeline_parallel_size=2),
                         batching=BatchingConfig(max_num_seqs=4, max_num_batched_tokens=512))
    engine = SimEngine(spec)
    drive(engine, [SimRequest(0.01 * i, tuple(range(1 + i, 300 + i)), 20) for i in range(4)])
    per_token = _engine_rank0_bytes(load_preset("llama-3-70b"), 4, 2)
    assert engine.steps and all(r.kv_bytes_used == r.kv_blocks_used * spec.block_size * per_token
                                for r in engine.steps)
    assert max(r.kv_bytes_used for r in engine.steps) > 0
