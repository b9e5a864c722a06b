"""Tool calling on chat completions: tool_choice -> a constraint, the model's text -> tool_calls,
and the same as OpenAI's streamed deltas.

Modes (vLLM's behaviour): `none` renders no tools and parses nothing; `auto` renders them and parses
Hermes/Qwen `<tool_call>{"name", "arguments"}</tool_call>` blocks, a Llama-3 style JSON object
`{"name", "parameters"}`, or gpt-oss's harmony messages to a function (`<|channel|>commentary
to=functions.NAME ... <|message|>ARGS<|call|>`, the recipient in the role or the channel header; the
final channel's text is the content); `required` constrains the output to a JSON array of {"name",
"parameters"} over the tools (one item unless parallel_tool_calls); a named function constrains the
output to that function's arguments. So required and named calls always validate against the
tool's schema. finish_reason is "tool_calls" when auto/required produced calls, "stop" for named.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Optional

from servescope.config import StructuredOutput
from servescope.errors import InvalidParameterError

TAG_OPEN, TAG_CLOSE = "<tool_call>", "</tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


class ToolPlan:
    """What a chat request's tools and tool_choice mean for rendering, constraining and parsing."""

    def __init__(self, req):
        tools = req.tools or []
        choice = req.tool_choice
        if choice is not None and not tools and choice != "none":
            raise InvalidParameterError("tool_choice", "tool_choice needs tools")
        self.functions = {t.function.name: t.function for t in tools}
        if len(self.functions) != len(tools):
            raise InvalidParameterError("tools", "tool function names must be unique")
        self.parallel = req.parallel_tool_calls is not False
        if not tools or choice == "none":
            self.mode, self.named = "none", None
        elif choice is None or choice == "auto":
            self.mode, self.named = "auto", None
        elif choice == "required":
            self.mode, self.named = "required", None
        else:
            name = choice.function.name
            if name not in self.functions:
                raise InvalidParameterError("tool_choice", f"tool_choice names {name!r}, which is not among the "
                                                           f"tools ({', '.join(sorted(self.functions))})")
            self.mode, self.named = "named", name
        self.rendered = [t.model_dump(exclude_none=True) for t in tools] if self.mode != "none" else None

    def constraint(self) -> Optional[StructuredOutput]:
        if self.mode == "named":
            return StructuredOutput("json", json.dumps(_params(self.functions[self.named])))
        if self.mode == "required":
            items = {"anyOf": [{"type": "object", "properties": {"name": {"const": n}, "parameters": _params(f)},
                                "required": ["name", "parameters"], "additionalProperties": False}
                               for n, f in self.functions.items()]}
            schema = {"type": "array", "items": items, "minItems": 1}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutput("json", json.dumps(schema))
        return None

    def parse(self, text: str) -> tuple:
        """(content or None, [tool call dicts]) of a finished output."""
        if self.mode == "none":
            return text, []
        if self.mode == "named":
            return None, [_call(self.named, text)]
        if self.mode == "required":
            try:
                items = json.loads(text)
            except json.JSONDecodeError:
                return text, []  # cut off by max_tokens: what the model wrote, as content
            return None, [_call(i["name"], json.dumps(i["parameters"], ensure_ascii=False)) for i in items]
        return _parse_auto(text, self.parallel)

    def finish_reason(self, calls: list, finish: Optional[str]) -> Optional[str]:
        if calls and finish == "stop" and self.mode in ("auto", "required"):
            return "tool_calls"
        return finish


def _params(fn) -> dict:
    return fn.parameters if fn.parameters else {"type": "object", "properties": {}}


