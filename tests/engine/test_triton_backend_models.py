"""Whole models on the Triton attention backend (paged decode and paged prefill kernels; in Triton's interpreter
on a machine without CUDA) equal the same models on the torch backend: tiny random Llama (GQA), Gemma 2 (every
other layer windowed, soft-capped scores) and gpt-oss (windows, sinks, experts), float32.

Per position logits through chunked prefill (chunks of 24 crossing the windows of 16) and decode steps within
1e-4; greedy tokens equal for several prompts scheduled together in chunks of 16 tokens (mixed steps: decodes
first, then prefill chunks)."""

import os
import sys

import pytest
import torch

from helpers import paged_logits, random_ids
from servescope import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402
from triton_interp import interpreted  # noqa: E402

interpreted("servescope.kernels.triton.attention", "servescope.kernels.triton.prefill",
            "servescope.model.attention.triton_backend")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-4
WINDOW = 16
MODELS = {"llama": dict(),
          "gemma2": dict(sliding_window=WINDOW, attn_logit_softcapping=0.05, final_logit_softcapping=2.0),
          "gpt_oss": dict(sliding_window=WINDOW)}


@pytest.fixture(scope="module", params=sorted(MODELS))
def engines(request, tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp(request.param), request.param, **MODELS[request.param])
    kw = dict(model=str(path), num_kv_blocks=64, max_model_len=512, device=DEV)
    return {name: LLM(attention_backend=name, **kw) for name in ("torch", "triton")}


def test_backend_is_triton(engines):
    assert engines["triton"].engine.runner.backend.name == "triton"


def test_logits_equal_the_torch_backend(engines):
    ids = random_ids(72, 1)
    logits = {name: paged_logits(llm.engine, ids, chunk=24, decode_from=60) for name, llm in engines.items()}
    diff = (logits["triton"] - logits["torch"]).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.2e}"


def test_batched_chunked_greedy_tokens_equal_the_torch_backend(engines):
    prompts = [random_ids(n, seed) for n, seed in ((40, 2), (25, 3), (33, 4))]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = {name: [o.outputs[0].token_ids for o in llm.with_config(max_num_batched_tokens=16).generate(prompts, sp)]
            for name, llm in engines.items()}
    assert outs["triton"] == outs["torch"]
