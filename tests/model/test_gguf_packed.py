"""A GGUF's Q4_0 / Q4_1 / Q8_0 blocks run as they are (`quantization="gguf"`, loader/gguf_packed.py):
the block split against gguf-py's dequantize, the packed GEMV against a float64 reference, tiny
models of every family against their float32 load of the same file, the embedded model's memory; the
K-quants (Q4_K, Q6_K) repacked at load, against gguf-py's dequantize and a Q4_K_M-like tiny file."""

import logging
import os
import sys

import gguf
import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from tiny_gguf import write_tiny_gguf  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

from servescope import LLM, SamplingParams  # noqa: E402
from servescope.errors import EngineConfigError  # noqa: E402
from servescope.kernels.cpu import ops as cpu_ops  # noqa: E402
from servescope.model.linears import packed as ql  # noqa: E402
from servescope.loader import gguf_packed  # noqa: E402
from servescope.loader.source import load_model_source, resolve_model_path  # noqa: E402
from servescope.model.quantize import weight_format  # noqa: E402
from servescope.quant import packed as qp  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_blocks_match_gguf_dequantize(qtype):
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((13, 96)) * rng.uniform(0.01, 2, (13, 1))).astype(np.float32)
    raw = gguf.quants.quantize(w, Q[qtype])
    packed, scales = gguf_packed.split_blocks(raw, Q[qtype], 13, 96)
    ref = gguf.quants.dequantize(raw, Q[qtype]).reshape(13, 96)
    got = qp.dequantize(packed, scales, 96).numpy()
    assert np.allclose(got, ref, atol=1e-6, rtol=1e-6)
    mod = cpu_ops.load()
    if mod is not None:  # the kernel on the file's blocks against float64 on gguf-py's values
        x = torch.randn(3, 96)
        y = mod.quant_gemv(x, packed, scales, torch.empty(0)).double()
        xa = qp.gemv_activations(x, 96, 32)[0]  # the activations rounded to int8 per block, as the kernel does
        assert torch.allclose(y, xa @ torch.from_numpy(ref).double().T, atol=1e-4, rtol=1e-5)
        x = torch.randn(20, 96)  # and the prefill GEMM on the same blocks
        y = mod.quant_gemm(x, packed, scales, torch.empty(0)).double()
        ref64 = qp.gemv_activations(x, 96, 32)[0] @ torch.from_numpy(ref).double().T
        assert torch.allclose(y, ref64, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("family,qtype", [("llama", "Q4_0"), ("llama", "Q8_0"), ("qwen2", "Q4_1"), ("qwen3", "Q4_0")])
def test_tiny_gguf_runs_packed_like_its_float32_load(tmp_path, family, qtype):
    src = load_model_source(str(make_tiny_hf_model(tmp_path, family, vocab_size=256, with_tokenizer=False)))
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch=family, qtype=Q[qtype])
    ref = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    llm = LLM(model=path, skip_tokenizer_init=True, quantization="gguf", num_kv_blocks=32, max_model_len=128)
    model = llm.engine.runner.executor.model
    assert isinstance(model.model.layers[0].self_attn.qkv_proj, ql.QuantLinear)
    assert llm.engine.runner.executor.decode_plan is not None
    assert llm.engine.weight_bytes < 0.45 * ref.engine.weight_bytes
    assert weight_format(model, "gguf") == qtype.lower()  # what the cost model counts the bytes as
    assert weight_format(ref.engine.runner.executor.model, None) is None
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 33, 2, 100], [7] * 20]
    for a, b in zip(ref.generate(prompts, sp), llm.generate(prompts, sp)):
        assert_greedy_equal_up_to_a_near_tie(a.outputs[0], b.outputs[0], 2e-2)


def test_the_build_allocates_no_float_copy_of_packed_weights(tmp_path, monkeypatch):
    """The packed modules are built on the meta model, before anything is allocated: no float tensor the
    shape of a packed projection, embedding or head is ever made (a 3B Q4_0 file took 12 GB that way), and
    the build consumes the blocks (a fused projection's parts are not held beside their concatenation)."""
    from servescope.loader import build

    src = load_model_source(str(make_tiny_hf_model(tmp_path, "qwen2", vocab_size=256, with_tokenizer=False)))
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, arch="qwen2", qtype=Q.Q8_0)
    loaded = load_model_source(path, keep_packed=True)
    shapes, real_allocate = [], build._allocate

    def recording_allocate(model, device, dtype):  # the shapes of what the build allocates in float
        shapes.extend(tuple(t.shape) for t in [*model.parameters(), *model.buffers()]
                      if t.is_meta and t.is_floating_point())
        real_allocate(model, device, dtype)

    monkeypatch.setattr(build, "_allocate", recording_allocate)
    packed_shapes = {tuple(v[0].shape[:1]) + (v[2],) for v in loaded.packed.values()}
    model = build.build_model(loaded.config, loaded.state_dict, torch.float32, torch.device("cpu"),
                              packed=loaded.packed)
    c = loaded.config
    fused = {(c.hidden_size + 2 * c.num_key_value_heads * c.head_dim, c.hidden_size),
             (2 * c.intermediate_size, c.hidden_size)}
    assert shapes and not (set(shapes) & (packed_shapes | fused)), set(shapes) & (packed_shapes | fused)
    assert loaded.packed == {}
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, ql.QuantLinear) and qkv.bias is not None  # (Qwen2: biases loaded beside the blocks)
    ref = src.state_dict
    want = torch.cat([ref[f"model.layers.0.self_attn.{p}_proj.bias"] for p in "qkv"])
    assert torch.equal(qkv.bias, want) and torch.equal(qkv._bias_f32, want)