def _call(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _parse_auto(text: str, parallel: bool) -> tuple:
    if "to=functions." in text and "<|message|>" in text:
        harmony = _harmony_calls(text)
        if harmony[1]:
            return harmony[0], harmony[1][:None if parallel else 1]
    idx = text.find(TAG_OPEN)
    if idx >= 0:
        calls = []
        for body in _HERMES.findall(text[idx:]):
            obj = _json_object(body)
            if obj is not None and isinstance(obj.get("name"), str):
                calls.append(_call(obj["name"], json.dumps(obj.get("arguments", {}), ensure_ascii=False)))
        if calls:
            return (text[:idx].rstrip() or None), calls[:None if parallel else 1]
        return text, []
    obj = _json_object(text.strip().removeprefix("<|python_tag|>"))
    if obj is not None and isinstance(obj.get("name"), str) and ("parameters" in obj or "arguments" in obj):
        args = obj.get("parameters", obj.get("arguments"))
        return None, [_call(obj["name"], json.dumps(args, ensure_ascii=False))]
    return text, []


_RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")


def _harmony_calls(text: str) -> tuple:
    """(content or None, calls) of harmony messages: each `[<|start|>assistant] header <|message|> body`, a
    call where the header names a function recipient (its body, up to <|call|>, the arguments), content
    where it is the final channel (or has no channel); analysis messages are reasoning, not content."""
    calls, content = [], []
    for seg in text.split("<|start|>"):
        head, sep, body = seg.removeprefix("assistant").partition("<|message|>")
        if not sep:
            continue
        body = re.split(r"<\|(?:call|end|return)\|>", body, maxsplit=1)[0]
        m = _RECIPIENT.search(head)
        if m:
            obj = _json_object(body.strip())
            calls.append(_call(m.group(1), json.dumps(obj, ensure_ascii=False) if obj is not None else body.strip()))
        elif "<|channel|>" not in head or "<|channel|>final" in head:
            content.append(body)
    return ("".join(content) or None), calls


def _json_object(s: str) -> Optional[dict]:
    try:
        obj = json.loads(s)
    except json.JSONDecodeError:
        return None
    return obj if isinstance(obj, dict) else None


class ToolStreamer:
    """Turns a growing output text into chat deltas, so that the deltas reassemble to ToolPlan.parse:
    content is sent while it cannot be the start of a tool call; a named call's arguments stream as
    they come; anything else is parsed when the output ends."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.sent = ""  # content sent
        self.named_id: Optional[str] = None
        self.args_sent = 0

    def feed(self, text: str, finished: bool) -> tuple:
        """(content delta, tool_call deltas) for the text so far."""
        if self.plan.mode == "named":
            return "", self._named(text)
        if self.plan.mode == "none":
            return self._content(text), []
        if not finished:
            held = ("{", "[", "<|python_tag|>", "<|start|>", "<|channel|>")  # (may yet be a call: parsed at the end)
            t = text.lstrip()
            safe = "" if t.startswith(held) or any(h.startswith(t) for h in held) else _safe_prefix(text)
            return self._content(safe), []
        content, calls = self.plan.parse(text)
        return self._content(content or ""), [dict(c, index=i) for i, c in enumerate(calls)]

    def _content(self, upto: str) -> str:
        if not upto.startswith(self.sent) or len(upto) <= len(self.sent):
            return ""
        delta, self.sent = upto[len(self.sent):], upto
        return delta

    def _named(self, text: str) -> list:
        out = []
        if self.named_id is None:
            self.named_id = f"call_{uuid.uuid4().hex[:24]}"
            out.append({"index": 0, "id": self.named_id, "type": "function",
                        "function": {"name": self.plan.named, "arguments": ""}})
        if len(text) > self.args_sent:
            out.append({"index": 0, "function": {"arguments": text[self.args_sent:]}})
            self.args_sent = len(text)
        return out


def _safe_prefix(text: str) -> str:
    """The text before anything that may still become a tool call, less trailing whitespace."""
    idx = text.find(TAG_OPEN)
    if idx < 0:
        for k in range(min(len(TAG_OPEN) - 1, len(text)), 0, -1):
            if TAG_OPEN.startswith(text[-k:]):
                idx = len(text) - k
                break
    return (text if idx < 0 else text[:idx]).rstrip()
