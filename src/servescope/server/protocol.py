"""OpenAI request models (pydantic). Types are strict: "5" is not a number, true is not a token id,
NaN and Infinity are rejected, so a wrong type is a 400 naming the field, never a surprise later.

No silent ignores: a field this server does not implement, OpenAI's or anyone's, is kept by pydantic
as an extra and rejected with a 400 naming it (server/unsupported.py), unless it carries only the
value that changes nothing. Range checks that need the engine (context length, vocabulary) happen
when the request is turned into SamplingParams and queued.
"""

from __future__ import annotations

from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import ConfigDict, Field, StrictBool, StrictInt, StrictStr

from servescope.server.protocol_base import Base as _Base
from servescope.server.protocol_base import Float
from servescope.server.protocol_vllm import (ChatTemplateFields, StreamUsageFields, VllmChatFields,
                                             VllmSamplingFields)

MAX_LOGPROBS = 20

StreamOptions = StreamUsageFields


class JsonSchemaFormat(_Base):
    name: StrictStr = "response"
    description: Optional[StrictStr] = None
    schema_: Optional[Dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[StrictBool] = None


class ResponseFormat(_Base):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsParams(_Base):
    """vLLM's `structured_outputs`: exactly one of these."""

    json_: Optional[Union[Dict[str, Any], StrictStr]] = Field(default=None, alias="json")
    regex: Optional[StrictStr] = None
    choice: Optional[List[StrictStr]] = None
    grammar: Optional[StrictStr] = None
    json_object: Optional[StrictBool] = None


class _SamplingFields(VllmSamplingFields):
    """Fields shared by completions and chat completions (vLLM's extras: protocol_vllm.py)."""

    # top-level extras are kept, so that unsupported.py names the field and says why it is refused
    model_config = ConfigDict(extra="allow", allow_inf_nan=False, populate_by_name=True)

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Float] = None
    top_p: Optional[Float] = None
    top_k: Optional[StrictInt] = None
    min_p: Optional[Float] = None
    n: Optional[StrictInt] = 1
    stop: Optional[Union[StrictStr, List[StrictStr]]] = None
    seed: Optional[StrictInt] = None
    presence_penalty: Optional[Float] = None
    frequency_penalty: Optional[Float] = None
    repetition_penalty: Optional[Float] = None
    ignore_eos: Optional[StrictBool] = False
    min_tokens: Optional[StrictInt] = 0
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[StrictStr] = None  # an end-user id for abuse tracking: accepted, recorded nowhere
    # vLLM's extras
    stop_token_ids: Optional[List[StrictInt]] = None
    skip_special_tokens: Optional[StrictBool] = True
    include_stop_str_in_output: Optional[StrictBool] = False
    prompt_logprobs: Optional[StrictInt] = None
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsParams] = None


class CompletionRequest(_SamplingFields):
    # a string, a list of strings, token ids, or a list of token id lists
    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    logprobs: Optional[StrictInt] = None  # OpenAI allows 0..5; up to 20 here
    echo: Optional[StrictBool] = False
    prompt_embeds: Optional[Union[StrictStr, List[StrictStr]]] = None  # refused, as vLLM does by default


class TextContentPart(_Base):
    type: Literal["text"]
    text: StrictStr


class FunctionCall(_Base):
    name: StrictStr
    arguments: StrictStr  # JSON text, as OpenAI sends it


class ToolCall(_Base):
    id: StrictStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Base):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, List[TextContentPart]]] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[List[ToolCall]] = None  # assistant turns that called tools
    tool_call_id: Optional[StrictStr] = None  # tool turns: which call this answers
    reasoning_content: Optional[StrictStr] = None  # an earlier answer's reasoning, for the template
    # output-only fields a client may send back with an earlier reply: accepted while they say nothing
    refusal: None = None
    annotations: Optional[List[None]] = None
    audio: None = None
    function_call: None = None


class FunctionDefinition(_Base):
    name: StrictStr = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: Optional[StrictStr] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[StrictBool] = None


class Tool(_Base):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Base):
    name: StrictStr


class NamedToolChoice(_Base):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields, VllmChatFields):
    model_config = _SamplingFields.model_config  # extras kept (unsupported.py names them); the mixin forbids
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    tools: Optional[List[Tool]] = None
    tool_choice: Optional[Union[Literal["none", "auto", "required"], NamedToolChoice]] = None
    parallel_tool_calls: Optional[StrictBool] = True


class EmbeddingRequest(ChatTemplateFields):
    """OpenAI's embedding request, with vLLM's extras (and its chat form: `messages` instead of `input`)."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)  # extras: rejected by unsupported.py

    input: Optional[Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]] = None
    messages: Optional[List[ChatMessage]] = None
    add_special_tokens: Optional[StrictBool] = None  # default: True for input, False for messages
    truncate_prompt_tokens: Optional[StrictInt] = Field(default=None, ge=-1)
    priority: Optional[StrictInt] = 0
    request_id: Optional[StrictStr] = None
    model: Optional[StrictStr] = None
    encoding_format: Optional[Literal["float", "base64"]] = "float"
    dimensions: Optional[StrictInt] = None
    user: Optional[StrictStr] = None
    pooling: Literal["last", "mean"] = "last"  # servescope's extra: last token (default) or mean
    normalize: Optional[StrictBool] = True
