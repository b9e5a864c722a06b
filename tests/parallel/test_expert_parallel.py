"""Expert parallelism on two gloo processes, one thread each: the routed experts split over the ranks, tokens
sent to them and back by all-to-all. With the attention replicated (EP=2) and sharded (TP=2 + EP), greedy tokens
equal one process's and logits within 1e-4 at every step, with batching, chunked prefill, prefix caching and
preemption in the workload; each step records the rows each rank's experts ran and the all-to-alls."""

import argparse

import pytest

from helpers_parallel import assert_same_as_single_process
from servescope import LLM
from servescope.analysis.presets import load_preset
from servescope.cli.args import add_engine_args, engine_config_from_args
from servescope.config import EngineConfig
from servescope.errors import EngineConfigError
from servescope.parallel.expert_parallel import expert_range, token_slice
from servescope.parallel.layout import check_parallel
from tiny_models import make_tiny_hf_model, make_tiny_mxfp4_gpt_oss

CASES = {
    # attention replicated on both ranks: a gated shared expert and a dense first layer (Qwen2-MoE), DeepSeek-V3's
    # grouped sigmoid router with an ungated shared expert over latent attention, gpt-oss's biased experts
    "qwen2_moe-ep2": ("qwen2_moe", dict(expert_parallel_size=2)),
    "deepseek_v3-ep2": ("deepseek_v3", dict(expert_parallel_size=2)),
    "gpt_oss-ep2": ("gpt_oss", dict(expert_parallel_size=2)),
    # attention sharded by heads, the experts over the same two ranks (vLLM's enable_expert_parallel)
    "qwen3_moe-tp2-ep2": ("qwen3_moe", dict(tensor_parallel_size=2, expert_parallel_size=2)),
    "mixtral-tp2-ep2": ("mixtral", dict(tensor_parallel_size=2, expert_parallel_size=2)),
    "deepseek_v2-tp2-ep2": ("deepseek_v2", dict(tensor_parallel_size=2, expert_parallel_size=2)),  # latent heads
    # each rank packs its own experts (int8 per channel: per expert, so the same numbers as one process's)
    "olmoe-ep2-int8": ("olmoe", dict(expert_parallel_size=2), dict(quantization="int8")),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_one_process(tmp_path, case):
    family, parallel, *common = CASES[case]
    path = str(make_tiny_hf_model(tmp_path, family))
    recs = assert_same_as_single_process(path, *common, **parallel)
    for r in recs:  # every routed pair ran on exactly one rank; rank 0 sent some of its rows to rank 1
        assert len(r.moe_rows_per_rank) == 2 and sum(r.moe_rows_per_rank) == sum(r.moe_tokens_per_expert)
        assert r.moe_rank_imbalance >= 1.0 and 0 < r.all_to_all_seconds <= r.comm_seconds
        assert r.all_to_all_bytes <= r.comm_bytes
    assert any(r.all_to_all_bytes > 0 for r in recs)


def test_mxfp4_gpt_oss_expert_parallel_equals_one_process(tmp_path):
    """gpt-oss as released (MXFP4 experts, kept packed): each rank keeps its experts' blocks and biases."""
    path, _, _ = make_tiny_mxfp4_gpt_oss(tmp_path)
    recs = assert_same_as_single_process(str(path), expert_parallel_size=2)
    assert any(r.all_to_all_bytes > 0 for r in recs)


@pytest.mark.parametrize("qtype, parallel", [("Q4_0", {}), ("Q8_0", {}), ("Q4_0", dict(tensor_parallel_size=2))])
def test_packed_gguf_experts_under_expert_parallelism_equal_one_process(tmp_path, qtype, parallel):
    """A llama.cpp MoE file with its experts kept packed (--quantization gguf): each rank keeps its experts'
    blocks whole and runs them on the fused op, the same numbers as one process's; with TP = EP the attention
    and the shared expert's blocks are cut too (tests/parallel/test_parallel_parity.py says why their logits
    are held to 0.05 there). TP alone would cut inside each expert's blocks: refused, pointing to EP."""
    import gguf
    from tiny_gguf import write_tiny_moe_gguf

    from servescope.loader.source import load_model_source

    hf = make_tiny_hf_model(tmp_path, "qwen2_moe", with_tokenizer=False,
                            shared_expert_intermediate_size=64)
    path = write_tiny_moe_gguf(tmp_path / "m.gguf", load_model_source(str(hf)),
                               qtype=gguf.GGMLQuantizationType[qtype])
    common = dict(quantization="gguf", skip_tokenizer_init=True)
    recs = assert_same_as_single_process(path, common, logit_tol=0.05 if parallel else 1e-4, expert_parallel_size=2,
                                        **parallel)
    assert any(r.all_to_all_bytes > 0 for r in recs)
    if parallel:
        with pytest.raises(EngineConfigError, match="tensor parallelism shards float experts, not PackedExperts"):
            LLM(model=path, **common, tensor_parallel_size=2, num_threads=1, num_kv_blocks=8)


@pytest.mark.parametrize("parallel", [dict(pipeline_parallel_size=2),
                                      dict(pipeline_parallel_size=2, expert_parallel_size=2)])
def test_a_mixture_of_experts_on_a_pipeline_equals_one_process(tmp_path, monkeypatch, parallel):
    """Stages of a mixture of experts (with expert parallelism inside each stage: four processes, let run on
    this machine's cores): the same numbers as one process, and each step's record holds every stage's routing
    (each token routed to k experts in every sparse layer, whichever stage holds it) and every rank's rows."""
    import os

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    path = str(make_tiny_hf_model(tmp_path, "qwen2_moe", num_hidden_layers=4, mlp_only_layers=[0]))
    recs = assert_same_as_single_process(path, **parallel)
    sparse, k = 3, 2  # layers 1-3 (layer 0 dense, on stage 0 with layer 1; stage 1 holds layers 2-3)
    for r in recs:
        assert len(r.moe_experts_active) == sparse and sum(r.moe_tokens_per_expert) == r.num_tokens * k * sparse
        if parallel.get("expert_parallel_size"):
            assert len(r.moe_rows_per_rank) == 4 and sum(r.moe_rows_per_rank) == r.num_tokens * k * sparse
        else:
            assert r.moe_rows_per_rank == []


def test_token_slices_and_expert_ranges_cover_everything_once():
    for t in (1, 2, 5, 32):
        slices = [token_slice(t, 2, r) for r in range(2)]
        assert slices[0][0] == 0 and slices[0][1] == slices[1][0] and slices[1][1] == t
    assert [token_slice(5, 4, r) for r in range(4)] == [(0, 2), (2, 4), (4, 5), (5, 5)]  # the last rank: none
    assert [list(expert_range(8, 4, r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


@pytest.mark.parametrize("preset, tp, ep, message", [
    ("mixtral-8x7b", 1, 3, "expert_parallel_size 3 does not divide the 8 experts"),
    ("mixtral-8x7b", 3, 1, "does not divide the"),
    ("llama-3-8b", 1, 2, "expert_parallel_size 2: the model has no experts to split"),
    ("mixtral-8x7b", 8, 8, "= 8 processes, but only 4 CPU cores are available"),
])
def test_bad_expert_layouts_are_refused_before_any_process(preset, tp, ep, message):
    with pytest.raises(EngineConfigError, match=message):
        check_parallel(load_preset(preset), tp, 1, 4, "CPU cores", ep)


@pytest.mark.parametrize("settings, message", [
    (dict(expert_parallel_size=2, tensor_parallel_size=4), "tensor_parallel_size must be 2 .* or 1"),
])
def test_expert_parallel_settings_that_cannot_run_are_refused(settings, message):
    with pytest.raises(EngineConfigError, match=message):
        EngineConfig(model="x", **settings)


@pytest.mark.parametrize("family", ["qwen2_moe", "gpt_oss"])
def test_tensor_parallel_inside_each_expert_equals_one_process(tmp_path, family):
    """TP without EP (vLLM's default for a MoE): every expert's width split over the ranks (gpt-oss's biases with
    it), the sparse block's routed and shared partial sums all-reduced once; no all-to-all."""
    path = str(make_tiny_hf_model(tmp_path, family))
    recs = assert_same_as_single_process(path, tensor_parallel_size=2)
    assert all(r.all_to_all_bytes == 0 and r.moe_rows_per_rank == [] for r in recs)
    sparse = {"qwen2_moe": 1, "gpt_oss": 2}[family]  # (Qwen2-MoE's first layer is dense)
    assert all(len(r.moe_experts_active) == sparse for r in recs)  # the routing, counted on rank 0


def test_packed_experts_are_not_sharded_inside(tmp_path):
    """Refused with a clear error, and nothing left behind: the process group is gone, so the next parallel
    engine starts (it failed with "initialize the default process group twice" before)."""
    import torch.distributed as dist

    path, _, _ = make_tiny_mxfp4_gpt_oss(tmp_path)
    with pytest.raises(Exception, match="tensor parallelism shards float experts, not PackedClampedExperts"):
        LLM(model=str(path), num_kv_blocks=8, max_model_len=64, tensor_parallel_size=2)
    assert not dist.is_initialized()


def test_cli_enable_expert_parallel_is_ep_equal_tp():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["-tp", "2", "--enable-expert-parallel"])).parallel \
        .expert_parallel_size == 2
    assert engine_config_from_args(parser.parse_args(["-ep", "2"])).parallel.world_size == 2
    with pytest.raises(EngineConfigError, match="give -tp T > 1"):
        engine_config_from_args(parser.parse_args(["--enable-expert-parallel"]))
