"""apply_top_k_top_p_min_p keeps exactly the expected token sets."""

import math

import torch

from servescope.sampling import apply_top_k_top_p_min_p

NEG_INF = float("-inf")


def kept(row: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(row.tolist()) if v != NEG_INF}


def logits_of(probs):
    return torch.tensor([[math.log(p) for p in probs]], dtype=torch.float32)


def test_top_k_keeps_k_largest_and_survivors_unchanged():
    x = torch.tensor([[0.0, 4.0, 1.0, 3.0, 2.0]])
    out = apply_top_k_top_p_min_p(x, k=torch.tensor([2]))
    assert kept(out[0]) == {1, 3}
    assert out[0, 1] == 4.0 and out[0, 3] == 3.0
    assert torch.equal(x, torch.tensor([[0.0, 4.0, 1.0, 3.0, 2.0]]))  # input untouched


def test_top_k_keeps_ties_at_kth_value():
    x = torch.tensor([[1.0, 3.0, 3.0, 2.0]])
    assert kept(apply_top_k_top_p_min_p(x, k=1)[0]) == {1, 2}
    assert kept(apply_top_k_top_p_min_p(x, k=3)[0]) == {1, 2, 3}


def test_top_k_off_values():
    x = torch.tensor([[0.0, 1.0, 2.0]])
    for k in (0, -1, 3, 99):
        assert kept(apply_top_k_top_p_min_p(x, k=k)[0]) == {0, 1, 2}


def test_top_p_smallest_set_reaching_p():
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_top_k_top_p_min_p(x, p=0.4)[0]) == {0}
    assert kept(apply_top_k_top_p_min_p(x, p=0.75)[0]) == {0, 1}
    assert kept(apply_top_k_top_p_min_p(x, p=0.81)[0]) == {0, 1, 2}
    assert kept(apply_top_k_top_p_min_p(x, p=0.96)[0]) == {0, 1, 2, 3}
    assert kept(apply_top_k_top_p_min_p(x, p=1.0)[0]) == {0, 1, 2, 3}


def test_top_p_always_keeps_top_token():
    x = logits_of([0.25, 0.25 + 1e-3, 0.25 - 1e-3, 0.25])
    assert kept(apply_top_k_top_p_min_p(x, p=1e-6)[0]) == {1}


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    x = logits_of([0.4, 0.3, 0.2, 0.1])
    # alone, p=0.55 needs the two top tokens (0.4 < 0.55 <= 0.7) ...
    assert kept(apply_top_k_top_p_min_p(x, p=0.55)[0]) == {0, 1}
    # ... after top-k=2 the top token has 0.4/0.7 = 0.571 >= 0.55 on its own
    assert kept(apply_top_k_top_p_min_p(x, k=2, p=0.55)[0]) == {0}


def test_min_p_relative_to_top_probability():
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_top_k_top_p_min_p(x, min_p=0.35)[0]) == {0, 1}  # threshold 0.175
    assert kept(apply_top_k_top_p_min_p(x, min_p=0.12)[0]) == {0, 1, 2}  # threshold 0.06
    assert kept(apply_top_k_top_p_min_p(x, min_p=0.0)[0]) == {0, 1, 2, 3}
    assert kept(apply_top_k_top_p_min_p(x, min_p=1.0)[0]) == {0}


def test_min_p_after_top_k():
    x = logits_of([0.5, 0.3, 0.15, 0.05])
    assert kept(apply_top_k_top_p_min_p(x, k=3, min_p=0.05)[0]) == {0, 1, 2}


def test_per_row_settings_match_single_rows():
    torch.manual_seed(0)
    x = torch.randn(4, 50)
    k = torch.tensor([0, 5, 20, 1])
    p = torch.tensor([0.9, 1.0, 0.5, 0.3])
    mp = torch.tensor([0.0, 0.2, 0.05, 0.0])
    batched = apply_top_k_top_p_min_p(x, k, p, mp)
    for i in range(4):
        single = apply_top_k_top_p_min_p(x[i : i + 1], k[i : i + 1], p[i : i + 1], mp[i : i + 1])
        assert torch.equal(batched[i], single[0])
    # row 1: only top-5 then min-p; check against a direct computation
    probs = torch.softmax(x[1], -1)
    top5 = set(torch.topk(x[1], 5).indices.tolist())
    expected = {i for i in top5 if probs[i] >= 0.2 * probs.max()}
    assert kept(batched[1]) == expected
