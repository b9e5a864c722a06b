"""The C++ DecodePlan over sparse layers (csrc/decode_plan_moe.h, model/transforms._sparse_mlp): the router,
the softmax top-k routing (renormalised or not), the fused experts (MoePacked, MoeDense), Qwen2-MoE's gated
shared expert and OLMoE's q/k norm over all heads, in one call with the dense parts. Every decode step the plan
serves must equal the module path bit for bit (hidden states and KV cache), on tiny random MoE models with
packed experts (--quantization modes and a Q4_0 GGUF), float experts (float32, bfloat16: the checkpoint as it
loads) and per-channel int8 ones (--quantization int8), at decode batches on both sides of the kernels' row
limits; gpt-oss whole (sinks, q/k/v/o biases, windows shorter than the prompts, its router, its clamped experts
float, under --quantization int4 / int8 and as released in MXFP4);
the step records' expert fields must be those of an engine without the plan; a layer the plan cannot compute
as the modules do leaves the model to the modules."""

from __future__ import annotations

import os
import sys

import gguf
import pytest

from servescope import LLM, SamplingParams
from servescope.kernels.cpu import ops as cpu_ops
from servescope.loader.source import load_model_source
from servescope.model.moe import Experts, PackedExperts, moe_blocks
from servescope.model.moe_clamped import PackedClampedExperts

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")

sys.path.insert(0, os.path.dirname(__file__))
from decode_plan_check import generate_comparing  # noqa: E402
from tiny_gguf import write_tiny_moe_gguf  # noqa: E402
from tiny_models import make_tiny_hf_model, make_tiny_mxfp4_gpt_oss  # noqa: E402

# Qwen2-MoE's shared expert at a width of whole 32-blocks (the packed modes' group); gpt-oss's window shorter
# than most prompts (its sliding layers read only their last 8 positions)
OVERRIDES = {"qwen2_moe": {"shared_expert_intermediate_size": 64}, "gpt_oss": {"sliding_window": 8}}
SMALL = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128)
PROMPTS = [[(i * 7 + j * 13) % 250 + 3 for i in range(n)] for j, n in enumerate((5, 19, 33, 2, 40, 9, 1, 12, 7))]


def _checkpoint(tmp_path, family: str):
    return make_tiny_hf_model(tmp_path, family, vocab_size=256, with_tokenizer=False, **OVERRIDES.get(family, {}))


def _sparse_in_plan(llm) -> bool:
    """The engine has a plan and every sparse layer's experts run the fused op."""
    ex = llm.engine.runner.executor
    blocks = moe_blocks(ex.model)
    return ex.decode_plan is not None and bool(blocks) and all(b.experts.fused_op() is not None for _, b in blocks)


@pytest.mark.parametrize("family,dtype,quant", [
    ("olmoe", "float32", "int4"),  # no renormalisation, q/k norms over all heads
    ("olmoe", "bfloat16", "int8-g32"),
    ("qwen2_moe", "float32", "int4"),  # gated shared expert, a dense first layer
    ("qwen2_moe", "bfloat16", "int4-g32-asym"),
    ("qwen3_moe", "bfloat16", "int4"),  # renormalised, per-head q/k norms, a dense second layer
    ("mixtral", "float32", "int8-g32"),  # renormalised
    ("mixtral", "bfloat16", None),  # float experts, as the checkpoint loads
    ("olmoe", "float32", None),
    ("qwen2_moe", "bfloat16", None),
    ("qwen3_moe", "float32", None),
    ("olmoe", "bfloat16", "int8"),  # per-channel int8 experts
    ("qwen2_moe", "float32", "int8"),
    ("qwen3_moe", "bfloat16", "int8"),
    ("gpt_oss", "float32", None),  # sinks, q/k/v/o biases, alternating windows, biased router, clamped experts
    ("gpt_oss", "bfloat16", None),
    ("gpt_oss", "float32", "int4"),  # PackedClampedExperts (MoePacked, act 1)
    ("gpt_oss", "bfloat16", "int4"),
    ("gpt_oss", "float32", "int8"),  # PackedClampedExperts of Int8Linears (MoeDense, act 1)
    ("gpt_oss", "bfloat16", "int8"),
])
def test_plan_matches_module_path_on_sparse_layers(tmp_path, family, dtype, quant):
    llm = LLM(model=str(_checkpoint(tmp_path, family)), dtype=dtype, quantization=quant, **SMALL)
    assert _sparse_in_plan(llm)
    rows = llm.engine.runner.executor.decode_plan.max_rows
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for n in (1, 3, 9):  # the kernels' row orders and limits (packed: streaming, weight-stationary, AMX)
        assert generate_comparing(llm, PROMPTS[:n], sp) == ({n: 5} if n <= rows else {})


