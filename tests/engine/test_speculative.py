"""Speculative decoding changes no greedy output (every family of the parity tests, batched, chunked,
preempted; n-gram and draft proposers), keeps stops / max_tokens / min_tokens / logprobs / n > 1 working
with several tokens per step, leaks no KV block when requests are aborted between proposal and
verification, and rejects bad settings with a clear error."""

import pytest
import torch

from servescope import LLM, SamplingParams
from servescope.config import SpeculativeConfig
from servescope.errors import EngineConfigError

GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}


def _prompts():
    g = torch.Generator().manual_seed(5)
    motif = torch.randint(3, 49152, (12,), generator=g).tolist()
    return [motif * 4, torch.randint(3, 49152, (70,), generator=g).tolist(), [100, 200, 300, 100, 200]]


@pytest.fixture(scope="module")
def tiny_paths(tmp_path_factory):
    from tiny_models import make_tiny_hf_model

    root = tmp_path_factory.mktemp("spec")
    return {f: str(make_tiny_hf_model(root / f, f)) for f in ["llama", "llama_plain", "mistral", "qwen2", "qwen3"]}


def _clean(llm):
    km = llm.engine.kv_manager
    km.check_invariants()
    assert not llm.engine.has_unfinished() and km.num_used_blocks == 0


def _spec(llm, spec: dict, **overrides):
    """An engine on llm's weights with speculative settings (vLLM-style keys) and other overrides."""
    return LLM.from_engine(llm.engine.with_config(speculative=SpeculativeConfig.from_dict(spec), **overrides))


# batched (3 prompts), chunked (32-token steps) and preempted (8 blocks of 16 for 3 sequences of ~100)
CHUNKED_PREEMPTED = dict(num_kv_blocks=8, max_model_len=128, max_num_batched_tokens=32)


@pytest.mark.parametrize("family", ["llama", "llama_plain", "mistral", "qwen2", "qwen3"])
def test_greedy_equal_with_ngram_batched_chunked_preempted(tiny_paths, family):
    base = LLM(model=tiny_paths[family], num_kv_blocks=64, max_model_len=256)
    want = [o.outputs[0].token_ids for o in base.generate(_prompts(), GREEDY)]
    for overrides in ([dict(), CHUNKED_PREEMPTED] if family == "llama" else [CHUNKED_PREEMPTED]):
        spec = _spec(base, NGRAM, **overrides)
        got = spec.generate(_prompts(), GREEDY)
        assert [o.outputs[0].token_ids for o in got] == want, (family, overrides)
        s = spec.engine.spec
        assert s.num_accepted_tokens > 0 and s.num_draft_tokens > s.num_accepted_tokens  # both paths taken
        assert spec.engine.scheduler.num_preemptions > 0 or not overrides
        assert max(r.num_prefill_tokens for r in spec.engine.step_records) <= (32 if overrides else 1024)
        _clean(spec)


def test_greedy_equal_with_int8_draft_under_preemption(tiny_paths):
    path = tiny_paths["llama"]
    base = LLM(model=path, num_kv_blocks=64, max_model_len=256)
    want = [o.outputs[0].token_ids for o in base.generate(_prompts(), GREEDY)]
    spec = _spec(base, {"method": "draft", "num_speculative_tokens": 3, "quantization": "int8", "adaptive": False},
                 **CHUNKED_PREEMPTED)
    got = spec.generate(_prompts(), GREEDY)
    assert [o.outputs[0].token_ids for o in got] == want
    assert spec.engine.scheduler.num_preemptions > 0
    assert spec.engine.spec.acceptance_rate > 0.5  # an int8 copy agrees with its float32 target mostly
    m = got[0].outputs[0].metrics
    assert m.num_draft_tokens > 0 and m.spec_acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
    _clean(spec)
    sampled = spec.generate(_prompts(), SamplingParams(temperature=0.9, max_tokens=30, ignore_eos=True, seed=1))
    assert [len(o.outputs[0].token_ids) for o in sampled] == [30] * 3
    _clean(spec)


