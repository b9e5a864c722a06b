"""engine/kv_transfer.py on two engines of one tiny model in this process: the prompt's full blocks
leave the prefill engine's prefix cache and land in the decode engine's as cached blocks with the same
rows; the decode engine's own scheduler admits the request as a prefix hit over them and its greedy
tokens are the single engine's."""

import pytest
import torch

from servescope.analysis.kv_layout import handed_over_bytes
from servescope.config import SamplingParams
from servescope.engine.kv_transfer import adopt_prompt_kv, export_prompt_kv, kv_shape
from servescope.engine.llm_engine import LLMEngine
from servescope.scheduler.request import Request
from tiny_models import make_tiny_hf_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPT = [(7 * i + 3) % 500 + 5 for i in range(53)]  # 3 full blocks of 16 and 5 tokens


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return make_tiny_hf_model(tmp_path_factory.mktemp("kvx"), "llama", num_hidden_layers=2)


def _engine(path, **kw):
    return LLMEngine(model=str(path), num_threads=1, max_model_len=256, **{"num_kv_blocks": 64, **kw})


def _priced(engine, num_blocks):
    """The bytes the cost model says a hand-over of num_blocks sends (sim/disagg.py's transfer time)."""
    return handed_over_bytes(engine.model_config, str(engine.kv_dtype).replace("torch.", ""), num_blocks * 16, 16)


def _run(engine, rid, prompt, params=GREEDY):
    engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                return out
    raise AssertionError("no output")


def _decodes_from_the_sent_kv(decode, prompt, kv, n, expected):
    """The decode engine that adopted `kv` (n blocks) exports the same rows under the same hashes, then runs the
    prompt as a prefix hit over them: the single engine's greedy tokens, no block held afterwards."""
    again, m = export_prompt_kv(decode, prompt, None)
    assert m == n and torch.equal(again, kv)
    out = _run(decode, "a", prompt)
    assert out.outputs[0].token_ids == expected
    assert out.metrics.num_cached_tokens == n * 16
    decode.kv_manager.check_invariants()
    assert decode.kv_manager.num_used_blocks == 0


