"""Penalties and the min_tokens mask produce exact values."""

import torch

from servescope.sampling.penalties import apply_penalties, mask_tokens, token_counts


def t(*v):
    return torch.tensor(v, dtype=torch.float32)


def test_token_counts_ignores_out_of_range_ids():
    c = token_counts([[1, 1, 3, 7, -1], []], vocab_size=4, device=torch.device("cpu"))
    assert c.tolist() == [[0, 2, 0, 1], [0, 0, 0, 0]]


def test_repetition_penalty_divides_positive_multiplies_negative():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    apply_penalties(x, [[0]], [[1, 1]], t(2.0), t(0.0), t(0.0))
    # seen: 0 (prompt), 1 (output); unseen tokens keep their logits
    assert x.tolist() == [[1.0, -2.0, 0.5, 3.0, -2.0]]


def test_frequency_and_presence_on_output_only():
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    apply_penalties(x, [[0, 2]], [[1, 1, 3]], t(1.0), t(0.25), t(0.5))
    # token 1: 1 - 2*0.5 - 0.25; token 3: 1 - 0.5 - 0.25; prompt tokens 0, 2 untouched
    assert x.tolist() == [[1.0, -0.25, 1.0, 0.25]]


def test_all_penalties_in_order_and_per_row():
    x = torch.tensor([[4.0, -4.0, 2.0], [4.0, -4.0, 2.0]])
    apply_penalties(x, [[2], []], [[0, 1, 1], []], t(2.0, 1.0), t(1.0, 0.0), t(0.5, 0.0))
    # row 0: rep then freq then presence: 4/2-0.5-1, -4*2-1-1, 2/2
    assert x.tolist() == [[0.5, -10.0, 1.0], [4.0, -4.0, 2.0]]


def test_negative_penalties_encourage():
    x = torch.tensor([[0.0, 0.0]])
    apply_penalties(x, [[]], [[1]], t(1.0), t(-1.0), t(-2.0))
    assert x.tolist() == [[0.0, 3.0]]


def test_mask_tokens():
    x = torch.zeros(2, 3)
    mask_tokens(x, [0, 1, 1], [2, 0, 1])
    inf = float("-inf")
    assert x.tolist() == [[0.0, 0.0, inf], [inf, inf, 0.0]]
