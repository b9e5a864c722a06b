"""Sampler: greedy, temperature, filters, seeds, penalties, min_tokens, logprobs."""

import math

import pytest
import torch

from servescope.config import SamplingParams
from servescope.sampling import Sampler, SamplingState, make_generator


def state(prompt=(1,), output=(), device="cpu", **kw):
    params = SamplingParams(**kw)
    return SamplingState(params, list(prompt), list(output), make_generator(params.seed, device))


def test_greedy_equals_argmax_ties_to_lowest_index():
    logits = torch.tensor([[1.0, 5.0, 5.0, 2.0], [9.0, 9.0, 0.0, 9.0], [0.0, 0.0, 0.0, 1.0]])
    out = Sampler(4)(logits, [state(temperature=0.0) for _ in range(3)])
    assert out.token_ids == [1, 0, 3]
    assert out.logprobs == [None, None, None]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_greedy_any_dtype_in_mixed_batch(dtype):
    torch.manual_seed(0)
    logits = torch.randn(6, 100).to(dtype)
    logits[2, 7] = logits[2, 11] = 100.0  # a tie on the slow path too
    states = [state(temperature=0.0) if i % 2 == 0 else state(temperature=1.0) for i in range(6)]
    states[4] = state(temperature=1e-6)  # below vLLM's epsilon: greedy
    ids = Sampler(100)(logits, states).token_ids
    argmax = logits.float().argmax(-1).tolist()
    assert [ids[i] for i in (0, 2, 4)] == [argmax[i] for i in (0, 2, 4)]
    assert ids[2] == 7


def test_params_greedy_is_the_samplers_rule():
    # SamplingParams.greedy and the sampler must agree on which temperatures are greedy
    assert SamplingParams(temperature=0.0).greedy and SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=1e-4).greedy and not SamplingParams(temperature=1.0).greedy


def test_logits_not_mutated_and_padded_vocab_ignored():
    logits = torch.tensor([[0.0, 1.0, 2.0, 50.0]])  # column 3 is padding beyond vocab_size 3
    before = logits.clone()
    s = Sampler(3)
    assert s(logits, [state(temperature=0.0, repetition_penalty=2.0, prompt=[2])]).token_ids == [1]
    assert s(logits, [state(temperature=0.7)]).token_ids[0] in (0, 1, 2)
    assert torch.equal(logits, before)


def empirical(logits_row, n, **kw):
    """Frequencies of n draws (one call, n identical unseeded rows)."""
    torch.manual_seed(1234)
    v = logits_row.numel()
    out = Sampler(v)(logits_row.expand(n, v).clone(), [state(**kw) for _ in range(n)]).token_ids
    counts = torch.bincount(torch.tensor(out), minlength=v).float()
    return counts / n


def test_temperature_scales_distribution():
    row = torch.tensor([0.0, 1.0, 2.0, 0.5])
    for temp in (0.5, 1.0, 2.0):
        freq = empirical(row, 4000, temperature=temp)
        expected = torch.softmax(row / temp, -1)
        assert torch.allclose(freq, expected, atol=0.03), (temp, freq, expected)


def test_sample_support_follows_top_k_top_p_min_p():
    row = torch.log(torch.tensor([0.35, 0.25, 0.2, 0.1, 0.06, 0.04]))
    assert set(torch.nonzero(empirical(row, 2000, top_k=3)).flatten().tolist()) == {0, 1, 2}
    assert set(torch.nonzero(empirical(row, 2000, top_p=0.55)).flatten().tolist()) == {0, 1}
    assert set(torch.nonzero(empirical(row, 2000, min_p=0.5)).flatten().tolist()) == {0, 1, 2}
    freq = empirical(row, 4000, top_k=2)
    assert torch.allclose(freq[:2], torch.tensor([0.35, 0.25]) / 0.6, atol=0.03)


def run_seeded(seed, steps, companions, position, device="cpu"):
    """Tokens of a seeded request sampled `steps` times inside batches of other requests."""
    torch.manual_seed(99)
    logits_gen = torch.Generator().manual_seed(5)
    target = state(seed=seed, temperature=0.9, top_p=0.95, device=device)
    others = [state(device=device, **kw) for kw in companions]
    got = []
    for _ in range(steps):
        batch = others[:position] + [target] + others[position:]
        base = torch.randn(1, 64, generator=logits_gen)
        noise = torch.randn(len(batch), 64)  # other rows' logits vary freely
        logits = torch.cat([noise[:position], base, noise[position + 1 :]]).to(device)
        tok = Sampler(64)(logits, batch).token_ids[position]
        target.output_token_ids.append(tok)
        got.append(tok)
    return got


