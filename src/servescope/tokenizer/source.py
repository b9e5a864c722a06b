"""Where a tokenizer lives: a hand-off object that the loaders fill in and `load_tokenizer` reads."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class TokenizerSource:
    """Where the tokenizer lives: a directory, plus the GGUF file name inside it for GGUF sources."""

    path: str
    gguf_file: Optional[str] = None
    chat_template: Optional[str] = None  # the model's own template, if any (None: the tokenizer's or ChatML)
    eos_token_ids: tuple = ()  # every id that ends generation (config + generation_config + tokenizer)
    model_type: Optional[str] = None  # a GGUF's Hugging Face model type ("llama", "qwen2"), when the loader knows it
