"""vLLM's logits controls in the Sampler: logit_bias, allowed_token_ids, bad_words, the thinking budget."""

import pytest
import torch

from servescope.config import SamplingParams, ThinkingBudget
from servescope.errors import InvalidParameterError
from servescope.kvcache import hash_full_blocks
from servescope.sampling import Sampler, SamplingState
from servescope.sampling.logit_controls import banned_by_bad_words, forced_token

V = 16


def _state(out=(), **kw):
    s = SamplingState.new(SamplingParams(temperature=0.0, max_tokens=64, **kw), [1, 2, 3], "cpu")
    s.output_token_ids.extend(out)
    return s


def _logits(best=5):
    x = torch.zeros(1, V)
    x[0, best] = 10.0
    return x


def test_logit_bias_moves_the_argmax():
    sampler = Sampler(V)
    assert sampler(_logits(5), [_state()]).token_ids == [5]
    assert sampler(_logits(5), [_state(logit_bias={7: 20.0})]).token_ids == [7]
    assert sampler(_logits(5), [_state(logit_bias={5: -100.0})]).token_ids != [5]


def test_allowed_token_ids_restrict_the_choice_also_when_sampling():
    sampler = Sampler(V)
    assert sampler(_logits(5), [_state(allowed_token_ids=[2, 9])]).token_ids[0] in (2, 9)
    s = SamplingState.new(SamplingParams(temperature=1.0, seed=3, allowed_token_ids=[4]), [1], "cpu")
    assert all(sampler(_logits(5), [s]).token_ids == [4] for _ in range(5))


def test_bad_words_ban_single_tokens_and_completions_of_longer_words():
    assert banned_by_bad_words([(5,)], []) == [5]
    assert banned_by_bad_words([(3, 5)], [1, 3]) == [5]  # the word's prefix ends the output
    assert banned_by_bad_words([(3, 5)], [3, 1]) == []
    sampler = Sampler(V)
    assert sampler(_logits(5), [_state(bad_words_token_ids=[(5,)])]).token_ids != [5]
    assert sampler(_logits(5), [_state(out=[3], bad_words_token_ids=[(3, 5)])]).token_ids != [5]
    assert sampler(_logits(5), [_state(out=[4], bad_words_token_ids=[(3, 5)])]).token_ids == [5]


def test_thinking_budget_forces_the_end_sequence_token_by_token():
    b = ThinkingBudget(max_tokens=3, end_token_ids=(11, 12))
    assert forced_token(b, [1, 2]) is None  # within budget
    assert forced_token(b, [1, 2, 3]) == 11
    assert forced_token(b, [1, 2, 3, 11]) == 12
    assert forced_token(b, [1, 2, 3, 11, 12]) is None  # closed
    assert forced_token(b, [1, 11, 12, 4, 5, 6]) is None  # closed early by the model
    opened = ThinkingBudget(max_tokens=2, end_token_ids=(11,), start_token_ids=(10,))
    assert forced_token(opened, [1, 2, 3, 4]) is None  # the output never opened a block: no budget
    assert forced_token(opened, [10, 1, 2]) == 11
    sampler = Sampler(V)
    outs = []
    s = _state(thinking_budget=b)
    for _ in range(6):  # the model would say 5 forever
        t = sampler(_logits(5), [s]).token_ids[0]
        s.output_token_ids.append(t)
        outs.append(t)
    assert outs == [5, 5, 5, 11, 12, 5]


def test_controls_leave_other_rows_alone_and_logprobs_raw():
    sampler = Sampler(V)
    plain = SamplingState.new(SamplingParams(temperature=0.0, logprobs=1), [1], "cpu")
    biased = SamplingState.new(SamplingParams(temperature=0.0, logprobs=1, logit_bias={7: 30.0}), [1], "cpu")
    out = sampler(torch.cat([_logits(5), _logits(5)]), [plain, biased])
    assert out.token_ids == [5, 7]
    assert out.logprobs[0].top[0][0] == 5 and out.logprobs[1].top[0][0] == 5  # from the raw logits


@pytest.mark.parametrize(
    "kw",
    [{"logit_bias": {-1: 1.0}}, {"allowed_token_ids": []}, {"bad_words_token_ids": [()]}, {"cache_salt": ""}],
)
def test_bad_controls_are_rejected(kw):
    with pytest.raises(InvalidParameterError):
        SamplingParams(**kw)


def test_cache_salt_separates_prefix_hashes():
    ids = list(range(32))
    assert hash_full_blocks(ids, 8) != hash_full_blocks(ids, 8, salt="a")
    assert hash_full_blocks(ids, 8, salt="a") == hash_full_blocks(ids, 8, salt="a")
    assert hash_full_blocks(ids, 8, salt="a") != hash_full_blocks(ids, 8, salt="b")
