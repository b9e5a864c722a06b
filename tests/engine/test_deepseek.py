"""DeepSeek-V2 and V3 equal transformers: tiny random checkpoints written by transformers itself with multi-head
latent attention in every layer (V2: the query one projection; V3: the query's low-rank pair with its norm,
yarn rope with both mscales) and DeepSeek's experts after a dense first layer (V2: softmax scores, grouped
greedy top-k, routed scaling, two shared experts; V3: sigmoid scores with a correction bias, groups scored by
their best two, renormalised and scaled).

float32 logits within 1e-4 through chunked prefill (expanded latents) and decode steps (absorbed matmuls),
greedy tokens as transformers' generate, and the same greedy tokens batched, chunked, with prefix caching and
under preemption as one at a time. The KV cache holds (kv_lora_rank + qk_rope_head_dim) values per token and
layer. Each DeepSeek field is shown to matter: the same weights with it changed are far from transformers."""

import os
import sys

import pytest
import torch

from helpers import (BATCHING_OVERRIDES, assert_batching_changes_nothing, assert_bfloat16_near_float32_transformers,
                     assert_every_field_matters, assert_greedy_matches_transformers, assert_logits_match_transformers,
                     edited_checkpoint, paged_logits, random_ids)
from servescope import LLM
from servescope.errors import EngineConfigError, InvalidParameterError, ModelLoadError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import FAMILIES, make_tiny_hf_model  # noqa: E402

TOL = 1e-4
LATENT = 32 + 16  # kv_lora_rank + qk_rope_head_dim of the tiny models (tiny_models.FAMILIES)
# config.json edits that each change one DeepSeek part (each must move the logits far from transformers')
CHANGES = {"deepseek_v2": {"routed_scaling_factor": 1.0, "topk_method": "greedy"},
           "deepseek_v3": {"rope_interleave": False, "routed_scaling_factor": 1.0, "topk_group": 4,
                           "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}}


@pytest.fixture(scope="module", params=sorted(CHANGES))
def deepseek(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = make_tiny_hf_model(tmp_path_factory.mktemp(family), family)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return family, path, hf


def test_layer_specs_follow_the_family(deepseek):
    family, path, _ = deepseek
    cfg = LLM(model=str(path), num_kv_blocks=64, max_model_len=512).engine.model_config
    specs = cfg.layer_specs()
    assert [s.attention.kind for s in specs] == ["latent", "latent"]
    assert [s.mlp.kind for s in specs] == ["dense", "moe"]  # first_k_dense_replace = 1
    m, e = specs[0].attention.latent, specs[1].mlp.experts
    assert (m.kv_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim) == (32, 16, 16, 24)
    assert m.q_lora_rank == (48 if family == "deepseek_v3" else 0)
    assert e.router == family and not e.shared_gated
    assert (e.n_group, e.topk_group) == ((4, 2) if family == "deepseek_v3" else (2, 1))
    if family == "deepseek_v3":  # yarn's mscale_all_dim scales the softmax: (n + R) ** -0.5 * mscale ** 2
        mscale = 0.1 * 0.707 * torch.log(torch.tensor(4.0)).item() + 1.0
        assert m.scale == pytest.approx(32 ** -0.5 * mscale ** 2)
        assert cfg.rope_scaling.rope_type == "yarn"


@pytest.mark.parametrize("chunk", [24, 7])
def test_logits_match_transformers(deepseek, chunk):
    _, path, hf = deepseek
    assert_logits_match_transformers(path, hf, chunk, TOL)


def test_every_deepseek_field_matters(deepseek):
    family, path, hf = deepseek
    assert_every_field_matters(path, hf, CHANGES[family], TOL)


def test_the_cache_holds_the_latent_only(deepseek):
    """KV bytes per token = (kv_lora_rank + qk_rope_head_dim) x layers x dtype size (the issue's floor), in the
    engine's count and in the tensors it allocated; the value cache is empty."""
    _, path, _ = deepseek
    for dtype, size in (("float32", 4), ("bfloat16", 2)):
        engine = LLM(model=str(path), num_kv_blocks=8, max_model_len=128, dtype=dtype).engine
        assert engine.kv_bytes_per_token == LATENT * 2 * size
        assert engine.runner.kv_bytes_per_token == LATENT * 2 * size  # counted from the allocated tensors
        k, v = engine.runner.kv_caches[0]
        assert tuple(k.shape) == (8, engine.cache_config.block_size, 1, LATENT) and v.numel() == 0


def test_greedy_matches_transformers_generate(deepseek):
    _, path, hf = deepseek
    assert_greedy_matches_transformers(path, hf, 40)


@pytest.mark.parametrize("overrides", **BATCHING_OVERRIDES)
def test_batching_chunking_prefix_cache_preemption_change_nothing(deepseek, overrides):
    if deepseek[0] != "deepseek_v3":  # V2's latent attention is V3's (the suite's time): V3 has every part
        pytest.skip("the batching checks run on DeepSeek-V3")
    assert_batching_changes_nothing(deepseek[1], overrides, 8)


def test_bfloat16_stays_near_float32_transformers(deepseek):
    # (measured: one position of 120 at 0.54, the median 0.015)
    assert_bfloat16_near_float32_transformers(deepseek[1], deepseek[2])


def test_what_is_not_built_is_refused(deepseek):
    family, path, _ = deepseek
    with pytest.raises(EngineConfigError, match="latent attention"):
        LLM(model=str(path), num_kv_blocks=8, max_model_len=128, kv_cache_dtype="int8")
    bad = edited_checkpoint(path, "topk_method", "no_such_method") if family == "deepseek_v2" else \
        edited_checkpoint(path, "scoring_func", "softmax")
    with pytest.raises((ModelLoadError, InvalidParameterError), match="topk_method|scoring_func"):
        LLM(model=str(bad), num_kv_blocks=8, max_model_len=128)


def test_all_dense_deepseek_runs_without_experts(tmp_path):
    """first_k_dense_replace >= layers: no experts at all (and the C++ decode plan leaves latent layers to
    the modules): still transformers' logits."""
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path, "deepseek_v2", first_k_dense_replace=2)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    assert llm.engine.model_config.moe is None
    ids = random_ids(40, 5)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (paged_logits(llm.engine, ids, chunk=16, decode_from=30) - ref).abs().max().item() <= TOL
    assert "deepseek_v2" in FAMILIES
