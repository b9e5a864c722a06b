"""Rejection sampling keeps the target distribution exactly (in the style of vLLM's rejection-sampler
test: a small vocabulary, many samples, the distance to the target shrinking as samples grow), for a
deterministic proposer (n-gram: one-hot q) and a draft model (q a distribution), and greedy verification
equals plain argmax decoding."""

import math

import pytest
import torch

from servescope.config import SamplingParams
from servescope.sampling.sampler import Sampler, SamplingState
from servescope.spec.rejection import verify

V = 8
N = 100_000


def _l1(counts: torch.Tensor, p: torch.Tensor) -> float:
    return (counts / counts.sum() - p).abs().sum().item()


def _run(target: torch.Tensor, q0, n: int, draft_token=None, seed=0):
    """n requests verifying 2 drafts with target rows (p0, p1, p2); returns the emitted token lists."""
    torch.manual_seed(seed)
    sampler = Sampler(V)
    params = SamplingParams(temperature=1.0, max_tokens=8)
    states = [SamplingState(params, [0], []) for _ in range(n)]
    if draft_token is None:  # a draft model: d0 ~ q0, d1 ~ q1 (= q0 here), q given per draft
        d = torch.multinomial(q0, 2 * n, replacement=True).view(n, 2).tolist()
        dp = [torch.stack([q0, q0])] * n
    else:  # n-gram: the same deterministic drafts, q one-hot
        d, dp = [[draft_token, draft_token]] * n, None
    logits = target.log().repeat(n, 1)  # [3n, V]: rows p0, p1, p2 per request
    return verify(sampler, logits, states, d, dp).results, d


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_emitted_tokens_follow_the_target(proposer):
    g = torch.Generator().manual_seed(7)
    target = torch.softmax(torch.randn(3, V, generator=g) * 1.5, dim=-1)  # [3, V]: positions 0, 1, bonus
    q0 = torch.softmax(torch.randn(V, generator=g) * 1.5, dim=-1)
    draft_token = int(target[0].argmin()) if proposer == "ngram" else None  # an unlikely guess
    res, drafts = _run(target, q0, N, draft_token)
    first = torch.bincount(torch.tensor([r.token_ids[0] for r in res]), minlength=V).double()
    # the second token where the first draft was accepted: it must follow p1 (the draft's own or a residual)
    second = torch.tensor([r.token_ids[1] for r in res if r.num_accepted >= 1])
    second = torch.bincount(second, minlength=V).double()
    p0, p1 = target[0].double(), target[1].double()
    dists = [_l1(torch.bincount(torch.tensor([r.token_ids[0] for r in res[:m]]), minlength=V).double(), p0)
             for m in (1_000, 10_000, N)]
    assert dists[0] > dists[1] > dists[2], dists  # shrinking as samples grow
    assert dists[2] < 4 * math.sqrt(V / N), dists  # ~ the sampling noise of N draws
    q = torch.zeros(V, dtype=torch.float64)
    if draft_token is None:
        q += q0.double()
    else:
        q[draft_token] = 1
    assert _l1(first, q) > 10 * dists[2]  # the test can tell the target from the proposal
    assert second.sum() > 1_000 and _l1(second, p1) < 8 * math.sqrt(V / second.sum().item())
    # acceptance at draft 0 happens with probability sum_x min(p0, q)
    acc = sum(r.num_accepted >= 1 for r in res) / N
    assert abs(acc - torch.minimum(p0, q).sum().item()) < 0.01


def test_greedy_verification_is_argmax_decoding():
    sampler = Sampler(V)
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2 * 4, V, generator=g)  # two requests, 3 drafts each: 4 rows each
    am = logits.argmax(-1).tolist()
    params = SamplingParams(temperature=0, max_tokens=8)
    states = [SamplingState(params, [0], []) for _ in range(2)]
    drafts = [am[0:2] + [(am[2] + 1) % V], am[4:7]]  # request 0: third draft wrong; request 1: all right
    res = verify(sampler, logits, states, drafts).results
    assert res[0].token_ids == am[0:3] and res[0].num_accepted == 2
    assert res[1].token_ids == am[4:8] and res[1].num_accepted == 3  # the bonus token


def test_min_tokens_masks_eos_at_each_position():
    """min_tokens counts the drafts before a position: EOS is masked at row j while len(out) + j < min."""
    eos = 5
    sampler = Sampler(V, eos_token_ids=[eos])
    logits = torch.zeros(3, V)
    logits[:, eos] = 10.0  # EOS is everyone's argmax
    params = SamplingParams(temperature=0, max_tokens=8, min_tokens=2)
    state = SamplingState(params, [0], [])
    res = verify(sampler, logits, [state], [[1, 1]]).results
    # row 0 and row 1 mask EOS (0 and 1 outputs before them): argmax 0 there; row 2 may emit EOS
    assert res[0].token_ids == [0]
    logits[:2, 1] = 20.0
    res = verify(sampler, logits, [state], [[1, 1]]).results
    assert res[0].token_ids == [1, 1, eos]
