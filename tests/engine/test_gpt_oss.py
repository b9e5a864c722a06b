"""gpt-oss equals transformers: a tiny random checkpoint written by transformers itself with every gpt-oss part
switched on at once: learned attention sinks, biases on q/k/v and o_proj, a window of 16 on every other layer,
yarn rope (factor 8 over 64 positions), and experts in every layer with gpt-oss's router (a bias, the top k
logits softmaxed over those k), biases on gate|up and down, the clamped SwiGLU (its limit lowered to 0.5 so that
the tiny model's activations reach it), the checkpoint's interleaved, transposed expert tensors.

float32 logits within 1e-4 through chunked prefill (chunks crossing window edges) and decode steps, greedy tokens
as transformers' generate, and the same greedy tokens batched, chunked, with prefix caching and under preemption
as one at a time. Each gpt-oss field is shown to matter (the same weights with it changed are far from
transformers), and so are the sinks and the biases; what is not built is refused naming it."""

import os
import sys

import pytest
import torch

from helpers import (BATCHING_OVERRIDES, assert_batching_changes_nothing, assert_bfloat16_near_float32_transformers,
                     assert_every_field_matters, assert_greedy_matches_transformers, assert_logits_match_transformers,
                     edited_checkpoint, paged_logits, random_ids)
from servescope import LLM
from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError, ModelLoadError
from servescope.bench.accuracy import compare
from servescope.model.linears.int8 import Int8Linear
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import moe_blocks
from servescope.model.moe_clamped import PackedClampedExperts
from servescope.model.transforms import _plan_covers_layer
from servescope.parallel.layout import check_parallel

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402

TOL = 1e-4
WINDOW = 16
# config.json edits that each change one gpt-oss part (each must move the logits far from transformers')
CHANGES = {"swiglu_limit": 7.0, "swiglu_alpha": 1.0, "num_experts_per_tok": 1, "attention_bias": False,
           "layer_types": ["full_attention"] * 2, "sliding_window": 4,
           "rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}}


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", sliding_window=WINDOW)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return path, hf


def test_layer_specs_follow_the_family(gpt_oss):
    path, _ = gpt_oss
    cfg = LLM(model=str(path), num_kv_blocks=64, max_model_len=512).engine.model_config
    specs = cfg.layer_specs()
    assert [s.attention.kind for s in specs] == ["sliding", "full"]
    assert [s.attention.window for s in specs] == [WINDOW, 0]
    assert all(s.attention.sinks and s.attention.bias and s.attention.out_bias for s in specs)
    e = specs[0].mlp.experts
    assert [s.mlp.kind for s in specs] == ["moe", "moe"] and e.router == "gpt_oss" and e.biased
    assert (e.num_experts, e.top_k, e.intermediate_size, e.swiglu_limit, e.swiglu_alpha) == (4, 2, 32, 0.5, 1.702)
    assert cfg.rope_scaling.rope_type == "yarn" and not cfg.rope_scaling.truncate


def test_config_round_trip(gpt_oss):
    path, hf = gpt_oss
    cfg = ModelConfig.from_hf_dict(hf.config.to_dict())
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    plain = ModelConfig.from_hf_dict({**hf.config.to_dict(), "sliding_window": None, "rope_parameters":
                                      {"rope_type": "default", "rope_theta": 1e4}})
    assert plain.sliding_window is None and plain.rope_scaling is None
    assert ModelConfig.from_hf_dict(plain.to_hf_dict()) == plain  # (not the family's defaults: window, yarn)


def test_transformers_defaults_are_the_familys():
    """A config.json that leaves gpt-oss's fields out means what transformers' GptOssConfig makes of it."""
    from transformers import GptOssConfig

    bare = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 16, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}
    ours = ModelConfig.from_hf_dict(bare)
    theirs = ModelConfig.from_hf_dict(GptOssConfig(**{k: v for k, v in bare.items() if k != "architectures"})
                                      .to_dict())
    assert ours == theirs
    assert (ours.head_dim, ours.sliding_window, ours.rope_theta, ours.rms_norm_eps) == (64, 128, 150000.0, 1e-5)
    assert ours.layer_types == ("sliding", "full") * 2 and ours.rope_scaling.factor == 32.0
    assert (ours.moe.experts.num_experts, ours.moe.experts.top_k, ours.moe.experts.swiglu_limit) == (128, 4, 7.0)


