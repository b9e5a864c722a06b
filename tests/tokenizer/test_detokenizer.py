"""Incremental detokenisation: deltas concatenate to the full decode, never a broken character."""

import random

import pytest

from servescope.tokenizer import IncrementalDetokenizer

TEXTS = [
    "Hello, world! This is plain ASCII.",
    "Emoji: 🎉🚀 and a family 👩‍👩‍👧 plus flags 🇫🇷🇯🇵.",
    "中文：你好，世界。日本語：こんにちは。한국어: 안녕하세요",
    "Mixed ✓ naïve café — “quotes” ∑∫ 🎉你好 end",
]


def stream(tok, ids, prompt=(), skip_special_tokens=True):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=skip_special_tokens)
    deltas = [d.add(i) for i in ids]
    return d, deltas


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("prompt", ["", "Some prompt text: "])
def test_exact_and_never_broken(tok, text, prompt):
    ids = tok.encode(text)
    d, deltas = stream(tok, ids, tok.encode(prompt))
    assert "".join(deltas) == d.text == tok.decode(ids) == text
    assert all("\ufffd" not in x for x in deltas)
    assert d.flush() == ""
    assert d.output_token_ids == ids


def test_multibyte_characters_are_held_back(tok):
    ids = tok.encode("🎉")
    assert len(ids) > 1  # byte-fallback pieces: the emoji spans several tokens
    d = IncrementalDetokenizer(tok, [])
    assert [d.add(i) for i in ids] == [""] * (len(ids) - 1) + ["🎉"]


def test_special_tokens_skipped_or_kept(tok):
    ids = tok.encode("<|im_start|>assistant\nHi 🎉<|im_end|>", add_special_tokens=False)
    d, deltas = stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == "assistant\nHi 🎉"
    d, deltas = stream(tok, ids, skip_special_tokens=False)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=False)


def test_random_token_streams_concatenate_exactly(tok):
    rng = random.Random(0)
    byte_tokens = [i for i in range(tok.vocab_size) if tok.id_to_token(i) and len(tok.decode([i])) == 1
                   and tok.decode([i]) == "\ufffd"][:200]
    for _ in range(30):
        ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 40))]
        d, deltas = stream(tok, ids, tok.encode("prompt"))
        tail = d.flush()
        assert "".join(deltas) + tail == d.text == tok.decode(ids)
        assert all(not x.endswith("\ufffd") for x in deltas)


def test_prompt_ending_mid_text_does_not_leak_into_output(tok):
    prompt = tok.encode("The answer is")
    ids = tok.encode(" forty-two 🎉")
    d, deltas = stream(tok, ids, prompt)
    assert "".join(deltas) == " forty-two 🎉"