def test_plan_matches_module_path_on_a_q4_0_gguf(tmp_path):
    """A llama.cpp-style OLMoE file run on its own blocks (quantization="gguf"), as the real-shape benchmark."""
    src = load_model_source(str(_checkpoint(tmp_path, "olmoe")))
    path = write_tiny_moe_gguf(tmp_path / "olmoe-q4_0.gguf", src, qtype=gguf.GGMLQuantizationType.Q4_0)
    llm = LLM(model=path, quantization="gguf", **SMALL)
    assert _sparse_in_plan(llm)
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert generate_comparing(llm, PROMPTS[:4], sp) == {4: 4}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_plan_matches_module_path_on_an_mxfp4_gpt_oss(tmp_path, dtype):
    """gpt-oss as released: its experts kept in their MXFP4 blocks (PackedClampedExperts on MoePacked, act 1)."""
    path = make_tiny_mxfp4_gpt_oss(tmp_path, vocab_size=256, with_tokenizer=False, **OVERRIDES["gpt_oss"])[0]
    llm = LLM(model=str(path), dtype=dtype, **SMALL)
    assert _sparse_in_plan(llm)
    assert all(isinstance(b.experts, PackedClampedExperts) for _, b in moe_blocks(llm.engine.runner.executor.model))
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    assert generate_comparing(llm, PROMPTS[:3], sp) == {3: 4}


def _moe_fields(llm) -> list:
    return [(r.moe_experts_active, r.moe_tokens_per_expert, r.moe_imbalance, r.moe_expert_bytes)
            for r in llm.engine.step_records]


@pytest.mark.parametrize("family", ["olmoe", "qwen2_moe"])
def test_step_records_count_the_same_experts_with_and_without_the_plan(tmp_path, family):
    """The plan counts each step's tokens per expert into the blocks, as the modules do: the records' expert
    fields (and the tokens) equal an engine's whose plan is switched off, step by step."""
    path = str(_checkpoint(tmp_path, family))
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for use_plan in (True, False):
        llm = LLM(model=path, quantization="int4", max_num_seqs=4, **SMALL)
        ex = llm.engine.runner.executor
        assert ex.decode_plan is not None
        calls = []
        plan_run = ex.decode_plan.run_layers
        ex.decode_plan.run_layers = lambda h, *a: calls.append(h.shape[0]) or plan_run(h, *a)
        if not use_plan:
            ex.layer_paths = [ex.model]
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:6], sp)]
        assert bool(calls) == use_plan
        runs.append((tokens, _moe_fields(llm)))
    (tokens, fields), (ref_tokens, ref_fields) = runs
    assert tokens == ref_tokens
    assert fields == ref_fields and all(f[0] for f in fields)  # every step routed something


def test_plan_refuses_layers_it_cannot_compute(tmp_path, monkeypatch):
    """Experts with their fused op switched off (the reference path), float or packed: no plan, the modules
    serve every step."""
    path = str(_checkpoint(tmp_path, "qwen3_moe"))
    monkeypatch.setattr(Experts, "fused", False)
    assert LLM(model=path, **SMALL).engine.runner.executor.decode_plan is None
    monkeypatch.setattr(PackedExperts, "fused", False)
    assert LLM(model=path, quantization="int4", **SMALL).engine.runner.executor.decode_plan is None
    assert LLM(model=path, quantization="int8", **SMALL).engine.runner.executor.decode_plan is None
