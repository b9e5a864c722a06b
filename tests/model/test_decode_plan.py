"""The C++ DecodePlan (csrc/cpu_ops.cpp, model/transforms.cpu_decode_plan): all layers of a small decode
step in one call. It must issue the same kernels as the modules' forward, so the logits of every
step must be bit-for-bit those of the module path: float32, bfloat16 and int8 weights, biases (Qwen2),
per-head q/k norms (Qwen3), head dims on both attention kernels (16: generic, 64: register-tiled),
decode batches of 1..7 sequences with different context lengths (the GEMV and oneDNN's GEMM)."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from servescope.kernels.cpu import linear as cpu_linear
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model.linears import packed as quant_linear

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")

sys.path.insert(0, os.path.dirname(__file__))
from decode_plan_check import generate_comparing  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402


@pytest.mark.parametrize("family,head_dim,dtype,quant", [
    ("llama_plain", 16, "float32", None),
    ("llama_plain", 64, "float32", None),
    ("llama_plain", 64, "bfloat16", None),
    ("llama", 64, "float32", "int8"),
    ("llama", 16, "bfloat16", "int8"),
    ("qwen2", 64, "float32", None),
    ("qwen2", 16, "bfloat16", "int8"),
    ("qwen3", 64, "bfloat16", None),
    ("qwen3", 16, "float32", "int8"),
    ("llama", 64, "float32", "int4"),
    ("qwen2", 16, "bfloat16", "int4-g64-asym"),
    ("llama_plain", 64, "float32", "int8-g32"),
])
def test_decode_plan_matches_module_path_bit_for_bit(tmp_path, monkeypatch, family, head_dim, dtype, quant):
    from servescope import LLM, SamplingParams

    path = make_tiny_hf_model(tmp_path, family, vocab_size=512, with_tokenizer=False, head_dim=head_dim,
                              num_hidden_layers=3)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, quantization=quant, num_kv_blocks=64,
              max_model_len=256)
    ex = llm.engine.runner.executor
    assert ex.decode_plan is not None
    rows = ex.decode_plan.max_rows
    # float32: the GEMV at 1 row, the panel GEMM up to PANEL_MAX_ROWS, oneDNN's prepacked GEMM above;
    # bfloat16: the GEMV up to 2 rows, oneDNN above, where oneDNN takes the dtype (bfloat16 needs
    # AVX512-BF16 / AMX: on an AVX2 CPU the plan stops at the GEMV's 2 rows);
    # int8: the GEMV up to 16 rows, and the modules above (eager dequantisation)
    # packed group-32 int4 / int8 (model/linears/packed.py): quant_gemv up to group32_max_rows, other groups
    # up to MAX_ROWS
    onednn = cpu_linear.pack_for_onednn(torch.zeros(64, 64, dtype=getattr(torch, dtype))) is not None
    panel = cpu_linear.PANEL_MAX_ROWS if dtype == "float32" else 0
    dense = 1 << 30 if onednn else max(cpu_linear.MAX_ROWS[getattr(torch, dtype)], panel)
    g32 = quant_linear.group32_max_rows(getattr(torch, dtype))
    packed = quant_linear.MAX_ROWS if quant and "g64" in quant else g32
    assert rows == ({"int8": 16}.get(quant, packed) if quant else dense)
    # prompts of different lengths (different context lengths in one decode batch, one crossing a
    # 16-token block); batches on both sides of each GEMV limit
    prompts = [[(i * 7 + j * 13) % 500 + 3 for i in range(n)] for j, n in enumerate((5, 19, 33, 2, 40, 9, 1))]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for n in (1, 2, 3, 7):
        calls = generate_comparing(llm, prompts[:n], sp)
        # every decode step the plan serves went through it (the others: the modules, compared all the same)
        assert calls == ({n: 11} if n <= rows else {}), calls


@pytest.mark.parametrize("dtype,quant", [("bfloat16", "int4"), ("float32", "int8-g32"),
                                         ("bfloat16", "int4-g32-asym")])
def test_decode_plan_matches_modules_on_packed_batches(tmp_path, dtype, quant):
    """Packed group-32 weights at decode batches on every kernel of quant_gemv (the streaming and
    weight-stationary VNNI orders, AMX-INT8 tiles where the CPU has them: 3, 9 and 20 rows): the plan's
    steps bit for bit those of the modules."""
    from servescope import LLM, SamplingParams

    path = make_tiny_hf_model(tmp_path, "llama", vocab_size=512, with_tokenizer=False, head_dim=64,
                              num_hidden_layers=2)
    llm = LLM(model=str(path), skip_tokenizer_init=True, dtype=dtype, quantization=quant, num_kv_blocks=128,
              max_model_len=64)
    g32 = quant_linear.group32_max_rows(getattr(torch, dtype))
    assert llm.engine.runner.executor.decode_plan.max_rows == g32
    prompts = [[(i * 7 + j * 13) % 500 + 3 for i in range(2 + j % 9)] for j in range(20)]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for n in (3, 9, 20):
        assert generate_comparing(llm, prompts[:n], sp) == {n: 3}


def test_decode_plan_limited_to_the_int8_gemv(tmp_path, monkeypatch):
    """int8 above 16 rows: the modules (eager dequantisation), not the plan."""
    from servescope import LLM, SamplingParams

    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    llm = LLM(model=str(path), skip_tokenizer_init=True, quantization="int8", num_kv_blocks=64, max_model_len=64)
    prompts = [[(i * 5 + j) % 500 + 3 for i in range(4)] for j in range(17)]
    calls = generate_comparing(llm, prompts, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert calls == {}, calls


def test_decode_plan_not_built_without_the_extension(tmp_path, monkeypatch):
    from servescope import LLM

    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    monkeypatch.setattr(cpu_ops._EXT, "mod", None)
    llm = LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=64)
    assert llm.engine.runner.executor.decode_plan is None