def test_self_draft_reads_the_target_kv_and_an_own_cache_draft_agrees(tiny_paths):
    """A self-draft (the target's weights) shares the target's KV cache, allocating none: unquantised it is
    the target itself, so (bar rounding near ties) every greedy draft is accepted, which it could not be if
    it attended over wrong KV; a draft given by path keeps its own cache, catching up on the prompt."""
    path = tiny_paths["llama"]
    base = LLM(model=path, num_kv_blocks=64, max_model_len=256)
    want = [o.outputs[0].token_ids for o in base.generate(_prompts(), GREEDY)]
    same = _spec(base, {"method": "draft", "num_speculative_tokens": 3, "adaptive": False}, **CHUNKED_PREEMPTED)
    prop = same.engine.spec.proposer
    assert prop.shares_target_kv and prop.runner.kv_caches is same.engine.runner.kv_caches
    ex, served = prop.runner.executor, []
    layers_for = ex.layers_for
    ex.layers_for = lambda *a: served.append(layers_for(*a) is ex.decode_plan) or layers_for(*a)
    assert [o.outputs[0].token_ids for o in same.generate(_prompts(), GREEDY)] == want
    # every draft step is a decode-only step of one-token rows: the C++ decode plan serves it where built
    assert served and (all(served) or ex.decode_plan is None)
    assert same.engine.spec.acceptance_rate > 0.95 and prop.num_prefill_forwards == 0
    assert same.engine.scheduler.num_preemptions > 0
    _clean(same)
    own = _spec(base, {"method": "draft", "model": path, "num_speculative_tokens": 3, "quantization": "int8",
                       "adaptive": False}, **CHUNKED_PREEMPTED)
    prop = own.engine.spec.proposer
    assert not prop.shares_target_kv and prop.runner.kv_caches is not own.engine.runner.kv_caches
    assert [o.outputs[0].token_ids for o in own.generate(_prompts(), GREEDY)] == want
    assert own.engine.spec.acceptance_rate > 0.5 and prop.num_prefill_forwards > 0
    _clean(own)


def test_greedy_drafts_on_the_fast_path_equal_the_sampler_path(tiny_paths):
    """The draft loop's argmax kept on the device (greedy, no penalties) proposes what the sampler's
    distributions do when a penalty of no effect (presence 0 + repetition 1 -> frequency tiny) sends the
    same requests through it: drafts equal, outputs equal to plain decoding."""
    base = LLM(model=tiny_paths["llama"], num_kv_blocks=64, max_model_len=256)
    spec = _spec(base, {"method": "draft", "num_speculative_tokens": 3, "quantization": "int4", "adaptive": False})
    seen = {}
    prop = spec.engine.spec.proposer
    inner = prop.propose_batch

    def record(items):
        out = inner(items)
        for (req, _, _, st), (d, _) in zip(items, out):
            seen.setdefault(st.params.frequency_penalty, []).append((req.num_tokens, list(d)))
        return out

    prop.propose_batch = record
    plain = spec.generate(_prompts()[:1], GREEDY)[0].outputs[0].token_ids
    tiny = GREEDY.replace(frequency_penalty=1e-30)  # read by the sampler, changes no logit in float32
    slow = spec.generate(_prompts()[:1], tiny)[0].outputs[0].token_ids
    assert slow == plain == base.generate(_prompts()[:1], GREEDY)[0].outputs[0].token_ids
    assert seen[0.0] == seen[1e-30] and len(seen[0.0]) > 3
    _clean(spec)


