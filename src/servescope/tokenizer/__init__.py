"""servescope.tokenizer: tokenizer loading, chat templates (sandboxed), incremental detokenisation."""

from servescope.tokenizer.chat_template import (
    CHATML_TEMPLATE,
    ROLES,
    compile_chat_template,
    render_chat_template,
    validate_messages,
)
from servescope.tokenizer.detokenizer import IncrementalDetokenizer
from servescope.tokenizer.hf_tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "ROLES",
    "IncrementalDetokenizer",
    "Tokenizer",
    "compile_chat_template",
    "load_tokenizer",
    "render_chat_template",
    "validate_messages",
]
