"""`servescope checkpoint`: a random-weight checkpoint of a real shape, written in one piece or not at all,
loadable by the engine (and by llama.cpp's converter where its tools are built: LLAMA_CPP_DIR)."""

import json
import os
from pathlib import Path

import pytest
from safetensors import safe_open

from servescope import LLM, SamplingParams
from servescope.analysis.presets import preset_hf_dict
from servescope.bench.shape_checkpoint import (SHAPES, TOKENIZER_VOCAB, find_llama_cpp, shape_config,
                                               write_shape_checkpoint)
from servescope.cli import main
from servescope.errors import InvalidParameterError

# a test-sized shape in the form of a preset: Llama's layers, 2 of them, hidden 64
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 512,
        "tie_word_embeddings": True, "vocab_size": 1000, "hidden_act": "silu"}


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory):
    path = tmp_path_factory.mktemp("shape") / "tiny-llama.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_the_issues_shapes_are_presets_with_their_real_numbers():
    for shape in SHAPES:
        cfg = shape_config(shape)
        assert cfg["vocab_size"] == TOKENIZER_VOCAB and cfg["torch_dtype"] == "bfloat16"
        assert "SmolLM2" in cfg["_source"]
    assert preset_hf_dict("llama-3.1-8b")["vocab_size"] == 128256  # the preset keeps the real vocabulary
    assert shape_config("qwen3-4b", layers=3)["num_hidden_layers"] == 3
    assert shape_config("qwen3-4b", layers=3)["max_window_layers"] == 3


def test_writes_a_directory_the_engine_runs(tiny_shape, tmp_path):
    r = write_shape_checkpoint(tiny_shape, str(tmp_path / "nested" / "ck"), seed=1)
    out = Path(r.out)
    names = sorted(p.name for p in out.iterdir())
    assert "config.json" in names and "tokenizer.json" in names and "model.safetensors.index.json" in names
    index = json.loads((out / "model.safetensors.index.json").read_text())
    total = 0
    for name, shard in index["weight_map"].items():
        with safe_open(str(out / shard), "pt") as f:
            t = f.get_tensor(name)
        assert str(t.dtype) == "torch.bfloat16"
        total += t.numel()
        if name == "model.embed_tokens.weight":
            assert tuple(t.shape) == (TOKENIZER_VOCAB, 64) and 0.015 < float(t.float().std()) < 0.025
    assert total == r.parameters and not any(n.startswith(".checkpoint-") for n in os.listdir(out.parent))
    llm = LLM(model=r.out, num_kv_blocks=16, max_model_len=64)
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    got = llm.generate(["The capital of France is"], greedy)
    assert len(got[0].outputs[0].token_ids) == 4


def test_bad_input_is_a_clear_error_and_writes_nothing(tiny_shape, tmp_path, monkeypatch, capsys):
    with pytest.raises(InvalidParameterError, match="unknown preset"):
        write_shape_checkpoint("llama-9b", str(tmp_path / "a"))
    with pytest.raises(InvalidParameterError, match="unknown GGUF type"):
        write_shape_checkpoint(tiny_shape, str(tmp_path / "b"), gguf="q4_0,q3_x")
    monkeypatch.delenv("LLAMA_CPP_DIR", raising=False)
    with pytest.raises(InvalidParameterError, match="llama.cpp's source tree"):
        write_shape_checkpoint(tiny_shape, str(tmp_path / "c"), gguf="q4_0")
    with pytest.raises(InvalidParameterError, match="not a llama.cpp source tree"):
        find_llama_cpp(str(tmp_path))
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    with pytest.raises(InvalidParameterError, match="not an empty directory"):
        write_shape_checkpoint(tiny_shape, str(full))
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(InvalidParameterError, match="cannot write"):
        write_shape_checkpoint(tiny_shape, str(blocker / "sub" / "out"))
    assert main(["checkpoint", "no-such-shape", "--out", str(tmp_path / "d")]) == 2
    assert "unknown preset" in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ["file", "full"] and os.listdir(full) == ["keep.txt"]


@pytest.mark.skipif(not os.environ.get("LLAMA_CPP_DIR"), reason="llama.cpp's tree not given (LLAMA_CPP_DIR)")
def test_gguf_files_of_the_same_weights(tiny_shape, tmp_path):
    import numpy as np
    from gguf import GGUFReader

    r = write_shape_checkpoint(tiny_shape, str(tmp_path / "g"), gguf="f16,q8_0")
    assert set(r.ggufs) == {"F16", "Q8_0"} and all(os.path.isfile(p) for p in r.ggufs.values())
    f16 = {t.name: t for t in GGUFReader(r.ggufs["F16"]).tensors}
    with safe_open(os.path.join(r.out, "model-00001-of-00001.safetensors"), "pt") as f:
        want = f.get_tensor("model.layers.0.mlp.down_proj.weight").float().numpy()
    got = np.asarray(f16["blk.0.ffn_down.weight"].data, dtype=np.float32).reshape(want.shape)
    assert np.abs(got - want).max() < 1e-3  # bfloat16 -> float16 of values ~0.02: exact to float16's step
