"""Continuous batching changes nothing: the same greedy tokens together as one at a time, with
prefix caching off, with small prefill chunks, and under preemption (issue 3)."""

import random

import pytest

from servescope import SamplingParams

MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def _prompts(tok, n=16, seed=0):
    rng = random.Random(seed)
    system = tok.encode("You are a helpful assistant who answers questions about geography and history. " * 3)
    words = ("river mountain city king war trade salt harbour bridge castle forest winter summer road "
             "market church wall ship").split()
    out = []
    for i in range(n):
        body = tok.encode(" ".join(rng.choice(words) for _ in range(rng.randint(1, 60))))
        out.append((system + body) if i % 2 == 0 else body)  # half share a 3-block system prefix
    return out


def assert_same_greedy(a_outs, b_outs):
    """vLLM's rule: equal tokens, except that at a near-tie the first divergent token of each side
    must be among the other side's top-5 logprobs; comparison stops there."""
    for a, b in zip(a_outs, b_outs):
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        for i, (x, y) in enumerate(zip(ta, tb)):
            if x != y:
                top_a = {t for t, _ in a.outputs[0].logprobs[i].top}
                top_b = {t for t, _ in b.outputs[0].logprobs[i].top}
                assert y in top_a and x in top_b, f"{a.request_id}: token {i} differs ({x} vs {y}), not a near-tie"
                break
        else:
            assert len(ta) == len(tb) == MAX_TOKENS


@pytest.fixture(scope="module")
def prompts(smollm2_llm):
    return _prompts(smollm2_llm.tokenizer)


@pytest.fixture(scope="module")
def one_at_a_time(smollm2_llm, prompts):
    llm = smollm2_llm.with_config(enable_prefix_caching=False)
    return [llm.generate(p, PARAMS)[0] for p in prompts]


def _check_clean(engine):
    engine.kv_manager.check_invariants()
    assert not engine.has_unfinished()
    assert engine.kv_manager.num_used_blocks == 0  # all free or evictable


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(enable_prefix_caching=False),
    dict(max_num_batched_tokens=16),
    dict(max_num_batched_tokens=64),
], ids=["batched", "no-prefix-cache", "chunk16", "chunk64"])
def test_batching_changes_nothing(smollm2_llm, prompts, one_at_a_time, overrides):
    llm = smollm2_llm.with_config(**overrides)
    outs = llm.generate(prompts, PARAMS)
    assert_same_greedy(outs, one_at_a_time)
    recs = list(llm.engine.step_records)
    assert max(r.num_running for r in recs) > 1  # really batched
    if "max_num_batched_tokens" in overrides:
        assert max(r.num_tokens for r in recs) <= overrides["max_num_batched_tokens"]
        assert any(r.phase == "mixed" for r in recs)  # prefill chunks ride along with decodes
    if not overrides:
        assert llm.engine.kv_manager.prefix_cache_hits > 0
    _check_clean(llm.engine)


def test_batching_under_preemption(smollm2_llm, prompts, one_at_a_time):
    # 24 blocks of 16 tokens: far less than the 16 requests need at once (about 40 with their shared
    # prefix), more than any one needs (7)
    llm = smollm2_llm.with_config(num_kv_blocks=24, max_model_len=384)
    outs = llm.generate(prompts, PARAMS)
    assert llm.engine.scheduler.num_preemptions > 0
    assert_same_greedy(outs, one_at_a_time)
    _check_clean(llm.engine)
