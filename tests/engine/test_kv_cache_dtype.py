"""kv_cache_dtype int8 / fp8_e4m3 through the engine: the tokens it holds in a memory budget, the bytes
the engine, the StepRecords and the cost model count, greedy tokens unchanged by batching, chunked
prefill, prefix caching and preemption (as in float32), the C++ decode plan equal to the module path
bit for bit, and bad settings refused before anything is built."""

import os
import sys

import pytest
import torch

from servescope import LLM, SamplingParams
from servescope.analysis.op_counts import kv_cache_bytes_per_token
from servescope.analysis.presets import load_preset
from servescope.errors import EngineConfigError
from servescope.model.attention import kv_quant

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
sys.path.insert(0, os.path.dirname(__file__))
from test_batching import MAX_TOKENS, assert_same_greedy  # noqa: E402
from tiny_models import make_tiny_hf_model  # noqa: E402

PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
PROMPTS = [[(i * 7 + j * 13) % 500 + 3 for i in range(n)]
           for j, n in enumerate((5, 19, 33, 2, 40, 9, 1, 27, 12, 3, 50, 8))]


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("kv"), "llama", vocab_size=512, with_tokenizer=False,
                                  num_hidden_layers=2))


@pytest.fixture(scope="module")
def int8_llm(tiny_path):
    return LLM(model=tiny_path, skip_tokenizer_init=True, kv_cache_dtype="int8", num_kv_blocks=128,
               max_model_len=256, enable_prefix_caching=False)


def test_capacity_in_a_memory_budget(tiny_path):
    budget = 1 << 20
    blocks = {}
    for dt in ("float32", "bfloat16", "int8", "fp8_e4m3") if kv_quant.FP8 is not None else ("float32", "int8"):
        llm = LLM(model=tiny_path, skip_tokenizer_init=True, kv_cache_dtype=dt, kv_cache_memory_bytes=budget,
                  max_model_len=128)
        state = llm.engine.kv_cache_state()
        blocks[dt] = state["num_blocks"]
        # the engine's count is the tensors' bytes: D = 16 values + a 4-byte scale per row when quantised
        per_row = {"float32": 64, "bfloat16": 32}.get(dt, 20)
        assert state["bytes_per_token"] == 2 * 2 * 2 * per_row  # K and V x 2 layers x 2 KV heads
        assert state["total_bytes"] == state["num_blocks"] * 16 * state["bytes_per_token"] <= budget
    assert blocks["int8"] / blocks["float32"] >= 3.1  # 64 / 20 bytes per row at head dim 16
    # SmolLM2 (head dim 64): 68 bytes per row against 256, 3.76x the tokens; the analysis counts the same
    smol = load_preset("smollm2-135m")
    assert kv_cache_bytes_per_token(smol, "float32") / kv_cache_bytes_per_token(smol, "int8") == pytest.approx(256 / 68)
    assert kv_cache_bytes_per_token(smol, "int8") == kv_cache_bytes_per_token(smol, "fp8_e4m3") == 2 * 30 * 3 * 68


def test_step_records_and_predictions_count_the_quantised_bytes(int8_llm):
    llm = int8_llm.with_config(num_kv_blocks=64)
    llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    per_tok = llm.engine.kv_bytes_per_token
    assert per_tok == 2 * 2 * 2 * 20
    recs = llm.engine.step_records
    assert all(r.kv_bytes_used == r.kv_blocks_used * 16 * per_tok for r in recs)
    decode = [r for r in recs if r.phase == "decode"][-1]
    assert decode.bytes_by_group["kv_read"] == pytest.approx(sum(c - 1 for c in decode.context_lens) * per_tok)
    assert decode.bytes_by_group["kv_write"] == pytest.approx(decode.num_tokens * per_tok)


@pytest.mark.parametrize("overrides", [dict(), dict(max_num_batched_tokens=16),
                                       dict(num_kv_blocks=8, max_model_len=128),
                                       dict(enable_prefix_caching=True)],
                         ids=["batched", "chunk16", "preempt", "prefix"])
def test_int8_kv_greedy_unchanged_by_batching_chunking_preemption_prefix_caching(int8_llm, overrides):
    alone = [int8_llm.generate(p, PARAMS)[0] for p in PROMPTS]
    llm = int8_llm.with_config(**overrides)
    prompts = PROMPTS
    if "enable_prefix_caching" in overrides:  # prompts sharing a 32-token prefix (two full blocks)
        shared = PROMPTS[10][:32]
        prompts = [shared + p for p in PROMPTS[:6]]
        alone = [int8_llm.generate(p, PARAMS)[0] for p in prompts]
        llm.generate(prompts[:1], PARAMS)  # warm the cache
    outs = llm.generate(prompts, PARAMS)
    assert_same_greedy(outs, alone)
    assert max(r.num_running for r in llm.engine.step_records) > 1
    if "num_kv_blocks" in overrides:
        assert llm.engine.scheduler.num_preemptions > 0
    if "enable_prefix_caching" in overrides:
        assert llm.engine.kv_manager.prefix_cache_hits > 0
    assert llm.engine.kv_manager.num_used_blocks == 0


def test_int8_kv_changes_tokens_little_against_float32(int8_llm, tiny_path):
    """The cache is really quantised (the logprobs move) and stays close to float32."""
    f32 = LLM(model=tiny_path, skip_tokenizer_init=True, num_kv_blocks=128, max_model_len=256)
    a = f32.generate(PROMPTS[:4], PARAMS)
    b = int8_llm.generate(PROMPTS[:4], PARAMS)
    assert_same_greedy(a, b)
    la, lb = [], []
    for oa, ob in zip(a, b):  # the logprobs of the same tokens, up to a first (near-tie) divergence
        for x, y in zip(oa.outputs[0].logprobs, ob.outputs[0].logprobs):
            if x.token_id != y.token_id:
                break
            la.append(x.logprob)
            lb.append(y.logprob)
    assert len(la) >= 16 and la != lb and max(abs(x - y) for x, y in zip(la, lb)) < 0.05


@pytest.mark.parametrize("bad,match", [("int4", "kv_cache_dtype must be one of"),
                                       ("e5m2", "kv_cache_dtype must be one of")])
def test_unknown_kv_dtype_is_a_clear_error(bad, match):
    with pytest.raises(EngineConfigError, match=match):
        LLM(model="random:tiny", kv_cache_dtype=bad)


def test_fp8_without_torch_float8_is_refused_before_loading(monkeypatch):
    from servescope.engine import builder

    monkeypatch.setattr(kv_quant, "FP8", None)
    loads = []
    monkeypatch.setattr(builder, "load_model", lambda *a, **k: loads.append(a))  # the builder's own name
    with pytest.raises(EngineConfigError, match="float8_e4m3fn"):
        LLM(model="random:tiny", kv_cache_dtype="fp8_e4m3")
    assert not loads


def test_decode_plan_serves_int8_kv_bit_for_bit(tiny_path):
    from servescope.kernels.cpu import ops as cpu_ops

    if not cpu_ops.available():
        pytest.skip("CPU op extension not built here")
    from decode_plan_check import generate_comparing

    llm = LLM(model=tiny_path, skip_tokenizer_init=True, kv_cache_dtype="int8", num_kv_blocks=64, max_model_len=256)
    assert llm.engine.runner.executor.decode_plan is not None
    calls = generate_comparing(llm, PROMPTS[:3], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert calls == {3: 5}, calls
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
