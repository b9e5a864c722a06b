"""Engine edge cases between the scheduler and the KV cache (issue 3), on the embedded model.
Each test ends with every block free or evictable."""

import pytest

from servescope import SamplingParams
from servescope.errors import EngineConfigError, InvalidParameterError

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _clean(engine):
    engine.kv_manager.check_invariants()
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_used_blocks == 0


def _ids(tok, n, seed_word="harbour"):
    ids = tok.encode(" ".join(f"{seed_word} {i}" for i in range(n)))
    assert len(ids) >= n
    return ids[:n]


@pytest.fixture(scope="module")
def llm(smollm2_llm):
    return smollm2_llm.with_config(num_kv_blocks=128, max_model_len=1024)


def test_prompt_exact_multiple_of_block_size(llm):
    ids = _ids(llm.tokenizer, 64)  # 4 full blocks
    ref = llm.with_config(enable_prefix_caching=False).generate(ids, GREEDY)[0]
    out = llm.generate(ids, GREEDY)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    _clean(llm.engine)


def test_fully_cached_prompt_still_computes_last_logits(llm):
    ids = _ids(llm.tokenizer, 48, "castle")  # 3 full blocks
    first = llm.generate(ids, GREEDY)[0]
    second = llm.generate(ids, GREEDY)[0]
    # everything but the last block hit: the last token is recomputed for its logits
    assert second.num_cached_tokens == 32
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    _clean(llm.engine)


def test_cache_hit_on_block_written_in_the_same_step(llm):
    ids = _ids(llm.tokenizer, 40, "bridge")
    ref = llm.with_config(enable_prefix_caching=False).generate(ids, GREEDY)[0]
    a, b = llm.generate([ids, ids], GREEDY)
    assert b.num_cached_tokens == 32  # the second hit the blocks the first writes in this step
    first_step = list(llm.engine.step_records)[-GREEDY.max_tokens]
    assert first_step.num_prefill_seqs == 2  # both were admitted together
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == ref.outputs[0].token_ids
    _clean(llm.engine)


def test_preempted_request_hits_cache_when_it_returns(llm):
    # three requests of 60 prompt + 36 output tokens need 6 blocks each at the end; 16 blocks hold all
    # three prompts (4 blocks each) but not their growth, so the latest is preempted and recomputed
    small = llm.with_config(num_kv_blocks=16, max_model_len=256, max_num_batched_tokens=256)
    prompts = [_ids(llm.tokenizer, 60, w) for w in ("salt", "wine", "cloth")]
    params = SamplingParams(temperature=0, max_tokens=36, ignore_eos=True)
    ref = [llm.with_config(enable_prefix_caching=False).generate(p, params)[0] for p in prompts]
    outs = small.generate(prompts, params)
    assert small.engine.scheduler.num_preemptions > 0
    hits = [o for o in outs if o.outputs[0].metrics.num_preemptions > 0]
    assert hits and any(o.num_cached_tokens > 0 for o in hits)
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids
    _clean(small.engine)


def test_chunk_size_one(llm):
    tiny_chunks = llm.with_config(block_size=1, num_kv_blocks=2048, max_num_batched_tokens=1,
                                  enable_prefix_caching=False)
    ids = _ids(llm.tokenizer, 12, "road")
    ref = llm.generate(ids, GREEDY)[0]
    out = tiny_chunks.generate(ids, GREEDY)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert max(r.num_tokens for r in tiny_chunks.engine.step_records) == 1
    _clean(tiny_chunks.engine)


def test_n_equals_2_shares_prompt_blocks(llm):
    engine = llm.engine
    ids = _ids(llm.tokenizer, 50, "market")
    engine.add_request("n2", ids, SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=5))
    engine.step()  # both samples prefilled in one step
    b0 = engine.kv_manager.get_block_ids("n2#0")
    b1 = engine.kv_manager.get_block_ids("n2#1")
    assert b0[:3] == b1[:3]  # the three full prompt blocks are shared
    assert all(engine.kv_manager.allocator.ref_count(b) == 2 for b in b0[:3])
    assert b0[3] != b1[3]  # a block that is not full is never shared
    final = None
    while engine.has_unfinished():
        for o in engine.step():
            final = o
    assert final.finished and len(final.outputs) == 2
    assert all(len(c.token_ids) == 5 for c in final.outputs)
    _clean(engine)


