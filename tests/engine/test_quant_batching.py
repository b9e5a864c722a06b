"""Packed int4 / int8 weights change nothing that batching, chunked prefill or preemption touch: the same
greedy tokens together as one at a time (the rule of test_batching.py), on a tiny random model."""

import os
import sys

import pytest

from servescope import LLM, SamplingParams

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from test_batching import MAX_TOKENS, assert_same_greedy  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
PROMPTS = [[(i * 7 + j * 13) % 500 + 3 for i in range(n)]
           for j, n in enumerate((5, 19, 33, 2, 40, 9, 1, 27, 12, 3, 50, 8))]


@pytest.fixture(scope="module", params=["int4"])  # int8 and asymmetric forms: test_decode_plan.py
def qllm(request, tmp_path_factory):
    path = make_tiny_hf_model(tmp_path_factory.mktemp("q"), "llama", vocab_size=512, with_tokenizer=False,
                              num_hidden_layers=2)
    return LLM(model=str(path), skip_tokenizer_init=True, quantization=request.param, num_kv_blocks=128,
               max_model_len=256, enable_prefix_caching=False)


@pytest.mark.parametrize("overrides", [dict(), dict(max_num_batched_tokens=16),
                                       dict(num_kv_blocks=8, max_model_len=128)],
                         ids=["batched", "chunk16", "preempt"])
def test_quantized_batching_changes_nothing(qllm, overrides):
    alone = [qllm.generate(p, PARAMS)[0] for p in PROMPTS]
    llm = qllm.with_config(**overrides)
    outs = llm.generate(PROMPTS, PARAMS)
    assert_same_greedy(outs, alone)
    assert max(r.num_running for r in llm.engine.step_records) > 1
    if "num_kv_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.num_used_blocks == 0


def test_unknown_mode_is_a_clear_error():
    from servescope.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="quantization must be"):
        LLM(model="random:tiny", quantization="int5")
