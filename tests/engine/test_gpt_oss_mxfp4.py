"""gpt-oss as released: a tiny random gpt-oss checkpoint whose routed experts are MXFP4 (`_blocks` / `_scales`
in transformers' layout, quantization_config quant_method "mxfp4"; tiny_models.make_tiny_mxfp4_gpt_oss) loads
with its experts kept in their blocks (PackedClampedExperts over MXFP4 QuantLinears: no float expert weight
exists), against transformers on the dequantised weights (transformers' own MXFP4 conversion, the very values
its Mxfp4Config(dequantize=True) load gives):
- without the CPU extension (the torch fallback: dequantise, float product) float32 logits within 1e-4;
- with the kernels (int8 dot products over the nibbles, the fused MoE op) the same greedy tokens, the logits
  within the activations' int8 rounding (the packed-GGUF KL floor), and batching, chunked prefill, prefix
  caching and preemption change nothing.
Bad MXFP4 files are refused naming the tensor; an unknown quant_method stays a load error."""

import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import (BATCHING_OVERRIDES, assert_batching_changes_nothing, assert_bfloat16_near_float32_transformers,
                     assert_greedy_matches_transformers, assert_logits_match_transformers, edited_checkpoint,
                     paged_logits, random_ids, transformers_with_weights)
from servescope import LLM, SamplingParams
from servescope.bench.accuracy import compare
from servescope.errors import InvalidParameterError, ModelLoadError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.loader.source import load_model_source
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import moe_blocks
from servescope.model.moe_clamped import PackedClampedExperts

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import make_tiny_mxfp4_gpt_oss  # noqa: E402

TOL = 1e-4
WINDOW = 16


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """(MXFP4 directory, transformers on its dequantised weights, the float checkpoint it came from)."""
    tmp = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    path, src, dequantised = make_tiny_mxfp4_gpt_oss(tmp, sliding_window=WINDOW)
    return path, transformers_with_weights(src, dequantised, tmp), src


def test_transformers_own_mxfp4_load_is_the_reference(mxfp4):
    from transformers import AutoModelForCausalLM, Mxfp4Config

    path, hf, _ = mxfp4
    own = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                               quantization_config=Mxfp4Config(dequantize=True)).eval()
    ids = torch.tensor([random_ids(30, 5)])
    with torch.no_grad():
        assert torch.equal(own(ids).logits, hf(ids).logits)


def test_experts_stay_packed(mxfp4):
    path, _, src = mxfp4
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    blocks = moe_blocks(llm.engine.executor.model)
    assert len(blocks) == 2
    for _, block in blocks:
        ex = block.experts
        assert isinstance(ex, PackedClampedExperts)
        assert all(isinstance(m, QuantLinear) and m.mxfp4 for m in ex.linears())
        assert not any("proj" in n and p.dim() == 3 for n, p in ex.named_parameters())  # no float expert weight
    spec = llm.engine.model_config.layer_specs()[0].mlp.experts
    weights = 3 * spec.intermediate_size * llm.engine.model_config.hidden_size
    biases = 2 * spec.intermediate_size + llm.engine.model_config.hidden_size
    assert blocks[0][1].experts.expert_bytes() == weights * 4.25 / 8 + biases * 4
    float_llm = LLM(model=str(src), num_kv_blocks=64, max_model_len=512)
    saved = 2 * spec.num_experts * (weights * 4 - weights * 4.25 / 8)  # two layers of experts
    assert float_llm.engine.weight_bytes - llm.engine.weight_bytes == saved
    source = load_model_source(str(path))
    assert not any(k.endswith(("experts.gate_up_proj", "experts.down_proj")) for k in source.state_dict)


@pytest.mark.parametrize("chunk", [24, 7])
def test_torch_fallback_logits_match_transformers(mxfp4, chunk, monkeypatch):
    monkeypatch.setattr(cpu_ops._EXT, "mod", None)  # load() -> None: the torch path everywhere
    path, hf, _ = mxfp4
    assert_logits_match_transformers(path, hf, chunk, TOL)


def test_torch_fallback_greedy_matches_transformers(mxfp4, monkeypatch):
    monkeypatch.setattr(cpu_ops._EXT, "mod", None)
    path, hf, _ = mxfp4
    assert_greedy_matches_transformers(path, hf, 40)


@pytest.mark.skipif(not cpu_ops.available(), reason="needs the CPU kernel extension")
def test_kernels_greedy_and_logits(mxfp4):
    path, hf, _ = mxfp4
    assert_greedy_matches_transformers(path, hf, 40)
    llm = LLM(model=str(path), num_kv_blocks=64, max_model_len=512)
    assert all(b.experts._fused(torch.zeros(1, llm.engine.model_config.hidden_size)) is not None
               for _, b in moe_blocks(llm.engine.executor.model))
    ids = random_ids(120, 1)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    r = compare(ref, paged_logits(llm.engine, ids, chunk=24, decode_from=90), ids)
    assert r["kl"] / r["tokens"] <= 0.01 and r["top1"] == r["tokens"], r


@pytest.mark.parametrize("overrides", **BATCHING_OVERRIDES)
def test_batching_chunking_prefix_cache_preemption_change_nothing(mxfp4, overrides):
    assert_batching_changes_nothing(mxfp4[0], overrides, 8)


def test_step_records_count_packed_expert_bytes(mxfp4):
    llm = LLM(model=str(mxfp4[0]), num_kv_blocks=64, max_model_len=512)
    llm.generate([[5, 9, 33]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    rec = llm.engine.step_records[-1]
    one = moe_blocks(llm.engine.executor.model)[0][1].experts.expert_bytes()
    assert rec.moe_expert_bytes == sum(rec.moe_experts_active) * one > 0


def _rewritten(path, tmp_path, edit) -> str:
    """A copy of the MXFP4 directory with its tensors passed through edit(dict)."""
    out = tmp_path / "edited"
    out.mkdir(parents=True)
    for f in os.listdir(path):
        if f != "model.safetensors":
            (out / f).write_bytes((path / f).read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(out / "model.safetensors"))
    return str(out)


def test_bad_files_are_refused(mxfp4, tmp_path):
    path, _, _ = mxfp4
    key, attn = "model.layers.0.mlp.experts.down_proj", "model.layers.0.self_attn.q_proj_blocks"
    cases = [(lambda t: t.pop(key + "_scales"), "down_proj_blocks and _scales: the pair is incomplete"),
             (lambda t: t.__setitem__(key + "_scales", t[key + "_scales"][:, :3].contiguous()),
              r"down_proj_blocks \[4, 64, 1, 16\] / _scales \[4, 3, 1\]"),
             (lambda t: t.__setitem__(attn, torch.zeros(2, 16, dtype=torch.uint8)),
              "q_proj_blocks: only gpt-oss's routed experts")]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(ModelLoadError, match=message):
            LLM(model=_rewritten(path, tmp_path / str(i), edit), num_kv_blocks=8, max_model_len=128)
    with pytest.raises((ModelLoadError, InvalidParameterError), match="quantization_config.*'awq'"):
        LLM(model=str(edited_checkpoint(path, "quantization_config", {"quant_method": "awq"})), num_kv_blocks=8,
            max_model_len=128)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "mxfp4"


def test_bfloat16_stays_near_float32_transformers(mxfp4):
    """bfloat16 activations over the same MXFP4 experts (the fused op on bfloat16 rows)."""
    path, hf, _ = mxfp4
    assert_bfloat16_near_float32_transformers(path, hf)