def test_the_prompts_kv_moves_and_the_decode_engine_admits_it_as_a_prefix_hit(model_path):
    single, prefill, decode = _engine(model_path), _engine(model_path), _engine(model_path)
    expected = _run(single, "a", PROMPT).outputs[0].token_ids
    _run(prefill, "a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    kv, n = export_prompt_kv(prefill, PROMPT, None)
    assert n == 3 and tuple(kv.shape) == kv_shape(prefill, 3)  # (53 - 1) // 16 full blocks
    assert kv.numel() * kv.element_size() == _priced(prefill, n)
    assert adopt_prompt_kv(decode, "a", PROMPT, None, kv) == 3
    km = decode.kv_manager
    km.check_invariants()
    assert km.num_cached_blocks == 3 and km.num_used_blocks == 0  # cached, evictable: nobody holds them
    _decodes_from_the_sent_kv(decode, PROMPT, kv, 3, expected)  # 48 cached: it computes 5 prompt tokens, not 53


def test_a_salted_prompt_only_hits_under_its_own_salt(model_path):
    prefill, decode = _engine(model_path), _engine(model_path)
    _run(prefill, "a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1, cache_salt="alice"))
    assert export_prompt_kv(prefill, PROMPT, None)[1] == 0  # not findable without the salt
    kv, _ = export_prompt_kv(prefill, PROMPT, "alice")
    assert adopt_prompt_kv(decode, "a", PROMPT, "alice", kv) == 3
    salted = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, cache_salt="alice")
    assert _run(decode, "b", PROMPT, SamplingParams(**{**GREEDY.__dict__, "max_tokens": 2})
                ).metrics.num_cached_tokens == 0
    assert _run(decode, "c", PROMPT, salted).metrics.num_cached_tokens == 48


def test_the_decode_engine_reads_the_sent_kv(model_path):
    """Rows that are not the prompt's (zeros) change what the decode engine computes: it reads the sent
    KV instead of recomputing the prompt."""
    prefill, decode, wrong = _engine(model_path), _engine(model_path), _engine(model_path)
    _run(prefill, "a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    kv, _ = export_prompt_kv(prefill, PROMPT, None)
    adopt_prompt_kv(decode, "a", PROMPT, None, kv)
    adopt_prompt_kv(wrong, "a", PROMPT, None, torch.zeros_like(kv))
    logprobs = SamplingParams(temperature=0.0, max_tokens=1, logprobs=1)
    right = _run(decode, "a", PROMPT, logprobs).outputs[0].logprobs[0]
    zeroed = _run(wrong, "a", PROMPT, logprobs).outputs[0].logprobs[0]
    assert right != zeroed


def test_no_room_or_a_wrong_shape_changes_nothing(model_path):
    prefill = _engine(model_path)
    _run(prefill, "a", PROMPT, SamplingParams(temperature=0.0, max_tokens=1))
    kv, _ = export_prompt_kv(prefill, PROMPT, None)
    small = _engine(model_path, num_kv_blocks=17)
    km = small.kv_manager
    hog = Request("hog", list(range(5, 5 + 15 * 16)), SamplingParams(), arrival_time=0.0)
    assert km.allocate_slots(hog, 15 * 16)  # 2 blocks left: the prompt's 3 do not fit
    before = (km.num_used_blocks, km.num_cached_blocks, km.num_free_blocks)
    assert adopt_prompt_kv(small, "a", PROMPT, None, kv) == 0
    assert (km.num_used_blocks, km.num_cached_blocks, km.num_free_blocks) == before
    with pytest.raises(ValueError, match="does not fit"):
        adopt_prompt_kv(small, "a", PROMPT, None, kv[:1])
    assert (km.num_used_blocks, km.num_cached_blocks, km.num_free_blocks) == before
    km.free(hog)
    km.check_invariants()



# a table per group of layers (kvcache/hybrid.py): Gemma 2 alternates windowed and full layers, gpt-oss likewise
WINDOW = 16
LONG = [(11 * i + 5) % 500 + 5 for i in range(101)]  # 6 full blocks and 5 tokens: well past the window


@pytest.fixture(scope="module", params=["gemma2", "gpt_oss"])
def hybrid_path(request, tmp_path_factory):
    kw = dict(sliding_window=WINDOW, num_hidden_layers=2)
    if request.param == "gemma2":
        kw.update(attn_logit_softcapping=0.05, final_logit_softcapping=2.0)
    return make_tiny_hf_model(tmp_path_factory.mktemp(request.param), request.param, **kw)


def test_a_hybrid_cache_sends_the_full_layers_blocks_and_the_windowed_layers_view(hybrid_path):
    single, prefill, decode = _engine(hybrid_path), _engine(hybrid_path), _engine(hybrid_path)
    assert decode.kv_manager.num_groups == 2
    expected = _run(single, "a", LONG).outputs[0].token_ids
    _run(prefill, "a", LONG, SamplingParams(temperature=0.0, max_tokens=1))
    kv, n = export_prompt_kv(prefill, LONG, None)
    # the full layer's 6 blocks, the windowed layer's last (a query at 96 reads keys 81 on: block 5, and its own)
    assert n == 6 and tuple(kv.shape) == kv_shape(prefill, 6) and kv.shape[0] == 2 * 6 + 2 * 1
    assert kv.numel() * kv.element_size() == _priced(prefill, n)  # what the simulator prices the hand-over at
    with pytest.raises(ValueError, match="number of blocks"):
        adopt_prompt_kv(decode, "a", LONG, None, kv)
    assert adopt_prompt_kv(decode, "a", LONG, None, kv, n) == 6
    km = decode.kv_manager
    km.check_invariants()
    full, windowed = km.groups
    # nobody holds a block; the full group caches all 6, the windowed one the view's (the others never written)
    assert km.num_used_blocks == 0 and full.num_cached_blocks == 6 and windowed.num_cached_blocks == 1
    _decodes_from_the_sent_kv(decode, LONG, kv, n, expected)  # 96 cached: it computes 5 prompt tokens, not 101


def test_a_hybrid_adoption_that_does_not_fit_changes_nothing(hybrid_path):
    prefill = _engine(hybrid_path)
    _run(prefill, "a", LONG, SamplingParams(temperature=0.0, max_tokens=1))
    kv, n = export_prompt_kv(prefill, LONG, None)
    small = _engine(hybrid_path)
    km = small.kv_manager
    hog = Request("hog", list(range(5, 5 + 60 * 16)), SamplingParams(), arrival_time=0.0)
    assert km.allocate_slots(hog, (km.num_blocks - 3) * 16)  # the full group keeps 3 free: 6 do not fit
    before = [(g.num_used_blocks, g.num_cached_blocks, g.num_free_blocks) for g in km.groups]
    assert adopt_prompt_kv(small, "a", LONG, None, kv, n) == 0
    with pytest.raises(ValueError, match="does not fit"):
        adopt_prompt_kv(small, "a", LONG, None, kv, n - 1)
    assert [(g.num_used_blocks, g.num_cached_blocks, g.num_free_blocks) for g in km.groups] == before
    km.free(hog)
    km.check_invariants()
