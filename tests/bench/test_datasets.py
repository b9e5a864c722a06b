import pytest

from servescope.bench.datasets import length_bounds, random_requests, total_tokens


def test_fixed_lengths_token_ids():
    reqs = random_requests(20, input_len=32, output_len=16, vocab_size=1000, seed=0)
    assert len(reqs) == 20
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 32
        assert r.output_len == 16
        assert all(0 <= t < 1000 for t in r.prompt)
    assert total_tokens(reqs) == (640, 320)


def test_uniform_ranges_inclusive_and_seeded():
    reqs = random_requests(400, input_len=(5, 8), output_len=(1, 3), vocab_size=50, seed=7)
    in_lens = {r.prompt_len for r in reqs}
    out_lens = {r.output_len for r in reqs}
    assert in_lens == {5, 6, 7, 8} and out_lens == {1, 2, 3}  # both ends reachable
    again = random_requests(400, input_len=(5, 8), output_len=(1, 3), vocab_size=50, seed=7)
    assert again == reqs
    assert random_requests(400, input_len=(5, 8), output_len=(1, 3), vocab_size=50, seed=8) != reqs


def test_range_ratio_vllm_semantics():
    assert length_bounds(100, 0.5) == (50, 150)
    reqs = random_requests(200, input_len=100, output_len=10, range_ratio=0.5, vocab_size=100, seed=0)
    assert all(50 <= r.prompt_len <= 150 and 5 <= r.output_len <= 15 for r in reqs)
    for bad in [(0, 3), (5, 4)]:
        with pytest.raises(ValueError):
            length_bounds(bad)
    with pytest.raises(ValueError):
        length_bounds(10, 1.0)
    with pytest.raises(ValueError):
        random_requests(1, 4, 4)  # no vocab_size and no tokenizer


class CharTokenizer:
    """Tokens are letters a..z plus one special id 26 (never sampled)."""

    all_special_ids = [26]

    def __len__(self):
        return 27

    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids if i < 26)

    def encode(self, text, add_special_tokens=True):
        return ([26] if add_special_tokens else []) + [ord(c) - ord("a") for c in text]


def test_text_mode_with_tokenizer():
    reqs = random_requests(50, input_len=12, output_len=4, seed=1, tokenizer=CharTokenizer())
    for r in reqs:
        assert isinstance(r.prompt, str) and len(r.prompt) == r.prompt_len == 12  # no special id, no BOS
