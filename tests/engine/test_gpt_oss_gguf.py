"""gpt-oss from GGUF files (llama.cpp's architecture "gpt-oss"): a tiny random gpt-oss (sinks, biases, a window of 16
on every other layer, yarn, a lowered SwiGLU limit) written as llama.cpp's converter writes it (gate and up experts
apart and stacked, their biases, the float router with its bias, the sinks; gguf-py, so it runs wherever the tests
do), with float32 experts and with MXFP4 experts as the released files have them:
- the config is the directory's, the float file's tensors are the checkpoint's bit for bit, and it equals
  transformers (float32 logits within 1e-4 through chunked prefill and decode, greedy tokens);
- the MXFP4 experts stay in their blocks (PackedClampedExperts over MXFP4 QuantLinears), with or without
  quantization="gguf", and those blocks are the very ones the Hugging Face MXFP4 directory of the same weights
  loads to (the nibble order checked end to end); the torch fallback within 1e-4 of transformers on the
  dequantised weights, the kernels the same greedy tokens within the int8-activation KL floor; batching, chunked
  prefill, prefix caching and preemption change nothing;
- Q8_0 attention beside MXFP4 experts runs packed with quantization="gguf";
- malformed files (no sinks, a misshapen MXFP4 tensor, a missing expert bias) and metadata whose maths is not
  run are refused by name; llama.cpp's own converter's files (LLAMA_CPP_DIR) load to transformers' logits, and
  llama.cpp itself (LLAMA_CPP_BIN) agrees with us on them but for yarn's rounding (ggml rounds the ramp's ends,
  the checkpoint does not: the engine follows the checkpoint)."""

import dataclasses
import os
import sys

import gguf
import pytest
import torch

from helpers import (BATCHING_OVERRIDES, assert_batching_changes_nothing, gguf_engine, llama_cpp_convert,
                     llama_cpp_tree, llama_server_greedy, paged_logits, random_ids, transformers_with_weights)
from servescope import SamplingParams
from servescope.bench.accuracy import compare
from servescope.bench.llama_cpp_tools import find_tool
from servescope.errors import ModelLoadError
from servescope.kernels.cpu import ops as cpu_ops
from servescope.loader import gguf_gpt_oss
from servescope.loader.source import load_model_source
from servescope.model.linears.packed import QuantLinear
from servescope.model.moe import moe_blocks
from servescope.model.moe_clamped import PackedClampedExperts

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_gguf import write_tiny_gpt_oss_gguf  # noqa: E402
from tiny_models import make_tiny_hf_model, make_tiny_mxfp4_gpt_oss  # noqa: E402

Q = gguf.GGMLQuantizationType
TOL = 1e-4
WINDOW = 16
IDS = random_ids(120, 1)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """{name: (GGUF path, HF state dict of its values)} for float, MXFP4 and Q8_0 + MXFP4 files, and the HF MXFP4
    directory and float directory they were written from."""
    tmp = tmp_path_factory.mktemp("gguf-gpt-oss")
    mx_dir, src_dir, _ = make_tiny_mxfp4_gpt_oss(tmp, sliding_window=WINDOW)
    src = load_model_source(str(src_dir))
    out = {"f32": write_tiny_gpt_oss_gguf(tmp / "f32.gguf", src),
           "mxfp4": write_tiny_gpt_oss_gguf(tmp / "mxfp4.gguf", src, expert_qtype=Q.MXFP4),
           "q8_0": write_tiny_gpt_oss_gguf(tmp / "q8_0.gguf", src, qtype=Q.Q8_0, expert_qtype=Q.MXFP4),
           "q8_0_experts": write_tiny_gpt_oss_gguf(tmp / "q8_0_experts.gguf", src, expert_qtype=Q.Q8_0)}
    return out, mx_dir, src_dir, tmp


def _engine(path, **kw):
    return gguf_engine(path, **kw)


