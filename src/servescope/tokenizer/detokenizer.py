"""Incremental detokenisation: turn a stream of token ids into text deltas, one token at a time.

Decoding only the new token is wrong in two ways: byte-level tokens may hold part of a UTF-8
character (an emoji spread over three tokens), and some decoders change a token's text depending
on its left neighbour (SentencePiece's leading space). So, as in vLLM's detokenize_incrementally,
we keep two offsets into the id list:

    ids:  ... [prefix_offset ........ read_offset ........ end)
              |<- context, already emitted ->|<- not yet emitted ->|

and decode the short window from prefix_offset twice: without and with the unread tokens. The
difference is the new text. Invariant: text emitted so far == decode(output ids up to read_offset).
While the decoded window ends in U+FFFD (an incomplete character), we emit nothing and wait; the
window stays a handful of tokens, so each step costs O(1) decodes of a few tokens.
"""

from __future__ import annotations

from typing import Iterable

# How many prompt tokens to keep as left context for the first generated tokens (vLLM uses 5).
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Feed token ids with `add`; get back the text each one completes. `text` is everything so far."""

    def __init__(self, tokenizer, prompt_token_ids: Iterable[int] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._skip = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        context = [t for t in list(prompt_token_ids)[-_PROMPT_CONTEXT:] if t not in self._skip]
        self._ids: list[int] = context  # window: context + unread tokens
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._pieces: list[str] = []
        self.output_token_ids: list[int] = []

    @property
    def text(self) -> str:
        """All text emitted so far (excludes held-back incomplete characters; see `flush`)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def add(self, token_id: int) -> str:
        """Append one generated token; return the new text it completes (may be "")."""
        token_id = int(token_id)
        self.output_token_ids.append(token_id)
        if token_id in self._skip:
            return ""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            # nothing printable yet, or the last character is still incomplete: hold back
            return ""
        delta = new_text[len(prefix_text):]
        # the tokens just read become the next window's left context; drop what is older
        drop = self._read_offset
        self._ids = self._ids[drop:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._pieces.append(delta)
        return delta

    def flush(self) -> str:
        """At the end of a sequence: emit whatever was held back (an incomplete character decodes to U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""
        self._ids = self._ids[self._read_offset:]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        if delta:
            self._pieces.append(delta)
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False) if ids else ""