def assert_greedy_equal_up_to_a_near_tie(a, b, logprob_tol: float, tie_gap: float = 0.5) -> int:
    """Two completions of the same weights, float32 and in the file's blocks: the decode GEMV rounds its
    activations to int8 per 32-block (llama.cpp's numerics, ~0.4% per element), the prefill GEMM does
    not, so the tokens are equal, with close logprobs, up to a near-tie (the diverging tokens in each
    other's top 3, less than `tie_gap` apart in both), where the comparison stops. Returns the tokens
    compared."""
    for i, (x, y, la, lb) in enumerate(zip(a.token_ids, b.token_ids, a.logprobs, b.logprobs)):
        if x != y:
            top_a, top_b = dict(la.top), dict(lb.top)
            assert y in top_a and x in top_b, (i, x, y)
            assert abs(top_a[x] - top_a[y]) < tie_gap and abs(top_b[x] - top_b[y]) < tie_gap, (i, la, lb)
            return i
        assert abs(la.top[0][1] - lb.top[0][1]) < logprob_tol, (i, la, lb)
    return len(a.token_ids)


def test_other_types_dequantise_with_a_log_line(tmp_path, caplog):
    src = load_model_source(str(make_tiny_hf_model(tmp_path, "llama", vocab_size=256, with_tokenizer=False)))
    # gguf-py cannot write K-quants
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, qtype=Q.Q5_1)
    with caplog.at_level(logging.INFO, logger="servescope.loader.gguf"):
        got = load_model_source(path, keep_packed=True)
    assert not got.packed and "dequantised to float32" in caplog.text and "Q5_1" in caplog.text


def test_gguf_mode_needs_a_gguf(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama", vocab_size=256, with_tokenizer=False)
    with pytest.raises(EngineConfigError, match="gguf"):
        LLM(model=str(path), skip_tokenizer_init=True, quantization="gguf", num_kv_blocks=8)


def test_embedded_model_in_its_blocks(smollm2_llm):
    path = resolve_model_path("smollm2-135m")
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(path).tensors)
    llm = LLM(quantization="gguf", num_kv_blocks=64, max_model_len=512)
    assert llm.engine.weight_bytes <= 1.2 * file_bytes  # the floor (float32: ~5.6x)
    ids = smollm2_llm.tokenizer.encode("The capital of France is")
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    a, b = smollm2_llm.generate(ids, sp)[0].outputs[0], llm.generate(ids, sp)[0].outputs[0]
    # 30 layers of int8-rounded activations: logprobs within 0.3, a divergence only at a near-tie (on an
    # EPYC Zen 4 the 6th token of this prompt is one; on a Xeon with AMX, 2026-12-02, the 6th token's
    # logprobs were 0.257 apart, its top two 0.22 and 0.11 apart: a flat spot, not a drift)
    assert assert_greedy_equal_up_to_a_near_tie(a, b, 0.3) >= 4