# openai/gpt-oss-120b's config.json (its layer_types: 18 x [sliding, full]) less its MXFP4 quantization_config
RELEASED = {
    "architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0, "eos_token_id": 200002,
    "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
    "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18, "max_position_embeddings": 131072,
    "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 36,
    "num_key_value_heads": 8, "num_local_experts": 128, "output_router_logits": False, "pad_token_id": 199999,
    "rms_norm_eps": 1e-05, "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                            "original_max_position_embeddings": 4096, "rope_type": "yarn",
                                            "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "transformers_version": "4.55.0.dev0", "use_cache": True, "vocab_size": 201088}


def test_the_released_config_is_read_as_transformers_reads_it():
    from transformers import GptOssConfig

    ours = ModelConfig.from_hf_dict(RELEASED)
    theirs = ModelConfig.from_hf_dict(GptOssConfig.from_dict(RELEASED).to_dict())
    assert ours == theirs
    assert ours.num_parameters() == pytest.approx(116.8e9, rel=0.01)  # gpt-oss-120b's published count
    for key, value in (("experts_per_token", 2), ("initial_context_length", 8192)):  # they must agree
        with pytest.raises(InvalidParameterError, match=key):
            ModelConfig.from_hf_dict({**RELEASED, key: value})
    released = ModelConfig.from_hf_dict({**RELEASED, "quantization_config": {"quant_method": "mxfp4"}})
    assert released.moe.experts.weight_format == "mxfp4" and ours.moe.experts.weight_format == ""  # (the cost
    assert released.num_parameters() == ours.num_parameters()  # model's; loader/hf_mxfp4.py keeps them packed)
    with pytest.raises(InvalidParameterError, match="quantization_config.*awq"):
        ModelConfig.from_hf_dict({**RELEASED, "quantization_config": {"quant_method": "awq"}})


@pytest.mark.parametrize("chunk", [24, 7])
def test_logits_match_transformers(gpt_oss, chunk):
    path, hf = gpt_oss
    assert_logits_match_transformers(path, hf, chunk, TOL)


def test_every_gpt_oss_field_matters(gpt_oss):
    path, hf = gpt_oss
    assert_every_field_matters(path, hf, CHANGES, TOL)


@pytest.mark.parametrize("part", ["self_attn.sinks", "mlp.gate.bias", "mlp.experts.gate_up_proj_bias",
                                  "mlp.experts.down_proj_bias"])
def test_sinks_and_biases_matter(gpt_oss, part):
    """The sinks, the router's bias and the experts' biases set aside (sinks at -1e9: a weight of 0) move the
    logits far from transformers'."""
    path, hf = gpt_oss
    ids = random_ids(60, 2)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    with torch.no_grad():
        for layer in llm.engine.executor.model.model.layers:
            layer.get_parameter(part).fill_(-1e9 if part.endswith("sinks") else 0.0)
    diff = (paged_logits(llm.engine, ids, chunk=24, decode_from=50) - ref).abs().max().item()
    assert diff > 100 * TOL, (part, diff)


def test_greedy_matches_transformers_generate(gpt_oss):
    path, hf = gpt_oss
    assert_greedy_matches_transformers(path, hf, 40)


@pytest.mark.parametrize("overrides", **BATCHING_OVERRIDES)
def test_batching_chunking_prefix_cache_preemption_change_nothing(gpt_oss, overrides):
    assert_batching_changes_nothing(gpt_oss[0], overrides, 8)


def test_bfloat16_stays_near_float32_transformers(gpt_oss):
    assert_bfloat16_near_float32_transformers(*gpt_oss)


@pytest.mark.parametrize("mode,module,floor", [("int4", QuantLinear, 0.1), ("int8", Int8Linear, 0.01)])
def test_quantization_packs_the_experts_with_their_biases(gpt_oss, mode, module, floor):
    """--quantization packs gpt-oss's experts (PackedClampedExperts: the biases and the clamped SwiGLU kept),
    within the mode's KL floor of float32."""
    path, _ = gpt_oss
    ids = random_ids(60, 2)
    ref = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512, quantization=mode)
    blocks = moe_blocks(llm.engine.executor.model)
    assert all(isinstance(b.experts, PackedClampedExperts) for _, b in blocks)
    assert all(isinstance(m, module) for _, b in blocks for m in b.experts.linears())
    r = compare(paged_logits(ref.engine, ids), paged_logits(llm.engine, ids), ids)
    assert r["kl"] / r["tokens"] <= floor, f"{mode}: mean KL {r['kl'] / r['tokens']:.4f}"


def test_what_is_not_built_is_refused(gpt_oss):
    path, _ = gpt_oss
    with pytest.raises((ModelLoadError, InvalidParameterError), match="swiglu_beta"):  # an unknown field
        LLM(model=str(edited_checkpoint(path, "swiglu_beta", 1.0)), num_kv_blocks=8, max_model_len=128)
    mxfp4 = edited_checkpoint(path, "quantization_config", {"quant_method": "mxfp4",
                                                            "modules_to_not_convert": ["model.layers.*.self_attn"]})
    with pytest.raises(ModelLoadError, match="mxfp4 but the files hold no MXFP4 expert tensors"):
        LLM(model=str(mxfp4), num_kv_blocks=8, max_model_len=128)
    cfg = LLM(model=str(path), num_kv_blocks=8, max_model_len=128).engine.model_config
    assert check_parallel(cfg, 2, 1, 2, "cpu").tp == 2  # TP inside each expert (tests/parallel: its parity)
    # the C++ decode plan covers every layer (tests/model/test_decode_plan_moe.py: bit for bit with the modules)
    assert all(_plan_covers_layer(s) for s in cfg.layer_specs())
