"""Mixture-of-experts models equal transformers: tiny random Mixtral, Qwen2-MoE (shared expert, a dense first
layer), Qwen3-MoE (renormalised top-k, a dense last layer) and OLMoE (q/k norm over all heads): float32 logits
through chunked prefill and decode steps within 1e-4, greedy tokens equal to transformers' generate, and the
same greedy tokens batched, chunked, with prefix caching and under preemption as one at a time; each step
record counts the tokens routed to each expert."""

import os
import sys

import pytest
import torch

from helpers import (BATCHING_OVERRIDES, assert_batching_changes_nothing, assert_greedy_matches_transformers,
                     paged_logits)
from servescope import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import MOE_FAMILIES, make_tiny_hf_model  # noqa: E402

TOL = 1e-4
KINDS = {"mixtral": ["moe", "moe"], "qwen2_moe": ["dense", "moe"], "qwen3_moe": ["moe", "dense"],
         "olmoe": ["moe", "moe"]}


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def moe_model(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = make_tiny_hf_model(tmp_path_factory.mktemp(family), family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return family, path, hf


def test_layer_kinds_follow_the_family(moe_model):
    family, path, _ = moe_model
    llm = LLM(model=str(path), num_kv_blocks=16, max_model_len=128)
    assert [s.mlp.kind for s in llm.engine.model_config.layer_specs()] == KINDS[family]


@pytest.mark.parametrize("chunk", [None, 7])
def test_logits_match_transformers(moe_model, chunk):
    _, path, hf = moe_model
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    ids = torch.randint(3, 49152, (70,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    ours = paged_logits(llm.engine, ids, chunk=chunk, decode_from=50)
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.2e}"


def test_greedy_matches_transformers_generate(moe_model):
    _, path, hf = moe_model
    assert_greedy_matches_transformers(path, hf, 30)


@pytest.mark.parametrize("overrides", **BATCHING_OVERRIDES)
def test_batching_chunking_prefix_cache_preemption_change_nothing(moe_model, overrides):
    assert_batching_changes_nothing(moe_model[1], overrides, 10)


def test_step_records_carry_the_routing(moe_model):
    """Every token is routed to k experts in each sparse layer; a batch-1 decode step reads exactly k experts
    per sparse layer (max/mean tokens per expert E/k), and the cost model prices the experts it read."""
    family, path, _ = moe_model
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=256, hardware="A100-80GB")
    cfg = llm.engine.model_config
    e, sparse = cfg.moe.experts, cfg.moe.num_sparse(cfg.num_hidden_layers)
    one_expert = 3 * cfg.hidden_size * e.intermediate_size * 4  # float32
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 49152, (int(n),), generator=gen).tolist() for n in (9, 23, 4)]
    llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    recs = list(llm.engine.step_records)
    for rec in recs:
        assert sum(rec.moe_tokens_per_expert) == rec.num_tokens * e.top_k * sparse
        assert len(rec.moe_experts_active) == sparse
        assert all(e.top_k <= n <= min(e.num_experts, rec.num_tokens * e.top_k) for n in rec.moe_experts_active)
        assert rec.moe_expert_bytes == sum(rec.moe_experts_active) * one_expert
        assert rec.moe_expected_experts == pytest.approx(
            e.num_experts * (1 - (1 - e.top_k / e.num_experts) ** rec.num_tokens))
    single = [r for r in recs if r.phase == "decode" and r.num_decode_seqs == 1]
    assert single and all(r.moe_experts_active == [e.top_k] * sparse for r in single)
    assert all(r.moe_imbalance == pytest.approx(e.num_experts / e.top_k) for r in single)
    # the prediction follows the routing: more experts read, more MLP bytes predicted
    batched = max(recs, key=lambda r: sum(r.moe_experts_active))
    assert batched.bytes_by_group["mlp"] > single[0].bytes_by_group["mlp"]