def _ref_logits(hf, ids=IDS):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def _greedy_equal(path, hf, n=40, **kw):
    ids = random_ids(n, 3)
    with torch.no_grad():
        want = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           attention_mask=torch.ones(1, n, dtype=torch.long))[0, n:].tolist()
    out = _engine(path, **kw).generate(ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    assert out[0].outputs[0].token_ids == want


def test_config_is_the_directory_config(files):
    (paths, _, src_dir, _) = files
    want = load_model_source(str(src_dir)).config
    for name, (path, _) in paths.items():
        ours = load_model_source(path).config
        assert [s.attention for s in ours.layer_specs()] == [s.attention for s in want.layer_specs()]
        for key in ("architecture", "rope_theta", "rope_scaling", "sliding_window", "layer_types", "attention_bias",
                    "attention_out_bias", "attention_sinks", "tie_word_embeddings", "rms_norm_eps", "head_dim"):
            assert getattr(ours, key) == getattr(want, key), (name, key)
        fmt = "mxfp4" if name in ("mxfp4", "q8_0") else ""
        assert ours.moe == dataclasses.replace(want.moe, experts=dataclasses.replace(want.moe.experts,
                                                                                     weight_format=fmt))
    assert [s.attention.kind for s in want.layer_specs()] == ["sliding", "full"]


@pytest.mark.parametrize("chunk", [24, 7])
def test_float_file_is_the_checkpoint_and_transformers(files, chunk, tmp_path):
    """Every tensor of the float file is the directory's (gate and up re-interleaved, down transposed back); the
    engine over it within 1e-4 of transformers through chunks crossing the window's edges and decode steps."""
    (paths, _, src_dir, _) = files
    src = load_model_source(paths["f32"][0])
    direct = load_model_source(str(src_dir)).state_dict
    assert set(src.state_dict) == set(direct) and not src.packed
    assert all(torch.equal(v, direct[k]) for k, v in src.state_dict.items())
    hf = transformers_with_weights(src_dir, direct, tmp_path)
    diff = (paged_logits(_engine(paths["f32"][0]).engine, IDS, chunk=chunk, decode_from=90) - _ref_logits(hf))
    assert diff.abs().max().item() <= TOL
    _greedy_equal(paths["f32"][0], hf)


def test_mxfp4_experts_stay_packed_as_the_hf_directory_s(files):
    """The file's MXFP4 experts load to the same blocks and E8M0 scales as the HF MXFP4 directory of the same
    weights (gguf-py's quantiser and the engine's follow ggml's rule; llama.cpp's nibble order is the engine's),
    and run as PackedClampedExperts over MXFP4 QuantLinears with and without quantization="gguf"."""
    (paths, mx_dir, _, _) = files
    ours, theirs = load_model_source(paths["mxfp4"][0]), load_model_source(str(mx_dir))
    assert set(ours.packed) == set(theirs.packed) and len(ours.packed) == 2 * 4 * 3
    for k, (q, s, n) in ours.packed.items():
        assert torch.equal(q, theirs.packed[k][0]) and torch.equal(s, theirs.packed[k][1]) and n == theirs.packed[k][2]
    assert set(ours.state_dict) == set(theirs.state_dict)
    for kw in ({}, {"quantization": "gguf"}):
        blocks = moe_blocks(_engine(paths["mxfp4"][0], **kw).engine.executor.model)
        assert len(blocks) == 2
        for _, block in blocks:
            assert isinstance(block.experts, PackedClampedExperts)
            assert all(isinstance(m, QuantLinear) and m.mxfp4 for m in block.experts.linears())


def test_mxfp4_torch_fallback_matches_transformers(files, tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_ops._EXT, "mod", None)  # the torch path everywhere: dequantise, float product
    (paths, _, src_dir, _) = files
    path, stored = paths["mxfp4"]
    hf = transformers_with_weights(src_dir, stored, tmp_path)
    for kw in ({}, {"quantization": "gguf"}):
        diff = (paged_logits(_engine(path, **kw).engine, IDS, chunk=24, decode_from=90) - _ref_logits(hf))
        assert diff.abs().max().item() <= TOL, kw
    _greedy_equal(path, hf)


@pytest.mark.skipif(not cpu_ops.available(), reason="needs the CPU kernel extension")
def test_mxfp4_kernels_greedy_and_kl(files, tmp_path):
    """The kernels (int8 activations over the nibbles, the fused MoE op): transformers' greedy tokens, the HF MXFP4
    directory's greedy tokens, and the logits within the int8-activation KL floor."""
    (paths, mx_dir, src_dir, _) = files
    path, stored = paths["mxfp4"]
    hf = transformers_with_weights(src_dir, stored, tmp_path)
    _greedy_equal(path, hf)
    ids, params = random_ids(40, 6), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    from_hf = gguf_engine(mx_dir).generate(ids, params)[0].outputs[0].token_ids  # the HF MXFP4 directory's load
    assert _engine(path).generate(ids, params)[0].outputs[0].token_ids == from_hf
    r = compare(_ref_logits(hf), paged_logits(_engine(path).engine, IDS, chunk=24, decode_from=90), IDS)
    assert r["kl"] / r["tokens"] <= 0.01 and r["top1"] == r["tokens"], r


@pytest.mark.parametrize("overrides", **BATCHING_OVERRIDES)
def test_batching_chunking_prefix_cache_preemption_change_nothing(files, overrides):
    assert_batching_changes_nothing(files[0]["mxfp4"][0], overrides, 8, skip_tokenizer_init=True)


def test_q8_0_attention_runs_packed(files):
    """quantization="gguf": the Q8_0 attention, embedding and head over their blocks beside the MXFP4 experts,
    within the packed GGUF KL floor of the float load of the same file (its Q8_0 tensors dequantised)."""
    path = files[0]["q8_0"][0]
    ref, llm = _engine(path), _engine(path, quantization="gguf")
    model = llm.engine.executor.model
    assert all(isinstance(m, QuantLinear) for layer in model.model.layers for _, _, m in layer.self_attn.projections())
    assert all(isinstance(b.experts, PackedClampedExperts) for _, b in moe_blocks(model))
    r = compare(paged_logits(ref.engine, IDS), paged_logits(llm.engine, IDS), IDS)
    assert r["kl"] / r["tokens"] <= 0.01 and r["top1"] / r["tokens"] >= 0.9, r


def test_q8_0_experts_run_packed_with_quantization_gguf(files, tmp_path):
    """Q8_0 experts: float ClampedExperts without quantization="gguf" (the file's values, to transformers' logits
    on them within 1e-4), PackedClampedExperts over the Q8_0 blocks with it (the packed GGUF KL floor)."""
    (paths, _, src_dir, _) = files
    path, stored = paths["q8_0_experts"]
    ref, llm = _engine(path), _engine(path, quantization="gguf")
    assert not any(isinstance(b.experts, PackedClampedExperts) for _, b in moe_blocks(ref.engine.executor.model))
    for _, b in moe_blocks(llm.engine.executor.model):
        assert isinstance(b.experts, PackedClampedExperts) and not any(m.mxfp4 for m in b.experts.linears())
    hf = transformers_with_weights(src_dir, stored, tmp_path)
    assert (paged_logits(ref.engine, IDS, chunk=24, decode_from=90) - _ref_logits(hf)).abs().max().item() <= TOL
    r = compare(paged_logits(ref.engine, IDS), paged_logits(llm.engine, IDS), IDS)
    assert r["kl"] / r["tokens"] <= 0.01 and r["top1"] / r["tokens"] >= 0.9, r


REFUSED = [({"drop_gguf": ("blk.0.attn_sinks.weight",)}, "needs blk.0.attn_sinks.weight"),
           ({"drop_gguf": ("blk.1.ffn_up_exps.bias",)}, "missing tensor blk.1.ffn_up_exps.bias"),
           ({"extra_metadata": {"gpt-oss.attention.temperature_scale": 0.5}},
            "gpt-oss.attention.temperature_scale is not implemented"),
           ({"extra_metadata": {"gpt-oss.expert_gating_func": 1}}, "expert_gating_func 1 is not implemented"),
           ({"extra_metadata": {"gpt-oss.rope.freq_base_swa": 10000.0}}, "rope.freq_base_swa 10000.0"),
           ({"rope_scaling": ("longrope", 2.0)}, "unsupported rope scaling type .longrope.")]


def test_malformed_files_are_refused(files, tmp_path):
    """Each refusal names the file and what is wrong; an MXFP4 expert tensor of one block (17 bytes) per row where
    the rows hold two (Dm = 64 weights) reads as the wrong shape."""
    import numpy as np

    (_, _, src_dir, _) = files
    src = load_model_source(str(src_dir))
    e, d = src.config.moe.experts, src.config.hidden_size
    one_block = {"blk.0.ffn_gate_exps.weight": (np.zeros((e.num_experts, e.intermediate_size, 17), np.uint8),
                                                Q.MXFP4)}
    cases = REFUSED + [({"gguf_raw": one_block}, rf"blk.0.ffn_gate_exps.weight has shape \[{e.num_experts}, "
                                                 rf"{e.intermediate_size}, 32\], expected \[{e.num_experts}, "
                                                 rf"{e.intermediate_size}, {d}\]")]
    for i, (kw, match) in enumerate(cases):
        path, _ = write_tiny_gpt_oss_gguf(tmp_path / f"bad{i}.gguf", src, expert_qtype=Q.MXFP4, **kw)
        with pytest.raises(ModelLoadError, match=f"bad{i}.gguf.*{match}"):
            load_model_source(path)


@pytest.mark.parametrize("released", [False, True])
def test_llama_cpp_converter_output_loads_to_transformers(released, tmp_path, monkeypatch):
    """llama.cpp's own convert_hf_to_gguf.py on a tiny gpt-oss (its SmolLM2 tokenizer read by the converter's GPT-2
    vocabulary path; the SwiGLU limit at llama.cpp's fixed 7, which its files do not say): the float checkpoint
    (experts written in float) to transformers' logits within 1e-4; the MXFP4 release form (the converter
    re-lays the nibbles itself) to the same blocks as the engine's load of the directory, and through the torch
    fallback to transformers on the dequantised weights. The float file's tokenizer (read from the GGUF) serves
    text."""
    from transformers import AutoModelForCausalLM

    root = llama_cpp_tree()
    if released:
        hf_dir, src_dir, dequantised = make_tiny_mxfp4_gpt_oss(tmp_path, sliding_window=WINDOW, swiglu_limit=7.0)
    else:
        hf_dir = make_tiny_hf_model(tmp_path, "gpt_oss", sliding_window=WINDOW, swiglu_limit=7.0)
    out = tmp_path / "m.gguf"
    llama_cpp_convert(root, hf_dir, out)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(out)).tensors}
    assert types["blk.0.ffn_down_exps.weight"] == (Q.MXFP4 if released else Q.F32)
    ours = load_model_source(str(out))
    if released:
        theirs = load_model_source(str(hf_dir)).packed
        assert set(ours.packed) == set(theirs)
        assert all(torch.equal(q, theirs[k][0]) and torch.equal(s, theirs[k][1])
                   for k, (q, s, _) in ours.packed.items())
        monkeypatch.setattr(cpu_ops._EXT, "mod", None)
        hf = transformers_with_weights(src_dir, dequantised, tmp_path)
    else:
        hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert ours.config.layer_specs() == load_model_source(str(hf_dir)).config.layer_specs()
    diff = (paged_logits(_engine(out).engine, IDS, chunk=24, decode_from=90) - _ref_logits(hf)).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.2e}"
    if not released:  # the file's own vocabulary (the converter's GPT-2 path) serves text
        from servescope import LLM

        text = LLM(model=str(out), num_kv_blocks=16, max_model_len=128).generate(
            ["Hello there"], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
        assert len(text.token_ids) == 4 and text.text


def test_llama_cpp_agrees_with_us_but_for_yarn_rounding(tmp_path, monkeypatch):
    """llama.cpp itself (llama-server, where LLAMA_CPP_BIN or PATH has it) on its converter's file of the MXFP4
    release form, 30 greedy steps after a 40-token prompt (past the window): with yarn's ramp rounded to whole
    dimensions as ggml rounds it, the log-probabilities of its top 5 tokens at each step are ours on the same
    prefix within 0.02 (the tensors, MXFP4 nibbles, window pattern, sinks, router and clamp read as llama.cpp reads
    them). The engine itself keeps the checkpoint's unrounded ramp (transformers' `truncate: false`, the 1e-4
    parity above), which moves these log-probabilities by about 0.1 on this tiny model."""
    server = find_tool("llama-server")
    if server is None:
        pytest.skip("llama.cpp's llama-server not found (LLAMA_CPP_BIN)")
    root = llama_cpp_tree()
    hf_dir, _, _ = make_tiny_mxfp4_gpt_oss(tmp_path, sliding_window=WINDOW, swiglu_limit=7.0)
    out = tmp_path / "m.gguf"
    llama_cpp_convert(root, hf_dir, out)
    ids = random_ids(40, 5)
    theirs, steps = llama_server_greedy(server, out, ids, tmp_path)
    yarn = gguf_gpt_oss.yarn_scaling
    assert load_model_source(str(out)).config.rope_scaling.truncate is False  # (as loaded: the checkpoint's)
    monkeypatch.setattr(gguf_gpt_oss, "yarn_scaling", lambda meta: dataclasses.replace(yarn(meta), truncate=True))
    ours = torch.log_softmax(paged_logits(_engine(out).engine, ids + theirs)[len(ids) - 1:-1].double(), -1)
    worst = max(abs(ours[i, t["id"]].item() - t["logprob"]) for i, step in enumerate(steps)
                for t in step["top_logprobs"])
    assert worst <= 0.02, f"max |log-probability diff| {worst:.3f}"
