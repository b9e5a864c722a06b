"""GrammarCompiler: StructuredOutput -> xgrammar CompiledGrammar, for one tokenizer and vocabulary.

Compiling a schema costs milliseconds to seconds; xgrammar caches by grammar text, so the 20th
request with the same schema reuses the first one's masks. A schema, regex or grammar that does not
compile is the client's mistake: InvalidParameterError("structured", why).
"""

from __future__ import annotations

import json
import logging
import re

try:
    import re._parser as _sre  # Python >= 3.11
except ImportError:  # pragma: no cover - Python 3.10
    import sre_parse as _sre

import torch
import xgrammar as xgr

from servescope.config import StructuredOutput
from servescope.errors import InvalidParameterError
from servescope.structured.matcher import Matcher

logger = logging.getLogger(__name__)


class GrammarCompiler:
    """hf_tokenizer: the transformers tokenizer; vocab_size: the model's logits width (may exceed
    the tokenizer's); eos_token_ids: the ids that end a sample, allowed only where the grammar is
    complete."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids, max_threads: int = 1, tokenizer_info=None):
        """tokenizer_info: an xgrammar TokenizerInfo to use instead of hf_tokenizer's (a made-up
        vocabulary, as the tests use)."""
        self.vocab_size = vocab_size
        self.info = tokenizer_info or xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size,
                                                                         stop_token_ids=list(eos_token_ids))
        self.max_threads = max_threads
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads)
        # JSON forbids raw control characters in strings, but xgrammar's JSON strings let them
        # through (a random model emits them): JSON constraints also mask every token holding one
        self.json_allowed = _without_control_chars(self.info.decoded_vocab, vocab_size)

    def compile(self, spec: StructuredOutput):
        """A compiled grammar for spec; raises InvalidParameterError when it cannot compile or no
        output can ever satisfy it (not even its first token)."""
        try:
            compiled = self._compile(spec)
        except InvalidParameterError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError/ValueError with the parser's reason
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise InvalidParameterError("structured", f"the {spec.kind} constraint does not compile: {msg}") from None
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
        if not bool(bitmask.any()):
            raise InvalidParameterError("structured", f"the {spec.kind} constraint can match nothing")
        return compiled

    def set_cache_limit(self, limit_bytes: int) -> None:
        """Keep at most limit_bytes of compiled grammars (xgrammar's LRU; unlimited by default).
        Replaces the compiler, and with it the cache: call it before the first compile."""
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=self.max_threads,
                                             cache_limit_bytes=int(limit_bytes))

    def cache_bytes(self) -> int:
        """Bytes of compiled grammars in the cache, by xgrammar's own accounting."""
        return int(self._compiler.get_cache_size_bytes())

    def matcher(self, spec: StructuredOutput) -> Matcher:
        """A matcher for one sample: over spec.compiled when the caller compiled it already."""
        allowed = self.json_allowed if spec.kind in ("json", "json_object") else None
        compiled = spec.compiled if spec.compiled is not None else self.compile(spec)
        return Matcher(xgr.GrammarMatcher(compiled), allowed)

    def _compile(self, spec: StructuredOutput):
        if spec.kind == "json":
            schema = json.loads(spec.spec)
            if not isinstance(schema, dict):
                raise InvalidParameterError("structured", "a JSON schema must be an object")
            return self._compiler.compile_json_schema(spec.spec, any_whitespace=False, strict_mode=True)
        if spec.kind == "json_object":
            return self._compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if spec.kind == "regex":
            _check_regex(spec.spec)
            return self._compiler.compile_regex(spec.spec)
        if spec.kind == "choice":
            return self._compiler.compile_grammar(
                "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.spec))
        return self._compiler.compile_grammar(spec.spec)


def _without_control_chars(decoded_vocab: list, vocab_size: int) -> torch.Tensor:
    """A bitmask row [W] with the bit of every token whose bytes hold a control character cleared."""
    row = xgr.allocate_token_bitmask(1, vocab_size)[0]  # all ones
    bad = [i for i, b in enumerate(decoded_vocab) if i < vocab_size and any(c < 0x20 for c in b)]
    if bad:
        ids = torch.tensor(bad)
        words = torch.zeros_like(row)
        words.index_put_((ids // 32,), torch.ones_like(ids, dtype=torch.int32) << (ids % 32).to(torch.int32),
                         accumulate=True)  # distinct bits per word: the sum is their OR
        row &= ~words
    return row


def _check_regex(pattern: str) -> None:
    """Python's parser first: it names the error position (xgrammar's messages are terse); then the
    regex must match something (an empty character class like [^\\s\\S] in a required place matches
    nothing, and a grammar of it would dead-end mid-output)."""
    try:
        re.compile(pattern)
        tree = _sre.parse(pattern)
    except re.error as e:
        raise InvalidParameterError("structured", f"the regex does not parse: {e}") from None
    if _matches_nothing(tree):
        raise InvalidParameterError("structured", "the regex can match nothing")


_COMPLEMENTS = [{"CATEGORY_SPACE", "CATEGORY_NOT_SPACE"}, {"CATEGORY_DIGIT", "CATEGORY_NOT_DIGIT"},
                {"CATEGORY_WORD", "CATEGORY_NOT_WORD"}]


def _matches_nothing(seq) -> bool:
    """Whether a parsed regex (a sequence of (op, arg)) has an empty language; conservative: False
    when unsure."""
    for op, arg in seq:
        name = str(op)
        if name == "IN" and _empty_class(arg):
            return True
        if name == "BRANCH" and all(_matches_nothing(b) for b in arg[1]):
            return True
        if name == "SUBPATTERN" and _matches_nothing(arg[-1]):
            return True
        if name in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") and arg[0] > 0 and _matches_nothing(arg[2]):
            return True
    return False


def _empty_class(items) -> bool:
    if not items:
        return True
    if str(items[0][0]) != "NEGATE":
        return False
    cats = {str(a) for op, a in items[1:] if str(op) == "CATEGORY"}
    return any(pair <= cats for pair in _COMPLEMENTS)
