"""Chat templates: validate OpenAI-style messages and render them in a sandboxed Jinja environment.

Templates come with model files, so they are untrusted code. They render in jinja2's
ImmutableSandboxedEnvironment (no underscore attributes, no mutation of passed-in objects) with the
same helpers transformers offers (`raise_exception`, `strftime_now`, a `tojson` that does not
HTML-escape, `{% generation %}` blocks, loop controls) and the same whitespace rules
(trim_blocks, lstrip_blocks), so a template renders exactly as `tokenizer.apply_chat_template`
would render it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any, Optional

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from servescope.errors import InvalidParameterError
from servescope.tokenizer.deadline import DeadlineExceeded, run_with_deadline

ROLES = ("system", "user", "assistant", "tool")

# Used when a model ships no template: ChatML, which SmolLM2 and Qwen use.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def validate_messages(messages: Any) -> list[dict]:
    """Check a conversation and return plain-dict copies. Raises InvalidParameterError("messages", ...).

    Each message needs `role` in system/user/assistant/tool and string `content`. A list of
    OpenAI text parts ([{"type": "text", "text": ...}]) is joined into one string; an assistant
    message that only carries `tool_calls` may have null content.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidParameterError("messages", "messages must be a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidParameterError("messages", f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise InvalidParameterError(
                "messages", f"messages[{i}].role must be one of {', '.join(ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, (list, tuple)):
            content = _join_text_parts(content, i)
        elif content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise InvalidParameterError(
                "messages", f"messages[{i}].content must be a string, got {type(content).__name__}")
        msg = _plain(dict(m))
        msg["content"] = content
        out.append(msg)
    return out


def _join_text_parts(parts, i: int) -> str:
    texts = []
    for p in parts:
        if not isinstance(p, Mapping) or p.get("type") != "text" or not isinstance(p.get("text"), str):
            raise InvalidParameterError(
                "messages", f"messages[{i}].content: only text parts ({{'type': 'text', 'text': ...}}) are supported")
        texts.append(p["text"])
    return "".join(texts)


def _plain(value: Any) -> Any:
    """Rebuild a value out of JSON types only, so the template never sees objects with methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def render_chat_template(
    template: str,
    messages: list,
    add_generation_prompt: bool = True,
    special_tokens: Optional[dict] = None,
    tools: Optional[list] = None,
    timeout_s: Optional[float] = None,
    documents: Optional[list] = None,
    **kwargs,
) -> str:
    """Validate `messages` and render `template` with them.

    special_tokens: bos_token, eos_token, ... strings the template may reference (as in transformers).
    timeout_s: stop a render that takes longer (InvalidParameterError; None: no limit).
    Errors the template raises (raise_exception, a sandbox violation) become InvalidParameterError.
    """
    msgs = validate_messages(messages)
    compiled = compile_chat_template(template)
    context = {**_plain(special_tokens or {}), **_plain(kwargs)}

    def render():
        return compiled.render(messages=msgs, tools=_plain(tools), documents=_plain(documents),
                               add_generation_prompt=bool(add_generation_prompt), **context)

    try:
        return render() if timeout_s is None else run_with_deadline(render, timeout_s)
    except DeadlineExceeded:
        raise InvalidParameterError("messages", f"the chat template took longer than {timeout_s:g} s "
                                                "to render this conversation") from None
    except jinja2.exceptions.SecurityError as e:
        raise InvalidParameterError("messages", f"the chat template tried an unsafe operation: {e}") from None
    except jinja2.exceptions.TemplateError as e:
        raise InvalidParameterError("messages", f"the chat template rejected the conversation: {e}") from None
    except Exception as e:  # a template bug (e.g. concatenating None): still the conversation's shape
        raise InvalidParameterError(
            "messages", f"the chat template failed on this conversation ({type(e).__name__}: {e})") from None


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (transformers' assistant-mask marker): renders its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Namespace(jinja2.utils.Namespace):
    """jinja's namespace() that refuses underscore names (no way to reach CPython internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore names ({name!r})")


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _dict(*args, **kwargs):
    return dict(*args, **kwargs)


class _StrictSandbox(ImmutableSandboxedEnvironment):
    """Fail loudly on unsafe attribute access (the stock sandbox renders it as an empty string)."""

    def unsafe_undefined(self, obj, attribute):
        raise jinja2.exceptions.SecurityError(
            f"access to attribute {attribute!r} of {type(obj).__name__!r} object is unsafe")


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile a template in the sandbox. Raises jinja2.TemplateSyntaxError on a broken template."""
    env = _StrictSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    env.globals["dict"] = _dict
    return env.from_string(template)