def test_seeded_reproducible_and_independent_of_batch():
    alone = run_seeded(7, 8, [], 0)
    assert alone == run_seeded(7, 8, [], 0)
    mixed = [dict(seed=3), dict(temperature=0.0), dict(top_k=5), dict(seed=11, min_p=0.1)]
    assert alone == run_seeded(7, 8, mixed, 2)
    assert alone == run_seeded(7, 8, mixed[::-1], 4)
    assert alone != run_seeded(8, 8, [], 0)


def test_unseeded_rows_do_not_advance_seeded_generators():
    # the seeded draw is the same whether or not unseeded rows also sample in the batch
    a = state(seed=1)
    b = state(seed=1)
    s = Sampler(32)
    x = torch.randn(1, 32)
    t1 = s(x, [a]).token_ids[0]
    t2 = s(torch.cat([torch.randn(3, 32), x]), [state(), state(), state(), b]).token_ids[3]
    assert t1 == t2


def test_repetition_penalty_changes_greedy_choice():
    logits = torch.tensor([[3.0, 2.0, -1.0]])
    s = Sampler(3)
    assert s(logits, [state(temperature=0.0, prompt=[0], repetition_penalty=2.0)]).token_ids == [1]
    assert s(logits, [state(temperature=0.0, output=[0], frequency_penalty=0.6, presence_penalty=0.5)]).token_ids == [1]
    # prompt tokens do not count for presence/frequency
    assert s(logits, [state(temperature=0.0, prompt=[0], presence_penalty=2.0)]).token_ids == [0]


def test_min_tokens_masks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])
    s = Sampler(4, eos_token_ids=[1])
    assert s(logits, [state(temperature=0.0, min_tokens=2, max_tokens=5, output=[3])]).token_ids == [2]
    both = state(temperature=0.0, min_tokens=2, max_tokens=5, stop_token_ids=[2])
    assert s(logits, [both]).token_ids == [3]
    done = state(temperature=0.0, min_tokens=1, max_tokens=5, output=[3])
    assert s(logits, [done]).token_ids == [1]
    ignore = state(temperature=0.0, min_tokens=2, max_tokens=5, ignore_eos=True)
    assert s(logits, [ignore]).token_ids == [1]
    # sampled rows too: EOS never drawn while masked
    rows = [state(temperature=1.0, min_tokens=1, max_tokens=5) for _ in range(200)]
    ids = s(torch.tensor([[0.0, 8.0, 0.0, 0.0]]).expand(200, 4), rows).token_ids
    assert 1 not in ids


def test_logprobs_are_raw_log_softmax_with_rank_and_top():
    torch.manual_seed(3)
    logits = torch.randn(3, 30).to(torch.bfloat16)
    states = [
        state(temperature=0.5, repetition_penalty=1.5, prompt=[0, 1, 2], logprobs=5),
        state(temperature=0.0),
        state(temperature=0.0, logprobs=0, presence_penalty=2.0, output=[int(logits[2].float().argmax())]),
    ]
    out = Sampler(30)(logits, states)
    raw = torch.log_softmax(logits.float(), -1)
    assert out.logprobs[1] is None
    for i in (0, 2):
        lp = out.logprobs[i]
        tok = out.token_ids[i]
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(raw[i, tok].item(), abs=1e-6)
        assert lp.rank == int((raw[i] >= raw[i, tok]).sum())
    top = out.logprobs[0].top
    assert len(top) == 5 and out.logprobs[2].top == []
    vals, idx = raw[0].topk(5)
    assert [t for t, _ in top] == idx.tolist()
    assert [v for _, v in top] == pytest.approx(vals.tolist(), abs=1e-6)
    # row 2: presence penalty pushed greedy off the raw argmax, so its raw rank is > 1
    assert out.logprobs[2].rank > 1


def test_logprobs_rank_of_greedy_token_is_one():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 0.0, 1.0]])
    out = Sampler(3)(logits, [state(temperature=0.0, logprobs=2), state(temperature=0.0, logprobs=20)])
    assert [lp.rank for lp in out.logprobs] == [1, 1]
    assert [t for t, _ in out.logprobs[1].top] == [0, 2, 1]  # capped at the vocabulary
    assert out.logprobs[0].logprob == pytest.approx(2.0 - math.log(1 + math.exp(2) + math.e), abs=1e-6)


def test_shape_errors():
    with pytest.raises(ValueError):
        Sampler(4)(torch.zeros(2, 4), [state()])
    with pytest.raises(ValueError):
        Sampler(8)(torch.zeros(1, 4), [state()])
