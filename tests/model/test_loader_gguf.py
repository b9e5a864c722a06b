"""GGUF loading: the embedded SmolLM2 against transformers, synthetic GGUFs of every family and quant type."""

import dataclasses
import os
import sys

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_gguf import gguf_stored_values, write_tiny_gguf  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

from servescope.errors import ModelLoadError  # noqa: E402
from servescope.loader.gguf import reverse_llama_permute  # noqa: E402
from servescope.loader.checkpoint import expected_tensor_shapes  # noqa: E402
from servescope.loader.source import load_model_source  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def smollm2():
    return load_model_source(None)


def test_smollm2_config(smollm2):
    c = smollm2.config
    assert smollm2.format == "gguf" and smollm2.path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")
    assert (c.architecture, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.vocab_size) == (9, 3, 64, 49152)
    assert c.tie_word_embeddings and c.rope_theta == 100000.0 and c.rms_norm_eps == 1e-5
    assert c.max_position_embeddings == 8192 and c.rope_scaling is None
    assert smollm2.generation_config["eos_token_id"] == [2] and c.eos_token_ids == (2,)
    assert "<|im_start|>" in smollm2.chat_template
    assert smollm2.tokenizer_source.gguf_file == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert set(smollm2.state_dict) == set(expected_tensor_shapes(c))
    assert "lm_head.weight" not in smollm2.state_dict
    assert all(t.dtype == torch.float32 for t in smollm2.state_dict.values())


def test_smollm2_matches_transformers_tensor_processor(smollm2):
    """Q/K (permuted by llama.cpp) and other tensors equal what transformers' GGUF tensor processor yields."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    reader = gguf.GGUFReader(smollm2.path)
    wanted = {"blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",
              "blk.0.attn_k.weight": "model.layers.0.self_attn.k_proj.weight",
              "blk.29.attn_q.weight": "model.layers.29.self_attn.q_proj.weight",
              "blk.29.attn_k.weight": "model.layers.29.self_attn.k_proj.weight",
              "blk.3.attn_v.weight": "model.layers.3.self_attn.v_proj.weight",
              "blk.3.ffn_down.weight": "model.layers.3.mlp.down_proj.weight",
              "blk.3.attn_norm.weight": "model.layers.3.input_layernorm.weight",
              "token_embd.weight": "model.embed_tokens.weight"}
    for t in reader.tensors:
        if t.name in wanted:
            ref = processor.process(weights=gguf.quants.dequantize(t.data, t.tensor_type), name=t.name).weights
            assert torch.equal(smollm2.state_dict[wanted[t.name]], torch.from_numpy(np.array(ref))), t.name


@pytest.mark.skipif(not os.environ.get("SERVESCOPE_SLOW_TESTS"), reason="loads the model with transformers "
                    "(~15-50 s); set SERVESCOPE_SLOW_TESTS=1")
def test_smollm2_matches_transformers(smollm2):
    """Every tensor equals transformers' GGUF load (which also reverses llama.cpp's Q/K permutation)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2.path), gguf_file=os.path.basename(smollm2.path), local_files_only=True
    ).state_dict()
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                 "model.layers.29.self_attn.k_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(smollm2.state_dict[name], ref[name]), name
    for name, t in smollm2.state_dict.items():
        assert torch.equal(t, ref[name].to(torch.float32)), name


def test_reverse_permute_inverts_llama_cpp():
    from tiny_gguf import llama_cpp_permute

    w = np.arange(6 * 16 * 3, dtype=np.float32).reshape(6 * 16, 3)
    for n_head in (1, 2, 6):
        assert np.array_equal(reverse_llama_permute(llama_cpp_permute(w, n_head), n_head), w)
    b = np.arange(32, dtype=np.float32)
    assert np.array_equal(reverse_llama_permute(llama_cpp_permute(b, 2), 2), b)
    assert not np.array_equal(llama_cpp_permute(w, 2), w)


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    out = {}
    for fam in ("llama", "qwen2", "qwen3"):
        path = make_tiny_hf_model(d, fam, vocab_size=256, with_tokenizer=False)
        out[fam] = load_model_source(str(path))
    return out


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_1"])
def test_synthetic_gguf_roundtrip(tmp_path, tiny_sources, family, qtype):
    src = tiny_sources[family]
    qt = Q[qtype]
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch=family, qtype=qt,
                           chat_template="{{ messages }}")
    got = load_model_source(path)
    # llama GGUFs hold no rope-scaling metadata for this tiny model; the rest of the config must survive
    want = dataclasses.replace(src.config, name="tiny", rope_scaling=None)
    assert got.config == want
    assert got.chat_template == "{{ messages }}" and got.format == "gguf"
    assert set(got.state_dict) == set(src.state_dict)
    for name, t in src.state_dict.items():
        exp = gguf_stored_values(name, t.numpy(), src.config, family, qt)
        assert np.array_equal(got.state_dict[name].numpy(), exp), name
        tol = {"F32": 0, "F16": 1e-3, "BF16": 3e-3}.get(qtype, 0.05)
        assert torch.allclose(got.state_dict[name], t, atol=tol, rtol=0), name


