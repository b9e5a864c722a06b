"""Tokenizer loading (GGUF, HF dir, cache) and encode/decode."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "model"))
from tiny_models import make_tiny_hf_model  # noqa: E402

from servescope.errors import ModelLoadError  # noqa: E402
from servescope.tokenizer.source import TokenizerSource  # noqa: E402
from servescope.tokenizer import CHATML_TEMPLATE, load_tokenizer  # noqa: E402

TEXTS = ["Hello world", "  leading spaces and\ttabs\n\nnewlines", "naïve café 你好世界 🎉👩‍👩‍👧", ""]


def test_basic_properties(tok):
    assert tok.vocab_size == 49152
    assert tok.eos_token_ids == {2}
    assert tok.bos_token_id == 1
    assert {0, 1, 2} <= tok.special_token_ids
    assert tok.has_chat_template and "<|im_start|>" in tok.chat_template
    assert tok.special_tokens["eos_token"] == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_roundtrip(tok, text):
    ids = tok.encode(text)
    assert all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text
    assert ids == tok.hf.encode(text)


def test_special_tokens(tok):
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids) == "user\nhi"
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>user\nhi<|im_end|>"
    assert tok.id_to_token(tok.encode(" world")[0]) == "Ġworld"


def test_gguf_tokenizer_cache(tmp_path, monkeypatch, smollm2_gguf, tok):
    monkeypatch.setenv("SERVESCOPE_CACHE_DIR", str(tmp_path))
    fresh = load_tokenizer(smollm2_gguf)  # converts from the GGUF, writes the cache
    entries = os.listdir(tmp_path / "tokenizers")
    assert len(entries) == 1 and os.path.isfile(tmp_path / "tokenizers" / entries[0] / "tokenizer.json")
    cached = load_tokenizer(smollm2_gguf)
    for text in TEXTS + ["<|im_start|>system\nx<|im_end|>"]:
        assert fresh.encode(text) == cached.encode(text) == tok.encode(text)
    assert cached.chat_template == fresh.chat_template and cached.eos_token_ids == fresh.eos_token_ids


def test_load_from_hf_dir_and_sources(tmp_path):
    from servescope.loader.source import load_model_source

    path = make_tiny_hf_model(tmp_path, "qwen2")
    src = load_model_source(str(path))
    for source in (src.tokenizer_source, str(path)):
        t = load_tokenizer(source)
        assert t.vocab_size == 49152 and 2 in t.eos_token_ids
        assert t.decode(t.encode("Hello 🎉")) == "Hello 🎉"


def test_fallback_chatml_template(tmp_path):
    path = make_tiny_hf_model(tmp_path, "llama_plain")
    os.remove(path / "chat_template.jinja")
    t = load_tokenizer(str(path))
    assert not t.has_chat_template and t.chat_template == CHATML_TEMPLATE
    out = t.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_missing_tokenizer_files(tmp_path):
    with pytest.raises(ModelLoadError, match="cannot load the tokenizer"):
        load_tokenizer(TokenizerSource(str(tmp_path)))
    with pytest.raises(ModelLoadError, match="not found"):
        load_tokenizer(TokenizerSource(str(tmp_path / "nope")))


def test_gguf_tokenizer_without_autotokenizer_is_autotokenizers(tmp_path, monkeypatch, smollm2_gguf):
    """The first conversion of a GGUF whose model type the loader knows takes the class AutoTokenizer
    would pick, without AutoTokenizer's parse of the whole file: the same class, vocabulary, special
    tokens, template and ids. A GGUF named by path alone (no model type) still goes through AutoTokenizer."""
    from servescope.tokenizer import hf_tokenizer

    monkeypatch.setenv("SERVESCOPE_CACHE_DIR", "off")
    path = os.path.abspath(smollm2_gguf)
    src = TokenizerSource(os.path.dirname(path), os.path.basename(path), model_type="llama")
    assert hf_tokenizer._gguf_tokenizer_class(src) is not None
    assert hf_tokenizer._gguf_tokenizer_class(TokenizerSource(os.path.dirname(path), os.path.basename(path))) is None
    fast, auto = load_tokenizer(src), load_tokenizer(path)
    assert type(fast.hf) is type(auto.hf)
    assert fast.hf.get_vocab() == auto.hf.get_vocab() and fast.special_tokens == auto.special_tokens
    assert fast.chat_template == auto.chat_template and fast.eos_token_ids == auto.eos_token_ids
    assert fast.special_token_ids == auto.special_token_ids and fast.bos_token_id == auto.bos_token_id
    for text in TEXTS + ["<|im_start|>system\nx<|im_end|>"]:
        for add in (True, False):
            assert fast.encode(text, add) == auto.encode(text, add)
