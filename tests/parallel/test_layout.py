"""Layouts and shards without processes: which layers each stage holds, which heads and vocabulary
rows each shard holds, the bytes a shard keeps, and bad combinations rejected before any process
starts."""

import multiprocessing
import os

import pytest
import torch

from servescope import LLM
from servescope.config import ModelConfig
from servescope.engine.kv_sizing import kv_bytes_per_token, num_kv_blocks
from servescope.engine.parallel_executor import ParallelExecutor
from servescope.errors import EngineConfigError
from servescope.loader.random_init import build_random_model
from servescope.parallel.groups import DistContext
from servescope.parallel.layout import ParallelLayout, check_parallel
from servescope.parallel.tensor_parallel import _kv_first_head, apply_tensor_parallel, vocab_shard
from servescope.config import BatchingConfig, KVCacheConfig
from tiny_models import make_tiny_hf_model


def _cfg(**kw):
    base = dict(architecture="llama", vocab_size=1001, hidden_size=64, intermediate_size=128, num_hidden_layers=5,
                num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    return ModelConfig(**{**base, **kw})


def test_stage_layers_cover_every_layer_once_first_stages_heavier():
    lay = ParallelLayout(tp=2, pp=3, num_layers=8)
    stages = [list(lay.stage_layers(s)) for s in range(3)]
    assert stages == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert [lay.rank_of(lay.stage_of(r), lay.shard_of(r)) for r in range(6)] == list(range(6))
    assert lay.tp_group_ranks(1) == [2, 3]


def test_kv_heads_sharded_or_replicated_like_vllm():
    # Hkv >= T: each shard its own Hkv/T heads; Hkv < T: shards share (replicate) the head their queries read
    assert [_kv_first_head(8, 4, s) for s in range(4)] == [0, 2, 4, 6]
    assert [_kv_first_head(2, 4, s) for s in range(4)] == [0, 0, 1, 1]  # GQA, Hkv=2 < T=4
    assert [_kv_first_head(1, 2, s) for s in range(2)] == [0, 0]  # MQA
    # queries of shard s under GQA Hkv=2, H=8, T=4: heads 2s, 2s+1, group size 4 -> KV head s // 2
    assert all((2 * s) // 4 == _kv_first_head(2, 4, s) == (2 * s + 1) // 4 for s in range(4))


def test_vocab_shards_padded_to_equal_size():
    assert [vocab_shard(1001, 2, s) for s in range(2)] == [(0, 501, 501), (501, 501, 500)]
    assert sum(vocab_shard(1001, 4, s)[2] for s in range(4)) == 1001


@pytest.mark.parametrize("kw, tp, pp, message", [
    (dict(num_attention_heads=6, num_key_value_heads=2), 4, 1, "does not divide the 6 attention heads"),
    (dict(num_attention_heads=12, num_key_value_heads=6), 4, 1, "does not divide the 6 KV heads"),
    (dict(num_attention_heads=12, num_key_value_heads=2), 3, 1, "tensor_parallel_size to be a multiple of 2"),
    (dict(intermediate_size=130), 4, 1, "does not divide the MLP width 130"),
    (dict(), 1, 6, "pipeline_parallel_size 6 is more than the model's 5 layers"),
    (dict(), 4, 2, r"4 x pipeline_parallel_size 2 = 8 processes, but only 4 CPU cores are available"),
])
def test_bad_layouts_name_what_does_not_divide(kw, tp, pp, message):
    with pytest.raises(EngineConfigError, match=message):
        check_parallel(_cfg(**kw), tp, pp, num_devices=4, device_kind="CPU cores")


@pytest.mark.parametrize("settings, message", [
    (dict(tensor_parallel_size=3), "tensor_parallel_size 3 does not divide the 4 attention heads"),
    (dict(pipeline_parallel_size=3), "pipeline_parallel_size 3 is more than the model's 2 layers"),
    (dict(tensor_parallel_size=2, pipeline_parallel_size=2), "= 4 processes, but only 2 CPU cores"),
    (dict(pipeline_parallel_size=2, pipeline_micro_batches=-1), "pipeline_micro_batches must be 0 .auto."),
])
def test_engine_rejects_bad_combination_before_any_process(tmp_path, monkeypatch, settings, message):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    path = str(make_tiny_hf_model(tmp_path, "llama", with_tokenizer=False))
    before = set(multiprocessing.active_children())
    with pytest.raises(EngineConfigError, match=message):
        LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=8, **settings)
    assert set(multiprocessing.active_children()) == before


@pytest.mark.parametrize("num_kv_heads", [2, 1])
def test_a_shard_keeps_half_the_weights_and_kv(num_kv_heads):
    """Shard 0 of TP=2 (built in this process; no forward, so no group is needed): half of every
    projection and vocabulary row (+ the replicated norms), half the KV bytes per token (one KV head
    replicated: the same), and the same KV memory then holds twice (or as many) tokens."""
    cfg = _cfg(vocab_size=1000, num_key_value_heads=num_kv_heads)
    full = build_random_model(cfg, torch.float32, torch.device("cpu"), seed=0)
    full_bytes = sum(p.numel() * 4 for p in full.parameters())
    shard = apply_tensor_parallel(build_random_model(cfg, torch.float32, torch.device("cpu"), seed=0),
                                  DistContext(ParallelLayout(2, 1, cfg.num_hidden_layers), rank=0))
    norms = 4 * cfg.hidden_size * (2 * cfg.num_hidden_layers + 1)
    kv_rows = 4 * cfg.num_hidden_layers * 2 * cfg.head_dim * cfg.hidden_size  # k and v rows of one head
    replicated_kv = kv_rows if num_kv_heads == 1 else 0  # a replicated head is not halved
    shard_bytes = sum(p.numel() * 4 for p in shard.parameters())
    assert shard_bytes == (full_bytes - norms - replicated_kv) // 2 + norms + replicated_kv
    shard_cfg = ParallelExecutor(shard, torch.device("cpu"), DistContext(ParallelLayout(2, 1, 5), 0)).shard_config(cfg)
    per_token, shard_per_token = kv_bytes_per_token(cfg, torch.float32), kv_bytes_per_token(shard_cfg, torch.float32)
    assert shard_per_token * (2 if num_kv_heads == 2 else 1) == per_token
    cache, batching = KVCacheConfig(kv_cache_memory_bytes=1 << 20), BatchingConfig()
    ratio = num_kv_blocks(cache, batching, shard_cfg, torch.float32, torch.device("cpu")) / \
        num_kv_blocks(cache, batching, cfg, torch.float32, torch.device("cpu"))
    assert ratio == (2 if num_kv_heads == 2 else 1)


def test_ranks_on_the_cpu_share_the_cores_unless_threads_are_asked_for(monkeypatch):
    from servescope.config import EngineConfig
    from servescope.engine.weights import rank_threads

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    cfg = EngineConfig(model="m")
    assert rank_threads(cfg) is None  # one process: torch's default
    assert rank_threads(cfg.replace(tensor_parallel_size=2)) == 4
    assert rank_threads(cfg.replace(tensor_parallel_size=2, pipeline_parallel_size=2)) == 2
    assert rank_threads(cfg.replace(tensor_parallel_size=2, expert_parallel_size=2)) == 4  # EP runs over TP's ranks
    assert rank_threads(cfg.replace(tensor_parallel_size=2, num_threads=3)) == 3  # asked for: as asked
    assert rank_threads(cfg.replace(tensor_parallel_size=2, device="cuda")) is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")  # torchrun, one rank on this machine: all its cores
    assert rank_threads(cfg.replace(tensor_parallel_size=2)) == 8
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0}, raising=False)
    assert rank_threads(cfg.replace(tensor_parallel_size=2)) == 1  # never below one