def k_quant_blocks(rng, rows: int, k: int, qtype, scale: float = 0.01) -> np.ndarray:
    """Valid random K-quant super-blocks [rows, k / 256 * bytes]: random bytes, with finite float16 d and dmin."""
    size = gguf_packed.REPACKED[qtype]
    b = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)

    def half(lo, hi):
        return rng.uniform(lo, hi, (rows, k // 256)).astype(np.float16).view(np.uint8).reshape(rows, k // 256, 2)

    if qtype == Q.Q4_K:
        b[..., 0:2], b[..., 2:4] = half(scale / 4, scale), half(scale / 4, scale)
    else:
        b[..., 208:210] = half(scale / 4, scale)
    return b.reshape(rows, -1)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_k_quants_repack_to_gguf_dequantize(qtype):
    """Q4_K keeps its nibbles in Q4_1's form (scale and offset rounded to float16); Q6_K's values decode
    exactly and requantise to int8 group 32 within one int8 step (a quarter of one on average)."""
    rng = np.random.default_rng(1)
    rows, k = 7, 768
    raw = k_quant_blocks(rng, rows, k, Q[qtype])
    ref = gguf.quants.dequantize(raw, Q[qtype]).reshape(rows, k)
    packed, scales = gguf_packed.split_blocks(raw, Q[qtype], rows, k)
    got = qp.dequantize(packed, scales, k).numpy()
    if qtype == "Q4_K":
        assert packed.dtype == torch.uint8 and tuple(scales.shape) == (rows, k // 32, 2)
        assert np.all(np.abs(got - ref) <= 2.0 ** -10 * (np.abs(ref) + 1.5))  # float16 scales: 2^-11 each
    else:
        exact = gguf_packed.q6_k_values(torch.from_numpy(raw.reshape(rows, k // 256, 210)), rows, k).numpy()
        assert np.array_equal(exact, ref)
        assert packed.dtype == torch.int8 and tuple(scales.shape) == (rows, k // 32)
        step = scales.float().numpy().repeat(32, 1)
        assert np.all(np.abs(got - ref) < step)  # the scale search may round the largest value a step away
        assert np.abs(got - ref).mean() < 0.3 * step.mean()
    with pytest.raises(ValueError, match="super-blocks"):
        gguf_packed.split_blocks(raw[:, :144], Q[qtype], rows, 128)
    mod = cpu_ops.load()
    if mod is not None:  # the GEMV and GEMM on the repacked blocks against float64 on their values
        for m in (2, 20):
            x = torch.randn(m, k)
            f = mod.quant_gemv if m <= ql.MAX_ROWS else mod.quant_gemm
            y = f(x, packed, scales, torch.empty(0)).double()
            ref64 = qp.gemv_activations(x, k, 32)[0] @ torch.from_numpy(got).double().T
            assert torch.allclose(y, ref64, atol=1e-4, rtol=1e-5)


def test_tiny_k_quant_gguf_runs_packed_like_its_float32_load(tmp_path, caplog):
    """A Q4_K_M-like file (Q4_K projections, Q6_K down projections and embedding, one layer whose v is
    Q6_K beside Q4_K q/k) runs from its repacked blocks, with greedy tokens of its float32 load; the
    mixed projection in int8 group 32."""
    src = load_model_source(str(make_tiny_hf_model(tmp_path, "llama", vocab_size=256, with_tokenizer=False,
                                                   hidden_size=256, intermediate_size=512, num_attention_heads=4,
                                                   num_key_value_heads=2, head_dim=64,
                                                   tie_word_embeddings=True)))
    rng = np.random.default_rng(2)
    raw = {}
    for name, t in src.state_dict.items():
        if t.dim() != 2:
            continue
        qtype = Q.Q6_K if ("down_proj" in name or "embed" in name or name == "model.layers.1.self_attn.v_proj.weight") \
            else Q.Q4_K
        raw[name] = (k_quant_blocks(rng, t.shape[0], t.shape[1], qtype, scale=0.004 if qtype == Q.Q4_K else 0.0008),
                     qtype)
    path = write_tiny_gguf(tmp_path / "m.gguf", src.config, src.state_dict, raw_tensors=raw)
    ref = LLM(model=path, skip_tokenizer_init=True, num_kv_blocks=32, max_model_len=128)
    with caplog.at_level(logging.INFO, logger="servescope.loader"):
        llm = LLM(model=path, skip_tokenizer_init=True, quantization="gguf", num_kv_blocks=32, max_model_len=128)
    assert "Q4_K into Q4_1's form" in caplog.text and "Q6_K into int8 group 32" in caplog.text
    model = llm.engine.runner.executor.model
    layers = model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, ql.QuantLinear) and layers[0].self_attn.qkv_proj.bits == 4
    assert isinstance(layers[0].mlp.down_proj, ql.QuantLinear) and layers[0].mlp.down_proj.bits == 8
    qkv1 = layers[1].self_attn.qkv_proj  # Q4_K q/k beside a Q6_K v: all three requantised to int8 group 32
    assert isinstance(qkv1, ql.QuantLinear) and qkv1.bits == 8 and qkv1.group32
    assert "1:self_attn.q_proj/self_attn.k_proj/self_attn.v_proj" in caplog.text
    assert isinstance(model.model.embed_tokens, ql.QuantEmbedding)
    assert llm.engine.weight_bytes < 0.35 * ref.engine.weight_bytes
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=3)
    prompts = [[5, 9, 33, 2, 100], [7] * 20]
    for a, b in zip(ref.generate(prompts, sp), llm.generate(prompts, sp)):
        assert_greedy_equal_up_to_a_near_tie(a.outputs[0], b.outputs[0], 5e-2)
