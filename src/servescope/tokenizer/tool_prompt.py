"""Tools in a conversation for a chat template that does not render them itself.

Templates that know tools (Qwen2.5, Llama 3.1, Hermes) get `tools` and the messages as they are.
For one that never mentions `tools` (SmolLM2's ChatML), the conversation is rewritten the way
Hermes/Qwen templates render it: a system message lists the functions as JSON inside <tools> and
asks for <tool_call>{"name": ..., "arguments": ...}</tool_call>; an assistant turn's tool_calls
become that text; a tool result becomes a user turn wrapped in <tool_response>.
"""

from __future__ import annotations

import json

TOOLS_INSTRUCTIONS = (
    "You may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


def template_renders_tools(template: str) -> bool:
    return "tools" in template


def messages_with_tools(messages: list, tools: list) -> list:
    """The conversation with the tool list and the tool turns written out as Hermes text."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    system = TOOLS_INSTRUCTIONS.format(tools=listing)
    out = []
    if messages and messages[0].get("role") == "system":
        system = f"{messages[0].get('content') or ''}\n\n{system}"
        messages = messages[1:]
    out.append({"role": "system", "content": system})
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            calls = "\n".join(_call_text(c) for c in m["tool_calls"])
            text = (m.get("content") or "")
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls})
        elif m.get("role") == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"})
        else:
            out.append(m)
    return out


def _call_text(call: dict) -> str:
    fn = call.get("function", {})
    args = fn.get("arguments", "{}")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        pass  # kept as the string the client sent
    return "<tool_call>\n" + json.dumps({"name": fn.get("name"), "arguments": args}, ensure_ascii=False) + \
        "\n</tool_call>"