@pytest.mark.parametrize("where", ["waiting", "mid-prefill", "decoding"])
def test_abort_frees_blocks(llm, where):
    engine = llm.with_config(max_num_batched_tokens=32, max_num_seqs=1).engine
    ids = _ids(llm.tokenizer, 100, "ship")
    engine.add_request("first", ids, GREEDY)
    engine.add_request("second", ids[:50], GREEDY)
    engine.step()  # "first" takes the only seat with a 32-token chunk; "second" waits
    if where == "waiting":
        target = "second"
    elif where == "mid-prefill":
        target = "first"
    else:
        for _ in range(4):
            engine.step()  # first is now decoding
        assert engine.scheduler.get_request("first").num_output_tokens >= 1
        target = "first"
    assert engine.abort(target)
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.get_block_ids(target) == []
    while engine.has_unfinished():
        engine.step()
    _clean(engine)


@pytest.mark.parametrize("kw, word", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(max_num_seqs=-3), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_num_batched_tokens=8, block_size=16), "below one KV block"),
    (dict(block_size=0), "block_size"),
    (dict(block_size=12), "power of two"),
    (dict(kv_cache_memory_bytes=-1), "kv_cache_memory_bytes"),
    (dict(num_kv_blocks=0), "num_kv_blocks"),
    (dict(num_kv_blocks=4, max_model_len=1024), "could never fit"),
    (dict(kv_cache_memory_bytes=1000, num_kv_blocks=None), "smaller than one block"),
])
def test_nonsense_settings_rejected_at_startup(smollm2_llm, kw, word):
    with pytest.raises(EngineConfigError, match=word):
        smollm2_llm.with_config(**kw)


@pytest.mark.parametrize("prompt, params, param", [
    ("x " * 3000, GREEDY, "prompt"),
    ("hello", SamplingParams(max_tokens=2048), "max_tokens"),
    ([], GREEDY, "prompt"),
    ("", GREEDY, "prompt"),
    ([1, 2, 10 ** 6], GREEDY, "prompt"),
])
def test_bad_requests_rejected_and_nothing_queued(smollm2_llm, prompt, params, param):
    engine = smollm2_llm.engine
    with pytest.raises(InvalidParameterError) as e:
        engine.add_request("bad", prompt, params)
    assert e.value.param == param
    assert not engine.has_unfinished()


@pytest.mark.parametrize("kw, param", [(dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temperature"),
                                       (dict(top_p=0), "top_p"), (dict(top_p=1.5), "top_p"),
                                       (dict(n=0), "n"), (dict(logprobs=21), "logprobs")])
def test_bad_sampling_params(kw, param):
    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(**kw)
    assert e.value.param == param


def test_with_config_shares_weights_not_state(smollm2_llm):
    first = smollm2_llm.engine
    other = first.with_config(num_kv_blocks=32, max_model_len=512)
    assert other.model is first.model and other.tokenizer is first.tokenizer
    assert other.executor is not first.executor and other.runner.kv_caches is not first.runner.kv_caches
    assert other.cache_config.num_blocks == 32 and other.max_model_len == 512
    assert other.config.max_num_seqs == first.config.max_num_seqs  # the settings not given are kept
    for kw in (dict(dtype="bfloat16"), dict(quantization="int8"), dict(model="random:smollm2-135m")):
        with pytest.raises(EngineConfigError, match="with_config cannot change"):
            first.with_config(**kw)


def test_skip_tokenizer_init_takes_token_ids_only(tmp_path):
    """No tokenizer is loaded (the tiny checkpoint has no tokenizer files): token ids in and out, and a
    text prompt is refused with a clear error, nothing queued."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
    from tiny_models import make_tiny_hf_model

    from servescope import LLM

    path = make_tiny_hf_model(tmp_path, "llama_plain", vocab_size=512, with_tokenizer=False)
    llm = LLM(model=str(path), skip_tokenizer_init=True, num_kv_blocks=16, max_model_len=64)
    assert llm.engine.tokenizer is None
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4 and out[0].outputs[0].text == ""
    with pytest.raises(InvalidParameterError, match="no tokenizer"):
        llm.engine.add_request("text", "hello", SamplingParams())
    assert not llm.engine.has_unfinished()


def test_with_config_longer_context_on_random_weights():
    """A random-weight engine loaded with a short max_model_len shares its weights with one of a longer
    context: the rotary tables cover the preset's whole context."""
    import json
    import tempfile
    from pathlib import Path

    from servescope import LLMEngine

    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
           "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
           "num_hidden_layers": 1, "vocab_size": 128, "max_position_embeddings": 512}
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(cfg))
        short = LLMEngine(model=f"random:{path}", max_model_len=64, num_kv_blocks=64, predict_step_cost=False)
    long = short.with_config(max_model_len=400)
    long.add_request("r", [1 + i % 100 for i in range(300)],
                     SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while long.has_unfinished():
        long.step()