def test_llama_gguf_q_k_are_unpermuted_exactly(tmp_path, tiny_sources):
    src = tiny_sources["llama"]
    got = load_model_source(write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="llama"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"):
        assert torch.equal(got.state_dict[name], src.state_dict[name])


def test_mistral_detected_from_name(tmp_path, tiny_sources):
    src = tiny_sources["llama"]
    got = load_model_source(write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, name="Mistral 7B"))
    assert got.config.architecture == "mistral"


def test_untied_gguf_has_lm_head(tmp_path, tiny_sources):
    src = tiny_sources["llama"]
    assert not src.config.tie_word_embeddings
    got = load_model_source(write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict))
    assert not got.config.tie_word_embeddings and "lm_head.weight" in got.state_dict


# ---- errors: each names the file and the problem


def test_truncated_gguf(tmp_path, tiny_sources):
    src = tiny_sources["qwen2"]
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="qwen2")
    size = os.path.getsize(path)
    for keep in (size - 100, size // 2, 40, 3):
        with open(path, "r+b") as f:
            f.truncate(keep)
        with pytest.raises(ModelLoadError, match="m.gguf"):
            load_model_source(path)


def test_random_bytes_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ModelLoadError, match="junk.gguf.*not a readable GGUF"):
        load_model_source(str(path))
    path.write_bytes(b"GGUF" + np.random.default_rng(1).bytes(4096))
    with pytest.raises(ModelLoadError, match="junk.gguf"):
        load_model_source(str(path))


def test_unknown_gguf_architecture(tmp_path, tiny_sources):
    src = tiny_sources["qwen2"]
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="gpt2")
    with pytest.raises(ModelLoadError, match=r"m.gguf.*unsupported GGUF architecture 'gpt2'.*qwen2, qwen3"):
        load_model_source(path)


def test_missing_gguf_tensor(tmp_path, tiny_sources):
    src = tiny_sources["qwen3"]
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="qwen3",
                           drop=("model.layers.1.self_attn.k_norm.weight",))
    with pytest.raises(ModelLoadError, match=r"m.gguf.*missing tensor.*layers.1.self_attn.k_norm.weight"):
        load_model_source(path)


def test_gguf_shape_mismatch(tmp_path, tiny_sources):
    src = tiny_sources["qwen2"]
    bad = np.zeros((src.config.intermediate_size, src.config.hidden_size + 32), np.float32)
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="qwen2",
                           replace={"model.layers.0.mlp.up_proj.weight": bad})
    with pytest.raises(ModelLoadError, match=r"m.gguf.*shape mismatch.*layers.0.mlp.up_proj.weight"):
        load_model_source(path)


def test_rope_scaling_from_gguf(tmp_path, tiny_sources):
    src = tiny_sources["llama"]
    # Llama 3.1 style: a rope_freqs tensor of per-frequency divisors (1 ... factor), no metadata
    freqs = np.concatenate([np.ones(4), np.linspace(1, 8, 4)]).astype(np.float32)
    got = load_model_source(write_tiny_gguf(tmp_path / "a.gguf", src.config, src.state_dict,
                                            extra_tensors={"rope_freqs.weight": freqs}))
    assert got.config.rope_scaling.rope_type == "llama3" and got.config.rope_scaling.factor == 8.0
    assert "rope_freqs.weight" not in got.state_dict
    got = load_model_source(write_tiny_gguf(tmp_path / "b.gguf", src.config, src.state_dict,
                                            rope_scaling=("linear", 2.0)))
    assert got.config.rope_scaling.rope_type == "linear" and got.config.rope_scaling.factor == 2.0
    with pytest.raises(ModelLoadError, match=r"c.gguf.*unsupported rope scaling type 'yarn'"):
        load_model_source(write_tiny_gguf(tmp_path / "c.gguf", src.config, src.state_dict,
                                          rope_scaling=("yarn", 4.0)))


def test_vocab_size_from_token_list(tmp_path, tiny_sources):
    import gguf as g

    src = tiny_sources["qwen3"]
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="qwen3", token_count=256)
    r = g.GGUFReader(path)
    assert len(r.fields["tokenizer.ggml.tokens"].data) == 256 and "qwen3.vocab_size" not in r.fields
    assert load_model_source(path).config.vocab_size == 256
