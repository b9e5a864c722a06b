"""Cheap checks on a parsed request, run before anything expensive (tokenising, template rendering,
grammar compiling, queuing): the caps of ServerLimits, text that cannot be encoded, the queue.

Each endpoint calls `check_request(ctx, req)` first; the checks read only the fields a request has,
so the same function serves every request model (completions, chat, embeddings and any endpoint
added later that carries the same fields). A failed check is an InvalidParameterError naming the
field (400) or QueueFullError (429); nothing has been queued or computed.
"""

from __future__ import annotations

import re
from typing import Optional

from pydantic import BaseModel

from servescope.errors import InvalidParameterError

_SURROGATE = re.compile(r"[\ud800-\udfff]")


def check_request(ctx, req) -> None:
    """Every cheap check that applies to `req`; the queue last (a 429 only for a request that would
    otherwise have been served)."""
    limits = ctx.limits
    check_text(req)
    _check_stops(limits, req, ctx.engine.vocab_size)
    _check_structured_combination(req)
    tools = getattr(req, "tools", None)
    if tools is not None and len(tools) > limits.max_tools:
        raise InvalidParameterError(
            "tools", f"at most {limits.max_tools} tools per request, got {len(tools)}"
        )
    messages = getattr(req, "messages", None)
    if messages is not None:
        chars = sum(len(t) for m in messages for t in _message_texts(m))
        check_prompt_chars(ctx, chars, "messages")
    ctx.engine.check_capacity(1, ctx.max_queue)


def check_text(value, param: Optional[str] = None) -> None:
    """Reject strings holding a lone UTF-16 surrogate (valid JSON, "\\ud800", but no Unicode text:
    neither the tokenizer nor the response's UTF-8 can encode it)."""
    bad = _find_surrogate(value, param)
    if bad is not None:
        raise InvalidParameterError(bad or None, "the text holds a lone UTF-16 surrogate (not valid Unicode)")


def _find_surrogate(value, path: Optional[str]):
    stack = [(value, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                return p or ""
        elif isinstance(v, dict):
            for k, x in v.items():
                if isinstance(k, str) and _SURROGATE.search(k):
                    return p or ""
                stack.append((x, f"{p}.{k}" if p else str(k)))
        elif isinstance(v, (list, tuple)):
            if v and not isinstance(v[0], (int, float, bool)):  # token id lists: nothing to look at
                stack.extend((x, f"{p}[{i}]" if p else f"[{i}]") for i, x in enumerate(v))
        elif isinstance(v, BaseModel):
            fields = dict(v.__dict__)
            fields.update(getattr(v, "__pydantic_extra__", None) or {})
            stack.extend((x, f"{p}.{k}" if p else k) for k, x in fields.items() if x is not None)
    return None


def check_prompt_chars(ctx, n: int, param: str) -> None:
    limit = max_prompt_chars(ctx)
    if n > limit:
        raise InvalidParameterError(
            param,
            f"the prompt text ({n} characters) is over the limit of {limit} "
            f"characters (more than {ctx.engine.max_model_len} tokens)",
        )


def max_prompt_chars(ctx) -> int:
    """The configured limit, else the most characters that can fit in the context: no token covers more
    characters than its vocabulary entry has, and a normaliser may join two into one (x2)."""
    if ctx.limits.max_prompt_chars is not None:
        return ctx.limits.max_prompt_chars
    if ctx.derived_prompt_chars is None:
        ctx.derived_prompt_chars = ctx.engine.max_model_len * 2 * _longest_vocab_entry(ctx.engine.tokenizer)
    return ctx.derived_prompt_chars


def _longest_vocab_entry(tokenizer) -> int:
    if tokenizer is None:
        return 1
    try:
        return max(len(k) for k in tokenizer.hf.get_vocab())
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary table: a generous bound
        return 256


def _message_texts(m):
    content = m.content
    if isinstance(content, str):
        yield content
    elif isinstance(content, list):
        for part in content:
            text = getattr(part, "text", None)
            if isinstance(text, str):
                yield text
    for call in getattr(m, "tool_calls", None) or ():
        yield call.function.arguments


def _check_stops(limits, req, vocab_size: int) -> None:
    stop = getattr(req, "stop", None)
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > limits.max_stop_strings:
        raise InvalidParameterError(
            "stop", f"at most {limits.max_stop_strings} stop strings, got {len(stops)}"
        )
    if any(len(s) > limits.max_stop_string_chars for s in stops):
        raise InvalidParameterError(
            "stop", f"a stop string is longer than {limits.max_stop_string_chars} characters"
        )
    ids = getattr(req, "stop_token_ids", None)
    if ids is not None and len(ids) > limits.max_stop_token_ids:
        raise InvalidParameterError(
            "stop_token_ids", f"at most {limits.max_stop_token_ids} stop_token_ids, got {len(ids)}"
        )
    if ids and not all(0 <= t < vocab_size for t in ids):
        raise InvalidParameterError("stop_token_ids", f"stop_token_ids must be in 0..{vocab_size - 1}")


def _check_structured_combination(req) -> None:
    """A grammar ends the output where it is complete (EOS is then the only token it allows):
    ignore_eos or min_tokens would forbid the only token left."""
    rf, so = getattr(req, "response_format", None), getattr(req, "structured_outputs", None)
    tool_choice = getattr(req, "tool_choice", None)
    constrained = (
        (rf is not None and rf.type != "text")
        or so is not None
        or (tool_choice is not None and tool_choice not in ("none", "auto"))
    )
    if not constrained:
        return
    if getattr(req, "ignore_eos", False):
        raise InvalidParameterError(
            "ignore_eos",
            "ignore_eos cannot be combined with a structured output "
            "(the grammar ends the output where it is complete)",
        )
    if getattr(req, "min_tokens", 0):
        raise InvalidParameterError(
            "min_tokens",
            "min_tokens cannot be combined with a structured output "
            "(the grammar ends the output where it is complete)",
        )


def render_options(ctx) -> dict:
    """The chat-template options of ServerLimits, as AsyncEngine.render_chat takes them."""
    return {
        "content_as_text": not ctx.limits.special_tokens_in_content,
        "timeout_s": ctx.limits.chat_template_timeout_s,
    }


def limits_report(ctx) -> dict:
    """What /v1/internals shows: every limit, the derived prompt-length limit, and the grammar
    service's state (its cache's bytes by xgrammar's own accounting, compiles over the deadline)."""
    report = ctx.limits.as_dict()
    report["max_prompt_chars_in_effect"] = max_prompt_chars(ctx) if ctx.engine.tokenizer is not None else None
    if ctx.grammars is not None:
        report["grammar_cache_bytes_used"] = ctx.grammars.cache_bytes()
        report["grammar_compile_timeouts"] = ctx.grammars.timeouts
    return report
