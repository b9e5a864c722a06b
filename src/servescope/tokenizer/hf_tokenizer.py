"""Tokenizer: a thin wrapper over a transformers tokenizer, plus our own chat-template rendering.

Sources are local only (`local_files_only=True`): a Hugging Face directory, or a GGUF file whose
tokenizer transformers converts. That conversion takes seconds (it parses ~100k vocabulary and
merge entries), so the converted tokenizer is saved once under the servescope cache directory
(`$SERVESCOPE_CACHE_DIR`, default `~/.cache/servescope`; set it to "off" to disable) keyed by the
GGUF's path, size and mtime, and reloaded from there in a fraction of a second. The first conversion
skips AutoTokenizer where the loader knows the model type (`_gguf_tokenizer_class`): AutoTokenizer
parses the whole file again to learn it (seconds of a first `make demo`).
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from typing import Iterable, Optional, Union

from servescope.errors import InvalidParameterError, ModelLoadError
from servescope.tokenizer.source import TokenizerSource
from servescope.tokenizer.chat_encoding import control_token_pattern, encode_chat
from servescope.tokenizer.chat_template import CHATML_TEMPLATE, compile_chat_template, render_chat_template
from servescope.tokenizer.tool_prompt import messages_with_tools, template_renders_tools

logger = logging.getLogger(__name__)

_SPECIAL_ATTRS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class Tokenizer:
    """Encode/decode text, know the end-of-sequence ids, render chat prompts.

    `decode` never applies transformers' `clean_up_tokenization_spaces`, so that incremental
    detokenisation (which decodes small windows) concatenates to exactly `decode(all_ids)`.
    """

    def __init__(self, hf_tokenizer, chat_template: Optional[str] = None, eos_token_ids: Iterable[int] = (),
                 name: str = ""):
        self.hf = hf_tokenizer
        self.name = name
        own = chat_template or getattr(hf_tokenizer, "chat_template", None)
        if isinstance(own, dict):  # several named templates: use the default one
            own = own.get("default") or next(iter(own.values()), None)
        self.has_chat_template = bool(own)
        self.chat_template: str = own or CHATML_TEMPLATE
        try:
            compile_chat_template(self.chat_template)
        except Exception as e:
            raise ModelLoadError(f"{name or 'tokenizer'}: the chat template does not compile ({e})") from None
        eos = set(int(i) for i in eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            eos.add(int(hf_tokenizer.eos_token_id))
        self.eos_token_ids: frozenset = frozenset(eos)
        self.bos_token_id: Optional[int] = hf_tokenizer.bos_token_id
        special = set(hf_tokenizer.all_special_ids)
        special.update(i for i, t in hf_tokenizer.added_tokens_decoder.items() if getattr(t, "special", False))
        self.special_token_ids: frozenset = frozenset(special)
        self.special_tokens = {a: str(getattr(hf_tokenizer, a)) for a in _SPECIAL_ATTRS
                               if getattr(hf_tokenizer, a, None) is not None}
        self._control_pattern = None  # built on first use

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer can produce (base vocabulary + added tokens)."""
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. Use add_special_tokens=False for prompts rendered by a chat template."""
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)

    def id_to_token(self, token_id: int) -> str:
        """The raw vocabulary entry of one id (byte-level BPE shows spaces as 'Ġ')."""
        return self.hf.convert_ids_to_tokens(int(token_id))

    def apply_chat_template(self, messages: list, add_generation_prompt: bool = True, tools=None,
                            chat_template: Optional[str] = None, continue_final_message: bool = False,
                            **kwargs) -> str:
        """Render a conversation to the prompt string (encode it with add_special_tokens=False).
        tools: OpenAI tool definitions, rendered by the template or, if it knows none, as Hermes text.
        chat_template: a request's own template instead of the model's (compiled in the same sandbox).
        continue_final_message: end the prompt inside the last message (no end-of-turn after it), so
        the model continues it (vLLM's and transformers' option; exclusive with add_generation_prompt)."""
        template = chat_template or self.chat_template
        if tools and not template_renders_tools(template):
            messages, tools = messages_with_tools(messages, tools), None
        text = render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self.special_tokens, tools=tools, **kwargs)
        return cut_after_final_message(text, messages) if continue_final_message else text

    @property
    def control_pattern(self):
        """A regex over the special (control) tokens' texts (chat_encoding.control_token_pattern)."""
        if self._control_pattern is None:
            self._control_pattern = control_token_pattern(self) or False
        return self._control_pattern or None

    def encode_chat(self, messages: list, add_generation_prompt: bool = True, tools=None,
                    content_as_text: bool = True, timeout_s: Optional[float] = None,
                    add_special_tokens: bool = False, **template_kw) -> tuple:
        """(prompt text, token ids) of a conversation; control tokens written in message text stay
        text unless content_as_text is False (tokenizer/chat_encoding.py says how and why).
        template_kw: apply_chat_template's own keywords and the template's variables."""
        def render(msgs, tls):
            return self.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tls,
                                            timeout_s=timeout_s, **template_kw)

        client_values = {k: v for k, v in template_kw.items() if k != "chat_template"}  # a template is code
        return encode_chat(self, render, messages, tools, content_as_text, add_special_tokens, client_values)

    def __repr__(self) -> str:
        return f"Tokenizer({self.name!r}, vocab_size={self.vocab_size}, eos={sorted(self.eos_token_ids)})"


