"""config.json fields that change the maths: read where implemented, a load error naming the field where not,
never silently ignored (config/hf_fields.py)."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import make_tiny_hf_model  # noqa: E402

from servescope.config import ModelConfig  # noqa: E402
from servescope.errors import InvalidParameterError, ModelLoadError  # noqa: E402
from servescope.loader.source import load_model_source  # noqa: E402

BASE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256}


def _as(arch: str, model_type: str, **extra) -> dict:
    return {**BASE, "architectures": [arch], "model_type": model_type, **extra}


def _rewrite(path, **fields):
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(fields)
    (path / "config.json").write_text(json.dumps(cfg))


def test_made_up_field_is_a_load_error_naming_it(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    load_model_source(str(path))  # loads as written by transformers
    _rewrite(path, attention_temperature_twist=0.5)
    with pytest.raises(ModelLoadError, match=r"config.json.*'attention_temperature_twist'.*not known"):
        load_model_source(str(path))


@pytest.mark.parametrize("field,value", [("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0),
                                         ("mlp_bias", True), ("use_mrope", True), ("logits_scaling", 2.0)])
def test_real_fields_that_change_the_maths_are_refused(field, value):
    with pytest.raises(InvalidParameterError, match=rf"'{field}' = {value!r} changes the model's maths"):
        ModelConfig.from_hf_dict({**BASE, field: value})
    ModelConfig.from_hf_dict({**BASE, field: None if "softcapping" in field or field == "logits_scaling"
                              else False})  # the value that means "off" loads


def test_foreign_quantization_config_is_refused():
    with pytest.raises(InvalidParameterError, match="quant_method 'gptq'"):
        ModelConfig.from_hf_dict({**BASE, "quantization_config": {"quant_method": "gptq", "bits": 4}})
    with pytest.raises(InvalidParameterError, match="quant_method 'mxfp4' is not supported for llama"):  # gpt-oss's
        ModelConfig.from_hf_dict({**BASE, "quantization_config": {"quant_method": "mxfp4"}})


def test_bookkeeping_fields_load():
    cfg = ModelConfig.from_hf_dict({**BASE, "torch_dtype": "bfloat16", "use_cache": True, "attention_dropout": 0.1,
                                    "initializer_range": 0.02, "pretraining_tp": 1, "transformers_version": "4.44"})
    assert cfg.num_hidden_layers == 4


def test_a_window_on_a_family_without_one_is_refused():
    with pytest.raises(InvalidParameterError, match="'sliding_window' = 16"):
        ModelConfig.from_hf_dict({**BASE, "sliding_window": 16})


def test_a_window_covering_the_whole_context_is_full_attention():
    cfg = ModelConfig.from_hf_dict(_as("MistralForCausalLM", "mistral", sliding_window=256))
    assert cfg.sliding_window is None
    assert {s.attention.kind for s in cfg.layer_specs()} == {"full"}


def test_qwen2_without_use_sliding_window_is_full_attention():
    cfg = ModelConfig.from_hf_dict(_as("Qwen2ForCausalLM", "qwen2", sliding_window=16, use_sliding_window=False,
                                       max_window_layers=2))
    assert cfg.sliding_window is None


def test_layer_types_of_the_wrong_length_are_refused():
    with pytest.raises(InvalidParameterError, match="layer_types"):
        ModelConfig.from_hf_dict(_as("Qwen2ForCausalLM", "qwen2", sliding_window=16, use_sliding_window=True,
                                     layer_types=["full_attention"] * 3))


def test_gguf_sliding_window_and_softcap_metadata_are_refused(tmp_path):
    from tiny_gguf import write_tiny_gguf

    src = load_model_source(str(make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=256, with_tokenizer=False)))
    for key, value in (("llama.attention.sliding_window", 16), ("llama.attn_logit_softcapping", 50.0)):
        path = write_tiny_gguf(tmp_path / f"{key}.gguf", src.config, src.state_dict, extra_metadata={key: value})
        with pytest.raises(ModelLoadError, match=rf"{key} asks for attention maths"):
            load_model_source(path)


def test_window_patterns_of_the_families():
    mistral = ModelConfig.from_hf_dict(_as("MistralForCausalLM", "mistral", sliding_window=16))
    assert [s.attention.kind for s in mistral.layer_specs()] == ["sliding"] * 4
    qwen = ModelConfig.from_hf_dict(_as("Qwen2ForCausalLM", "qwen2", sliding_window=16, use_sliding_window=True,
                                        max_window_layers=3))
    assert [(s.attention.kind, s.attention.window) for s in qwen.layer_specs()] == [("full", 0)] * 3 + [("sliding", 16)]
    given = ModelConfig.from_hf_dict(_as("Qwen2ForCausalLM", "qwen2", sliding_window=16, use_sliding_window=True,
                                         layer_types=["sliding_attention", "full_attention"] * 2))
    assert [s.attention.kind for s in given.layer_specs()] == ["sliding", "full"] * 2
    for cfg in (mistral, qwen, given):  # to_hf_dict gives the same layers back
        assert ModelConfig.from_hf_dict(cfg.to_hf_dict()).layer_specs() == cfg.layer_specs()
