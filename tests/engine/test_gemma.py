"""Gemma 2 and Gemma 3 (text) equal transformers: tiny random checkpoints written by transformers itself, every
Gemma part switched on at once ((1 + w) norms, four per layer, scaled embeddings, GELU-tanh, query_pre_attn_scalar
unlike head_dim; Gemma 2: attention and final soft-caps, every other layer windowed; Gemma 3: q/k norms, local
layers with their own rotary base, a global one after them), windows of 16 under prompts of 120 tokens.

float32 logits within 1e-4 through chunked prefill (chunks crossing window edges) and decode steps, greedy tokens
as transformers' generate, and the same greedy tokens batched, chunked, with prefix caching and under preemption
as one at a time. Each field is shown to matter: the same weights with it dropped are far from transformers."""

import json
import os
import shutil
import sys

import pytest
import torch

from helpers import (BATCHING_OVERRIDES, assert_batching_changes_nothing, assert_every_field_matters,
                     assert_greedy_matches_transformers, assert_logits_match_transformers, edited_checkpoint,
                     paged_logits, random_ids)
from servescope import LLM
from servescope.errors import ModelLoadError

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402

TOL = 1e-4
WINDOW = 16
# Gemma 2: layers sliding, full; Gemma 3: sliding, sliding, full (a pattern of 3 instead of 6, so that a tiny
# model holds both kinds)
# soft-caps near the tiny model's score and logit sizes, so that capping changes them (Gemma 2's own 50 and 30
# barely touch scores of random weights of std 0.05)
MODELS = {"gemma2": dict(sliding_window=WINDOW, num_hidden_layers=2, attn_logit_softcapping=0.05,
                         final_logit_softcapping=2.0),
          "gemma3": dict(sliding_window=WINDOW, num_hidden_layers=3, sliding_window_pattern=3)}
KINDS = {"gemma2": ["sliding", "full"], "gemma3": ["sliding", "sliding", "full"]}
# config.json edits that drop one Gemma feature (each must move the logits far from transformers')
DROPS = {"gemma2": {"attn_logit_softcapping": None, "final_logit_softcapping": None, "query_pre_attn_scalar": 16,
                    "layer_types": ["full_attention"] * 2},
         "gemma3": {"query_pre_attn_scalar": 16, "layer_types": ["full_attention"] * 3,
                    "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                                        "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}}}}


@pytest.fixture(scope="module", params=sorted(MODELS))
def gemma(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    family = request.param
    path = make_tiny_hf_model(tmp_path_factory.mktemp(family), family, **MODELS[family])
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    return family, path, hf


def test_layer_specs_follow_the_family(gemma):
    family, path, _ = gemma
    specs = LLM(model=str(path), num_kv_blocks=64, max_model_len=512).engine.model_config.layer_specs()
    assert [s.attention.kind for s in specs] == KINDS[family]
    assert {s.norm for s in specs} == {"sandwich"} and {s.mlp.activation for s in specs} == {"gelu_pytorch_tanh"}
    assert {s.attention.softcap for s in specs} == ({0.05} if family == "gemma2" else {0.0})
    local = [s.attention.rope_theta for s in specs if s.attention.kind == "sliding"]
    assert set(local) == ({10000.0} if family == "gemma3" else {0.0})


@pytest.mark.parametrize("chunk", [24, 7])
def test_logits_match_transformers(gemma, chunk):
    _, path, hf = gemma
    assert_logits_match_transformers(path, hf, chunk, TOL)


def test_every_gemma_field_matters(gemma):
    """The same weights with one field dropped are far from transformers: each is really applied."""
    family, path, hf = gemma
    assert_every_field_matters(path, hf, DROPS[family], TOL)


def test_greedy_matches_transformers_generate(gemma):
    _, path, hf = gemma
    assert_greedy_matches_transformers(path, hf, 40)


@pytest.mark.parametrize("overrides", **BATCHING_OVERRIDES)
def test_batching_chunking_prefix_cache_preemption_change_nothing(gemma, overrides):
    assert_batching_changes_nothing(gemma[1], overrides, 8)


def test_bfloat16_stays_near_float32_transformers(gemma):
    """bfloat16 (Gemma 3's windowed layers through the C++ paged kernels, Gemma 2's soft-capped ones through
    the reference attention) stays near transformers' float32 logits."""
    _, path, hf = gemma
    ids = random_ids(120, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512, dtype="bfloat16")
    for chunk in (24, None):
        diff = (paged_logits(llm.engine, ids, chunk=chunk, decode_from=90).float() - ref).abs().max().item()
        assert diff <= 0.2, (chunk, diff)  # logits of about 4.5: a few bfloat16 roundings per layer


def test_gemma_chat_template_when_the_checkpoint_has_none(gemma):
    family, path, _ = gemma
    bare = path.parent / f"{path.name}-no-template"
    if not bare.exists():
        shutil.copytree(path, bare)
        (bare / "chat_template.jinja").unlink(missing_ok=True)
        tc = json.loads((bare / "tokenizer_config.json").read_text())
        tc.pop("chat_template", None)
        (bare / "tokenizer_config.json").write_text(json.dumps(tc))
    tok = LLM(model=str(bare), num_kv_blocks=16, max_model_len=128).tokenizer
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                                    {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}],
                                   add_generation_prompt=True)
    assert text.endswith("<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello"
                         "<end_of_turn>\n<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"), text


def test_a_local_rope_of_another_type_is_refused(gemma, tmp_path):
    family, path, _ = gemma
    if family != "gemma3":
        pytest.skip("Gemma 3's per-layer-type rope_parameters")
    bad = edited_checkpoint(path, "rope_parameters", {"sliding_attention": {"rope_type": "linear", "factor": 2.0,
                                                                  "rope_theta": 10000.0},
                                            "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
    with pytest.raises(ModelLoadError, match="sliding_attention"):
        LLM(model=str(bad), num_kv_blocks=16, max_model_len=128)
