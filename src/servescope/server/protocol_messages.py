"""Anthropic's Messages API request (POST /v1/messages, /v1/messages/count_tokens) and its
translation into the chat request that chat_engine.py runs: system -> a system message, content
blocks -> text / tool_calls / tool messages / reasoning, tool_choice any -> required, thinking ->
the template's enable_thinking and the thinking budget, output_config.format -> a JSON schema.
A block or field this server cannot honour is a 400 naming it.
"""

from __future__ import annotations

import json
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr

from servescope.errors import InvalidParameterError
from servescope.server.protocol_base import Base, Float

PARAM_NAMES = {
    "max_completion_tokens": "max_tokens",
    "stop": "stop_sequences",
    "response_format": "output_config",
    "max_reasoning_tokens": "thinking.budget_tokens",
}
NEUTRAL = {
    "service_tier": (None, "auto", "standard_only"),
    "cache_control": None,
    "speed": (None, "standard"),
    "inference_geo": None,
    "anthropic_version": None,
}


class AnthropicTool(Base):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[StrictStr] = None
    input_schema: Dict[str, Any]
    type: Optional[Literal["custom"]] = None
    cache_control: Optional[Dict[str, Any]] = None  # prefix caching is automatic here
    strict: Optional[StrictBool] = None


class AnthropicToolChoice(Base):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[StrictStr] = None
    disable_parallel_tool_use: Optional[StrictBool] = None


class ThinkingConfig(Base):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: Optional[StrictInt] = None
    display: Optional[StrictStr] = None


class JsonFormat(Base):
    type: Literal["json_schema"]
    schema_: Dict[str, Any] = Field(alias="schema")


class OutputConfig(Base):
    format: Optional[JsonFormat] = None
    effort: Optional[StrictStr] = None  # handed to the chat template as reasoning_effort


class Metadata(Base):
    user_id: Optional[StrictStr] = None


class MessagesRequest(Base):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    model: StrictStr
    max_tokens: Optional[StrictInt] = None  # required by create, absent from count_tokens
    messages: List[Dict[str, Any]] = Field(min_length=1)
    system: Optional[Union[StrictStr, List[Dict[str, Any]]]] = None
    stop_sequences: Optional[List[StrictStr]] = None
    stream: Optional[StrictBool] = False
    temperature: Optional[Float] = None
    top_p: Optional[Float] = None
    top_k: Optional[StrictInt] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[AnthropicToolChoice] = None
    thinking: Optional[ThinkingConfig] = None
    output_config: Optional[OutputConfig] = None
    metadata: Optional[Metadata] = None


def _text(block: dict, where: str) -> str:
    if not isinstance(block.get("text"), str):
        raise InvalidParameterError(f"{where}.text", f"{where}.text must be a string")
    return block["text"]


def _tool_result_text(block: dict, where: str) -> str:
    content = block.get("content", "")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, c in enumerate(content):
            if not isinstance(c, dict) or c.get("type") != "text":
                raise InvalidParameterError(
                    f"{where}.content[{j}]", f"{where}.content[{j}]: only text is supported"
                )
            parts.append(_text(c, f"{where}.content[{j}]"))
        text = "".join(parts)
    else:
        raise InvalidParameterError(f"{where}.content", f"{where}.content must be a string or text blocks")
    return ("Error: " + text) if block.get("is_error") else text


def _blocks(content, where: str) -> list:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise InvalidParameterError(where, f"{where} must be a string or a list of content blocks")
    return content


def _message(m: dict, i: int) -> list:
    """One Anthropic message -> chat messages (a user turn's tool results become tool messages)."""
    role = m.get("role")
    if role not in ("user", "assistant"):
        raise InvalidParameterError(
            f"messages[{i}].role", f"messages[{i}].role must be user or assistant, got {role!r}"
        )
    texts, calls, results, reasoning = [], [], [], []
    blocks = _blocks(m.get("content"), f"messages[{i}].content")
    if not blocks or (blocks == [{"type": "text", "text": ""}] and role == "user"):
        raise InvalidParameterError(f"messages[{i}].content", f"messages[{i}]: content must not be empty")
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        kind = b.get("type") if isinstance(b, dict) else None
        if kind == "text":
            texts.append(_text(b, where))
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(b.get("id"), str) or not isinstance(b.get("name"), str):
                raise InvalidParameterError(where, f"{where}: tool_use needs id and name")
            calls.append(
                {
                    "id": b["id"],
                    "type": "function",
                    "function": {
                        "name": b["name"],
                        "arguments": json.dumps(b.get("input", {}), ensure_ascii=False),
                    },
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(b.get("tool_use_id"), str):
                raise InvalidParameterError(f"{where}.tool_use_id", f"{where}.tool_use_id must be a string")
            results.append(
                {"role": "tool", "tool_call_id": b["tool_use_id"], "content": _tool_result_text(b, where)}
            )
        elif kind == "thinking" and role == "assistant":
            reasoning.append(b.get("thinking") or "")
        else:
            raise InvalidParameterError(
                f"{where}.type",
                f"{where}: blocks of type {kind!r} are not supported in a {role} message here",
            )
    out = list(results)
    if texts or calls or not results:
        msg = {"role": role, "content": "".join(texts) if texts or not calls else None}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = "".join(reasoning)
        out.append(msg)
    return out


def _tools(req: MessagesRequest) -> Optional[list]:
    if not req.tools:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.get("type") not in (None, "custom"):
            raise InvalidParameterError(
                f"tools[{i}].type",
                f"tools[{i}]: only custom (client) tools are supported, got {t.get('type')!r}",
            )
        tool = AnthropicTool.model_validate(t)
        fn = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(req: MessagesRequest) -> tuple:
    """(chat tool_choice, parallel_tool_calls)."""
    tc = req.tool_choice
    if tc is None:
        return None, None
    parallel = None if tc.disable_parallel_tool_use is None else not tc.disable_parallel_tool_use
    if tc.type == "tool":
        if not tc.name:
            raise InvalidParameterError("tool_choice.name", "tool_choice of type tool needs a name")
        return {"type": "function", "function": {"name": tc.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[tc.type], parallel


def chat_request_body(req: MessagesRequest, has_reasoning_parser: bool) -> dict:
    """The chat request (a dict for ChatCompletionRequest) of a Messages request."""
    messages = []
    if req.system:
        system = (
            req.system
            if isinstance(req.system, str)
            else "".join(_text(b, f"system[{k}]") for k, b in enumerate(req.system))
        )
        messages.append({"role": "system", "content": system})
    for i, m in enumerate(req.messages):
        messages += _message(m, i)
    choice, parallel = _tool_choice(req)
    body: dict = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_tokens,
        "stop": req.stop_sequences,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "tools": _tools(req),
        "tool_choice": choice,
        "parallel_tool_calls": parallel,
        "user": req.metadata.user_id if req.metadata else None,
    }
    if messages[-1]["role"] == "assistant" and messages[-1].get("content"):  # a prefill: continue it
        body.update(add_generation_prompt=False, continue_final_message=True)
    th = req.thinking
    if th is not None and th.type == "enabled" and not has_reasoning_parser:
        raise InvalidParameterError(
            "thinking", "thinking needs a reasoning parser (serve --reasoning-parser)"
        )
    if th is not None and th.type in ("enabled", "disabled"):
        body["chat_template_kwargs"] = {"enable_thinking": th.type == "enabled"}
        if th.type == "enabled" and th.budget_tokens is not None and has_reasoning_parser:
            body["max_reasoning_tokens"] = th.budget_tokens
    oc = req.output_config
    if oc is not None and oc.format is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "output", "schema": oc.format.schema_},
        }
    if oc is not None and oc.effort is not None:
        body["reasoning_effort"] = oc.effort
    return {k: v for k, v in body.items() if v is not None}