def cut_after_final_message(text: str, messages: list) -> str:
    """The rendered prompt up to the end of the last message's content (transformers' rule: its last
    occurrence), so that generation continues that message."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    if not content or not content.strip():
        raise InvalidParameterError("continue_final_message", "continue_final_message needs a last message "
                                                              "with content to continue")
    idx = text.rfind(content.strip())
    if idx < 0:
        raise InvalidParameterError("continue_final_message",
                                    "the chat template does not render the last message's content "
                                    "verbatim, so it cannot be continued")
    return text[:idx + len(content.strip())]


def load_tokenizer(source: Union[TokenizerSource, str]) -> Tokenizer:
    """Load a tokenizer from a TokenizerSource (a loaded model source's `tokenizer_source`), an HF
    directory or a .gguf path."""
    if isinstance(source, str):
        path = os.path.abspath(os.path.expanduser(source))
        source = (TokenizerSource(os.path.dirname(path), os.path.basename(path)) if os.path.isfile(path)
                  else TokenizerSource(path))
    hf = _load_hf_tokenizer(source)
    name = source.gguf_file or os.path.basename(os.path.normpath(source.path))
    return Tokenizer(hf, chat_template=source.chat_template, eos_token_ids=source.eos_token_ids, name=name)


def _load_hf_tokenizer(source: TokenizerSource):
    # lazy: importing AutoTokenizer takes seconds, and an engine on random weights (the tests, the
    # benchmarks' random: models) or the CLI's --help never loads a tokenizer
    from transformers import AutoTokenizer

    where = os.path.join(source.path, source.gguf_file) if source.gguf_file else source.path
    if not os.path.exists(where):
        raise ModelLoadError(f"{where}: tokenizer source not found")
    cache_dir = _cache_dir_for(where) if source.gguf_file else None
    if cache_dir and os.path.isfile(os.path.join(cache_dir, "tokenizer.json")):
        try:
            return AutoTokenizer.from_pretrained(cache_dir, local_files_only=True)
        except Exception as e:
            logger.warning("ignoring unreadable tokenizer cache %s (%s)", cache_dir, e)
    try:
        kw = {"gguf_file": source.gguf_file} if source.gguf_file else {}
        cls = _gguf_tokenizer_class(source) or AutoTokenizer
        hf = cls.from_pretrained(source.path, local_files_only=True, **kw)
    except Exception as e:
        raise ModelLoadError(f"{where}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if cache_dir:
        _save_cache(hf, cache_dir)
    return hf


def _gguf_tokenizer_class(source: TokenizerSource):
    """The class AutoTokenizer picks for a GGUF of source.model_type in a folder without tokenizer files
    (its mapping's fast class, else the generic fast tokenizer), or None where that is not known. For a
    GGUF, AutoTokenizer reads the model type out of a config it builds by parsing the whole file (every
    tensor and vocabulary entry, in Python: seconds for the embedded model), and the class's own
    from_pretrained reads only the tokenizer's metadata."""
    if not source.gguf_file or not source.model_type or any(
            os.path.exists(os.path.join(source.path, f)) for f in ("tokenizer_config.json", "tokenizer.json")):
        return None
    try:  # lazy as in _load_hf_tokenizer (its only caller), which has imported transformers already
        from transformers import PreTrainedTokenizerFast  # lazy: see above
        from transformers.models.auto.tokenization_auto import (  # lazy: see above
            TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name)
    except ImportError:  # a transformers that moved them: AutoTokenizer decides
        return None
    name = TOKENIZER_MAPPING_NAMES.get(source.model_type)
    if isinstance(name, (tuple, list)):  # transformers 4: (slow class, fast class)
        name = name[-1]
    return (tokenizer_class_from_name(name) if name else None) or PreTrainedTokenizerFast


def _cache_dir_for(gguf_path: str) -> Optional[str]:
    root = os.environ.get("SERVESCOPE_CACHE_DIR")
    if root is not None and root.lower() in ("", "0", "off", "none"):
        return None
    root = root or os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "servescope")
    try:
        import transformers  # lazy as in _load_hf_tokenizer (its only caller): already imported there

        st = os.stat(gguf_path)
        key = f"{os.path.abspath(gguf_path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    except OSError:
        return None
    return os.path.join(root, "tokenizers", hashlib.sha256(key.encode()).hexdigest()[:20])


def _save_cache(hf, cache_dir: str) -> None:
    """Save atomically (write to a temp dir, then rename) so concurrent loaders never see half a cache."""
    try:
        os.makedirs(os.path.dirname(cache_dir), exist_ok=True)
        tmp = tempfile.mkdtemp(dir=os.path.dirname(cache_dir), prefix=".tmp-")
        hf.save_pretrained(tmp)
        try:
            os.rename(tmp, cache_dir)
        except OSError:  # another process won the race
            shutil.rmtree(tmp, ignore_errors=True)
    except Exception as e:
        logger.warning("could not cache the converted tokenizer in %s (%s)", cache_dir, e)
