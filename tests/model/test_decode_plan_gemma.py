"""Gemma 2 and Gemma 3 (text) in the C++ DecodePlan (csrc/decode_plan_gemma.h, model/plan_gemma.py): the sandwich's
four norms a layer, the GELU-tanh MLP, soft-capped attention scores (Gemma 2), per-head q/k norms and the local
layers' own rotary tables (Gemma 3), sliding windows shorter than the prompts (a block table per group of layers).

Every decode step the plan serves must equal the module path bit for bit (hidden states and KV caches), on tiny
random checkpoints written by transformers (every Gemma part on at once, as tests/engine/test_gemma.py, whose
module path equals transformers), float32 and bfloat16, float weights and int8 / int4 packed ones, at decode
batches 1, 3 and 9. The plan's own checks refuse Gemma parts it cannot compute with a clear error."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from servescope import LLM, SamplingParams
from servescope.kernels import fused_ops
from servescope.kernels.cpu import ops as cpu_ops
from servescope.model import plan_gemma

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="CPU op extension not built here")

sys.path.insert(0, os.path.dirname(__file__))
from decode_plan_check import generate_comparing  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

WINDOW = 8  # shorter than most prompts and than every prompt with its decoded tokens
# Gemma 2: sliding, full, sliding (soft-caps near the tiny model's score sizes, so that capping changes them);
# Gemma 3: sliding, sliding, full, sliding (a pattern of 3: both kinds of layer and both rotary tables)
MODELS = {"gemma2": dict(sliding_window=WINDOW, num_hidden_layers=3, attn_logit_softcapping=0.05,
                         final_logit_softcapping=2.0),
          "gemma3": dict(sliding_window=WINDOW, num_hidden_layers=4, sliding_window_pattern=3)}
SMALL = dict(skip_tokenizer_init=True, num_kv_blocks=64, max_model_len=128)
PROMPTS = [[(i * 7 + j * 13) % 250 + 3 for i in range(n)] for j, n in enumerate((5, 19, 33, 2, 40, 9, 1, 12, 7))]


def _llm(tmp_path, family: str, **kw) -> LLM:
    path = make_tiny_hf_model(tmp_path, family, vocab_size=256, with_tokenizer=False, **MODELS[family])
    return LLM(model=str(path), **SMALL, **kw)


@pytest.mark.parametrize("family", sorted(MODELS))
@pytest.mark.parametrize("dtype,quant", [("float32", None), ("bfloat16", None), ("float32", "int8"),
                                         ("bfloat16", "int8"), ("float32", "int4"), ("bfloat16", "int4")])
def test_plan_matches_module_path_on_gemma(tmp_path, family, dtype, quant):
    llm = _llm(tmp_path, family, dtype=dtype, quantization=quant)
    ex = llm.engine.runner.executor
    plan = ex.decode_plan
    assert plan is not None
    layers = ex.model.model.layers
    assert all(layer.sandwich and layer.mlp.act_mul is fused_ops.gelu_tanh_mul for layer in layers)
    windows = [layer.self_attn.window for layer in layers]
    runs = [w for i, w in enumerate(windows) if i == 0 or w != windows[i - 1]]  # a plan per run of one window
    assert set(windows) == {0, WINDOW} and [s[2] for s in plan.segments] == runs
    local = [bool(layer.spec.attention.rope_theta) for layer in layers]
    assert (plan.rotary_local is not None) == any(local) == (family == "gemma3")
    rows = plan.max_rows
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for n in (1, 3, 9):
        assert generate_comparing(llm, PROMPTS[:n], sp) == ({n: 5} if n <= rows else {})


def test_gemma_parts_follow_the_modules(tmp_path):
    """set_gemma's arguments are the modules' own: the sandwich's extra norm weights (not copies), the MLP's
    activation, the attention's soft-cap; a layer with an activation the plan does not run leaves the model to
    the modules as a whole."""
    llm = _llm(tmp_path, "gemma2")
    model = llm.engine.runner.executor.model
    layer = model.model.layers[0]
    post_attn, post_ff, gelu, softcap, local = plan_gemma.gemma_parts(model, layer)
    assert post_attn.data_ptr() == layer.post_attention_layernorm.weight.data_ptr()
    assert post_ff.data_ptr() == layer.post_feedforward_layernorm.weight.data_ptr()
    assert (gelu, softcap, local) == (True, 0.05, False)
    assert plan_gemma.layer_norms(layer)[1] is layer.pre_feedforward_layernorm
    layer.mlp.act_mul = torch.nn.functional.relu
    assert plan_gemma.gemma_parts(model, layer) is None
    from servescope.model.transforms import cpu_decode_plan

    assert cpu_decode_plan(model) is None


def test_set_gemma_and_local_tables_refuse_bad_input():
    """A clear error, and the layer unchanged: sandwich norms of another width or only one of them, a negative
    soft-cap, an index out of range; a local layer run without the local tables."""
    mod = cpu_ops.load()
    dm, heads, kv_heads, d = 32, 2, 1, 16
    empty = torch.empty(0)
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn((heads + 2 * kv_heads) * d, dm, generator=gen) * 0.1
    o, gate_up, down = (torch.randn(s, generator=gen) * 0.1 for s in ((dm, heads * d), (64, dm), (dm, 32)))
    entry = [t for w in (qkv, o, gate_up, down) for t in (w, empty, empty, empty, empty, empty)]
    layer = [torch.ones(dm), torch.ones(dm), empty, empty, *entry]
    plan = mod.DecodePlan([layer], [[1 << 30, 0] * 4], [0], [None], heads, kv_heads, d, 1e-6, 0.25, [empty])
    with pytest.raises(RuntimeError, match="sandwich"):
        plan.set_gemma(0, torch.ones(dm), empty, True, 0.0, False)
    with pytest.raises(RuntimeError, match="sandwich"):
        plan.set_gemma(0, torch.ones(dm + 1), torch.ones(dm + 1), True, 0.0, False)
    with pytest.raises(RuntimeError, match="softcap"):
        plan.set_gemma(0, empty, empty, False, -1.0, False)
    with pytest.raises(RuntimeError, match="set_gemma"):
        plan.set_gemma(1, empty, empty, False, 0.0, False)
    cache = torch.zeros(4, 16, kv_heads, d)
    run = (torch.randn(1, dm, generator=gen), empty, torch.ones(1, 1, d // 2), torch.zeros(1, 1, d // 2),
           [(cache, cache.clone())], torch.zeros(1, dtype=torch.long), torch.zeros(1, 1, dtype=torch.int32),
           torch.ones(1, dtype=torch.int32))
    before = plan.run_layers(*run, empty, empty)  # the failed calls changed nothing: still a plain layer
    plan.set_gemma(0, empty, empty, False, 0.0, True)
    with pytest.raises(RuntimeError, match="local"):
        plan.run_layers(*run, empty, empty)
    again = plan.run_layers(*run, *run[2:4])  # the local tables equal to the model's: the same layer
    assert all(torch.equal(a, b) for a, b in zip(before, again))