def test_stops_logprobs_min_tokens_and_n_with_several_tokens_per_step(tiny_paths):
    path = tiny_paths["llama_plain"]
    base = LLM(model=path, num_kv_blocks=64, max_model_len=256)
    spec = _spec(base, NGRAM)
    prompt = _prompts()[0]
    ref = base.generate(prompt, GREEDY)[0].outputs[0]
    stop_tok = ref.token_ids[17]
    cut = ref.token_ids.index(stop_tok)
    text_stop = ref.text[len(ref.text) // 2:len(ref.text) // 2 + 3]
    cases = [
        SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[stop_tok], min_tokens=min(cut + 1, 20)),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, stop=[text_stop]),
        SamplingParams(temperature=0, max_tokens=25, ignore_eos=True, n=2),
    ]
    for p in cases:
        a, b = base.generate(prompt, p)[0], spec.generate(prompt, p)[0]
        for x, y in zip(a.outputs, b.outputs):
            assert y.token_ids == x.token_ids and y.text == x.text and y.finish_reason == x.finish_reason, p
            if p.logprobs:
                assert [lp.token_id for lp in y.logprobs] == y.token_ids
                assert max(abs(u.logprob - v.logprob) for u, v in zip(x.logprobs, y.logprobs)) < 1e-4
                assert [t for t, _ in y.logprobs[5].top] == [t for t, _ in x.logprobs[5].top]
    assert spec.engine.spec.num_accepted_tokens > 0
    _clean(spec)


# adaptive off: the test needs drafts in flight, whatever the cost model says of a tiny model on this machine
@pytest.mark.parametrize("spec_cfg", [NGRAM, {"method": "draft", "num_speculative_tokens": 3, "quantization": "int8",
                                      "adaptive": False}])
def test_abort_between_proposal_and_verification_leaks_nothing(tiny_paths, spec_cfg):
    llm = LLM(model=tiny_paths["llama"], num_kv_blocks=32, max_model_len=256, speculative=spec_cfg)
    engine = llm.engine
    for i, p in enumerate(_prompts()):
        engine.add_request(f"r{i}", p, GREEDY)
    proposed = False
    for _ in range(40):
        engine.step()
        engine.kv_manager.check_invariants()
        pending = [r for r in engine.scheduler.running_requests() if r.spec_token_ids]
        if pending and engine.scheduler.get_request("r0") in pending:
            proposed = True
            break
    assert proposed
    engine.abort("r0")  # its drafts (and the draft model's lookahead slots) are unverified
    engine.step()  # the others verify theirs
    engine.kv_manager.check_invariants()
    engine.abort("r1")
    engine.abort("r2")
    assert not engine.has_unfinished()
    _clean(llm)


def test_bad_speculative_settings_rejected(tiny_paths, tmp_path):
    from tiny_models import make_tiny_hf_model

    path = tiny_paths["llama"]
    with pytest.raises(EngineConfigError, match="num_speculative_tokens must be at least 1"):
        LLM(model=path, num_kv_blocks=16, speculative={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(EngineConfigError, match="unknown speculative setting"):
        LLM(model=path, num_kv_blocks=16, speculative={"method": "ngram", "k": 3})
    other = make_tiny_hf_model(tmp_path / "v", "llama", vocab_size=1000)
    with pytest.raises(EngineConfigError, match="vocabulary of 1000 tokens"):
        LLM(model=path, num_kv_blocks=16, speculative={"method": "draft", "model": str(other),
                                                       "num_speculative_tokens": 2})
    short = make_tiny_hf_model(tmp_path / "s", "llama", max_position_embeddings=64)
    with pytest.raises(EngineConfigError, match="draft model's context is 64 tokens"):
        LLM(model=path, num_kv_blocks=16, max_model_len=256,
            speculative={"method": "draft", "model": str(short), "num_speculative_tokens": 2})


def test_smollm2_copy_prompt_same_greedy_with_ngram(smollm2_llm):
    """The embedded model on a copy-heavy prompt: the same greedy tokens with n-gram speculation (vLLM's
    near-tie rule, as for batching), most drafts accepted, and nothing left in the cache."""
    from test_batching import assert_same_greedy

    tok = smollm2_llm.tokenizer
    text = ("The history of the city begins in the third century, when a small fishing village grew around "
            "the harbour. Merchants came from the south with salt, wine and cloth.")
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Repeat exactly: {text}"}]),
                     add_special_tokens=False)
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    want = smollm2_llm.generate(ids, p)
    spec = _spec(smollm2_llm, NGRAM)
    got = spec.generate(ids, p)
    assert_same_greedy(want, got)
    s = spec.engine.spec
    assert s.num_draft_tokens > 0 and s.acceptance_rate > 0.3
    _clean(spec)
