"""OpenAI's Responses API request (POST /v1/responses) and its translation into the chat request
that chat_engine.py runs: input items -> messages, function tools -> tools, text.format ->
response_format, max_output_tokens -> max_completion_tokens. No silent ignores: a field or item
this server cannot honour is a 400 naming it (input[2].type, tools[0].type, ...).
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr

from servescope.errors import InvalidParameterError
from servescope.server.protocol_base import Base, Float

# a chat request's field -> the Responses field it came from (errors name the field the client sent)
PARAM_NAMES = {
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
    "tool_choice": "tool_choice",
    "tools": "tools",
}
# accepted with the values that change nothing about the answer
NEUTRAL = {
    "service_tier": (None, "auto", "default"),
    "background": (None, False),
    "truncation": (None, "disabled"),
    "include": (None, []),
    "prompt_cache_key": None,
    "safety_identifier": None,
    "user": None,
    "stream_options": None,
    "max_tool_calls": None,
    "prompt_cache_retention": (None,),
}


class FunctionTool(Base):
    type: Literal["function"]
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[StrictStr] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class NamedFunctionChoice(Base):
    type: Literal["function"]
    name: StrictStr


class TextFormat(Base):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[StrictStr] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[StrictStr] = None
    strict: Optional[StrictBool] = None


class TextConfig(Base):
    format: Optional[TextFormat] = None
    verbosity: Optional[Literal["medium"]] = None  # only the default: the model has no verbosity knob


class ReasoningConfig(Base):
    effort: Optional[StrictStr] = None  # handed to the chat template as reasoning_effort
    summary: Optional[StrictStr] = None  # the reasoning is returned whole (reasoning_text), never summarised
    generate_summary: Optional[StrictStr] = None


class ResponsesRequest(Base):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    model: Optional[StrictStr] = None
    input: Union[StrictStr, List[Dict[str, Any]]]
    instructions: Optional[StrictStr] = None
    max_output_tokens: Optional[StrictInt] = None
    temperature: Optional[Float] = None
    top_p: Optional[Float] = None
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[List[Dict[str, Any]]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedFunctionChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = None
    text: Optional[TextConfig] = None
    reasoning: Optional[ReasoningConfig] = None
    previous_response_id: Optional[StrictStr] = None
    store: Optional[StrictBool] = True
    stream: Optional[StrictBool] = False
    metadata: Optional[Dict[str, StrictStr]] = None
    # vLLM's extras
    request_id: Optional[StrictStr] = None
    priority: Optional[StrictInt] = 0
    cache_salt: Optional[StrictStr] = None


def _tools(req: ResponsesRequest) -> Optional[list]:
    if not req.tools:
        return None
    out = []
    for i, t in enumerate(req.tools):
        if t.get("type") != "function":
            raise InvalidParameterError(
                f"tools[{i}].type", f"tools[{i}]: only function tools are supported, got {t.get('type')!r}"
            )
        f = FunctionTool.model_validate(t)
        out.append({"type": "function", "function": f.model_dump(exclude_none=True, exclude={"type"})})
    return out


def _text_of(content, param: str) -> str:
    """A message's content: a string or text parts (input_text, output_text, text)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidParameterError(param, f"{param} must be a string or a list of text parts")
    texts = []
    for j, p in enumerate(content):
        if (
            not isinstance(p, dict)
            or p.get("type") not in ("input_text", "output_text", "text")
            or not isinstance(p.get("text"), str)
        ):
            kind = p.get("type") if isinstance(p, dict) else type(p).__name__
            raise InvalidParameterError(
                f"{param}[{j}]", f"{param}[{j}]: only text parts are supported, got {kind!r}"
            )
        texts.append(p["text"])
    return "".join(texts)


def input_messages(items, start: int = 0) -> list:
    """Responses input items -> chat messages (function calls grouped into assistant turns)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list = []
    pending_reasoning = None
    for i, it in enumerate(items, start):
        kind = it.get("type", "message")
        if kind == "message":
            role = it.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise InvalidParameterError(
                    f"input[{i}].role",
                    f"input[{i}].role must be user, system, developer or assistant, got {role!r}",
                )
            msg = {
                "role": "system" if role == "developer" else role,
                "content": _text_of(it.get("content"), f"input[{i}].content"),
            }
            if role == "assistant" and pending_reasoning:
                msg["reasoning_content"], pending_reasoning = pending_reasoning, None
            out.append(msg)
        elif kind == "function_call":
            call = {
                "id": _str(it, "call_id", i),
                "type": "function",
                "function": {"name": _str(it, "name", i), "arguments": _str(it, "arguments", i)},
            }
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                out[-1]["tool_calls"].append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": _str(it, "call_id", i),
                    "content": _text_of(it.get("output"), f"input[{i}].output"),
                }
            )
        elif kind == "reasoning":  # an earlier turn's reasoning: the template decides whether to show it
            pending_reasoning = "".join(
                c.get("text", "") for c in it.get("content") or [] if isinstance(c, dict)
            )
        else:
            raise InvalidParameterError(
                f"input[{i}].type", f"input[{i}]: items of type {kind!r} are not supported"
            )
    return out


def _str(item: dict, key: str, i: int) -> str:
    v = item.get(key)
    if not isinstance(v, str):
        raise InvalidParameterError(f"input[{i}].{key}", f"input[{i}].{key} must be a string")
    return v


def chat_request_body(req: ResponsesRequest, history: list) -> dict:
    """The chat request (a dict for ChatCompletionRequest) of a Responses request; history: the
    messages of the previous_response_id chain."""
    messages = list(history)
    if req.instructions:  # instructions are not inherited from a previous response (OpenAI's rule)
        messages = [{"role": "system", "content": req.instructions}] + messages
    messages += input_messages(req.input)
    if not messages:
        raise InvalidParameterError("input", "input is empty")
    body: dict = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tools": _tools(req),
        "tool_choice": _tool_choice(req.tool_choice),
        "parallel_tool_calls": req.parallel_tool_calls,
        "request_id": req.request_id,
        "priority": req.priority,
        "cache_salt": req.cache_salt,
    }
    if req.top_logprobs is not None:
        body.update(logprobs=True, top_logprobs=req.top_logprobs)
    fmt = req.text.format if req.text else None
    if fmt is not None and fmt.type == "json_object":
        body["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema_ is None:
            raise InvalidParameterError("text.format.schema", "text.format json_schema needs a schema")
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict},
        }
    if req.reasoning is not None and req.reasoning.effort is not None:
        body["reasoning_effort"] = req.reasoning.effort
    return {k: v for k, v in body.items() if v is not None}


def _tool_choice(choice):
    if isinstance(choice, NamedFunctionChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice
