"""encode_chat: a conversation -> (prompt text, token ids), where text the client wrote stays text.

A rendered chat prompt mixes the template's control tokens (`<|im_start|>`, `<|im_end|>`, ...) with
message text. Tokenising the whole string with special tokens parsed (what transformers'
`apply_chat_template(tokenize=True)`, vLLM and SGLang do) turns a control token *written* in a
message into a real one: a user who types `<|im_end|><|im_start|>system` opens a system turn. OpenAI's
tokenizer refuses such text unless told otherwise (tiktoken's `disallowed_special`); here it is
plain text unless the operator opts in (`--special-tokens-in-content`):

1. Messages without any control-token string in their text (nearly all) take the ordinary path:
   render, tokenise with special tokens parsed. Nothing changes for them.
2. Otherwise the template is rendered a second time with every client string (message content,
   name, tool-call arguments) replaced by a random sentinel. If putting the strings back into that
   render gives exactly the first render, the positions of the client's text are known: the
   template's own control tokens are parsed, and the client's text is tokenised with special tokens
   split (`split_special_tokens`), between the same cut points an ordinary tokenisation uses.
3. If the template transformed the text (trimmed it, sliced it), the positions are not known: the
   request is refused (400) rather than guessed at.
Tool definitions holding a control-token string are refused (400): they are rendered by templates in
too many ways (JSON, Hermes text) to place.
"""

from __future__ import annotations

import re
import secrets
from typing import Callable, Optional

from servescope.errors import InvalidParameterError
from servescope.tokenizer.chat_template import validate_messages


def control_token_pattern(tokenizer) -> Optional[re.Pattern]:
    """A regex matching any special (control) token's text, longest first; None if there are none."""
    texts = {tokenizer.hf.convert_ids_to_tokens(int(i)) for i in tokenizer.special_token_ids}
    texts = sorted((t for t in texts if isinstance(t, str) and t), key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in texts)) if texts else None


def encode_chat(
    tokenizer,
    render: Callable[[list, Optional[list]], str],
    messages: list,
    tools: Optional[list],
    content_as_text: bool = True,
    add_special_tokens: bool = False,
    client_values: Optional[dict] = None,
) -> tuple:
    """(prompt text, token ids). render(messages, tools) renders the template (the tokenizer's
    apply_chat_template with its options bound). add_special_tokens: the tokenizer's own (BOS) too,
    although the template holds them already. client_values: other values the client gave the
    template (its variables, documents), refused like tools when they hold a control token."""
    text = render(messages, tools)
    pattern = tokenizer.control_pattern if content_as_text else None
    if pattern is None:
        return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)
    for param, value in (("tools", tools), ("chat_template_kwargs", client_values)):
        found = pattern.search(repr(value)) if value else None
        if found:
            raise InvalidParameterError(param, f"{param} holds a control token's text ({found.group(0)!r})")
    msgs = validate_messages(messages)
    strings: list = []
    masked = [_mask(m, strings) for m in msgs]
    if not any(pattern.search(s) for s in strings):
        return text, tokenizer.encode(text, add_special_tokens=add_special_tokens)
    nonce = secrets.token_hex(8)
    sentinel = re.compile("\ue000" + nonce + r":(\d+)\ue001")
    with_sentinels = render([_unmask(m, lambda i: f"\ue000{nonce}:{i}\ue001") for m in masked], tools)
    pieces = sentinel.split(with_sentinels)  # template text, index, template text, index, ...
    if "".join(p if k % 2 == 0 else strings[int(p)] for k, p in enumerate(pieces)) != text:
        bad = next(s for s in strings if pattern.search(s))
        raise InvalidParameterError(
            "messages",
            f"a message holds a control token's text "
            f"({pattern.search(bad).group(0)!r}), and this chat template "
            f"transforms message text, so it cannot be kept as plain text",
        )
    runs = [(p, True) if k % 2 == 0 else (strings[int(p)], False) for k, p in enumerate(pieces)]
    ids = encode_runs(tokenizer, pattern, runs)
    return text, _with_special_tokens(tokenizer.hf, ids) if add_special_tokens else ids


def encode_runs(tokenizer, pattern: re.Pattern, runs: list) -> list:
    """Token ids of the concatenated runs [(text, from_template)]: control tokens are parsed in the
    template's runs only; the text between two parsed control tokens is tokenised in one piece with
    special tokens split (the cut points of an ordinary tokenisation, which splits at every added
    token first)."""
    hf = tokenizer.hf
    ids: list = []
    pending: list = []  # text since the last parsed control token
    strip_next = False
    for text, from_template in runs:
        if not from_template:
            pending.append(text)
            continue
        pos = 0
        for m in pattern.finditer(text):
            pending.append(text[pos : m.start()])
            piece, strip_next = _close(hf, pending, m.group(0), strip_next)
            ids.extend(piece)
            ids.append(hf.convert_tokens_to_ids(m.group(0)))
            pending, pos = [], m.end()
        pending.append(text[pos:])
    ids.extend(_close(hf, pending, None, strip_next)[0])
    return ids


def _close(hf, pending: list, token: Optional[str], strip_start: bool) -> tuple:
    """(ids of the pending text, whether the next text loses its leading space) honouring the
    AddedToken lstrip/rstrip of the control tokens on either side."""
    text = "".join(pending)
    if strip_start:
        text = text.lstrip()
    added = _added(hf, token) if token is not None else None
    if added is not None and getattr(added, "lstrip", False):
        text = text.rstrip()
    ids = hf.encode(text, add_special_tokens=False, split_special_tokens=True) if text else []
    return ids, bool(added is not None and getattr(added, "rstrip", False))


def _with_special_tokens(hf, ids: list) -> list:
    """ids with the tokenizer's own special tokens around them (BOS, EOS: whatever its post-processor
    adds around a text), found by encoding one plain character with and without them."""
    bare = hf.encode("a", add_special_tokens=False)
    full = hf.encode("a", add_special_tokens=True)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i] + list(ids) + full[i + len(bare):]
    return list(ids)


def _added(hf, token: str):
    tid = hf.convert_tokens_to_ids(token)
    return hf.added_tokens_decoder.get(tid)


def _mask(message: dict, strings: list) -> dict:
    """The message with each client string replaced by its index in `strings` (an int marker)."""
    out = dict(message)
    for key in ("content", "name", "tool_call_id"):
        if isinstance(out.get(key), str) and out[key]:
            strings.append(out[key])
            out[key] = _Marker(len(strings) - 1)
    calls = out.get("tool_calls")
    if isinstance(calls, list):
        out["tool_calls"] = [_mask_call(c, strings) for c in calls]
    return out


def _mask_call(call, strings: list):
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str) and fn["arguments"]:
        strings.append(fn["arguments"])
        fn["arguments"] = _Marker(len(strings) - 1)
    return {**call, "function": fn}


class _Marker(int):
    pass


def _unmask(value, sentinel: Callable[[int], str]):
    if isinstance(value, _Marker):
        return sentinel(int(value))
    if isinstance(value, dict):
        return {k: _unmask(v, sentinel) for k, v in value.items()}
    if isinstance(value, list):
        return [_unmask(v, sentinel) for v in value]
    return value
