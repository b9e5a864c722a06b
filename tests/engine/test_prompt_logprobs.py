"""Prompt logprobs from the prefill: equal to transformers' log_softmax over the same prompt, with
chunked prefill, a prefix-cache hit that must not skip positions, batching and n > 1."""

import pytest
import torch

from servescope import LLM, SamplingParams

TOL = 2e-4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from transformers import AutoModelForCausalLM
    from tiny_models import make_tiny_hf_model

    path = make_tiny_hf_model(tmp_path_factory.mktemp("plp"), "llama")
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return str(path), hf


def _reference(hf, ids, k):
    with torch.no_grad():
        lp = hf(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [P, V]
    rows = []
    for p in range(len(ids) - 1):
        top = lp[p].topk(k) if k else None
        rows.append((lp[p, ids[p + 1]].item(), top))
    return rows


def _check(out, ref, ids, k):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for p, (entry, (want, top)) in enumerate(zip(plp[1:], ref)):
        assert entry.token_id == ids[p + 1]
        assert abs(entry.logprob - want) <= TOL, (p, entry.logprob, want)
        assert len(entry.top) == k
        if k:
            assert [t for t, _ in entry.top] == top.indices.tolist()[:k] or \
                max(abs(a - b) for (_, a), b in zip(entry.top, top.values.tolist())) <= TOL


def test_prompt_logprobs_match_transformers_chunked_cached_batched(tiny):
    path, hf = tiny
    g = torch.Generator().manual_seed(3)
    long_ids = torch.randint(3, 49152, (150,), generator=g).tolist()
    short = torch.randint(3, 49152, (9,), generator=g).tolist()
    # chunks of 64 tokens: the long prompt's logprobs come from three steps
    llm = LLM(model=path, num_kv_blocks=64, max_model_len=512, max_num_batched_tokens=64,
              enable_prefix_caching=True)
    plain = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    llm.generate([long_ids], plain)  # fills the prefix cache with the long prompt's blocks
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=3)
    outs = llm.generate([long_ids, short], params)
    _check(outs[0], _reference(hf, long_ids, 3), long_ids, 3)
    _check(outs[1], _reference(hf, short, 3), short, 3)
    # the cached prefix was not reused for it, and the outputs match a plain run's
    assert outs[0].num_cached_tokens == 0
    assert outs[0].outputs[0].token_ids == llm.generate([long_ids], params.replace(prompt_logprobs=None))[0] \
        .outputs[0].token_ids[:3]
    assert llm.engine.kv_manager.num_used_blocks == 0


def test_prompt_logprobs_n_samples_and_zero_top(tiny):
    path, hf = tiny
    ids = list(range(10, 40))
    llm = LLM(model=path, num_kv_blocks=64, max_model_len=512)
    out = llm.generate([ids], SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=2, prompt_logprobs=0))[0]
    assert len(out.outputs) == 3
    _check(out, _reference(hf, ids, 0), ids, 0)


def test_prompt_logprobs_bad_value_rejected():
    from servescope.errors import InvalidParameterError

    with pytest.raises(InvalidParameterError) as e:
        SamplingParams(prompt_logprobs=21)
    assert e.value.param == "prompt_logprobs"


def test_prompt_logprobs_survive_preemption(tiny):
    path, _ = tiny
    prompts = [list(range(200 + 50 * i, 240 + 50 * i)) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1)
    roomy = LLM(model=path, num_kv_blocks=64, max_model_len=256, block_size=16).generate(prompts, params)
    tight = LLM(model=path, num_kv_blocks=8, max_model_len=128, block_size=16)
    outs = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0  # the recompute path ran
    for a, b in zip(roomy, outs):
        assert len(b.prompt_logprobs) == len(a.prompt_logprobs) == 40  # scored once, not again on recompute
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= TOL
