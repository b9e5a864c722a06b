"""OpenAI request models (pydantic). Types are strict: "5" is not a number, true is not a token id,
NaN and Infinity are rejected, so a wrong type is a 400 naming the field, never a surprise later.

Unknown fields are ignored (as vLLM does). Range checks that need the engine (context length,
vocabulary) happen when the request is turned into SamplingParams and queued.
"""

from __future__ import annotations

from typing import Annotated, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, StrictStr

Float = Annotated[float, Strict()]  # ints are accepted, strings and booleans are not

MAX_LOGPROBS = 20


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class StreamOptions(_Base):
    include_usage: Optional[StrictBool] = False


class _SamplingFields(_Base):
    """Fields shared by completions and chat completions."""

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
    user: Optional[StrictStr] = None


class CompletionRequest(_SamplingFields):
    # a string, a list of strings, token ids, or a list of token id lists
    prompt: Union[StrictStr, List[StrictStr], List[StrictInt], List[List[StrictInt]]]
    logprobs: Optional[StrictInt] = None  # OpenAI allows 0..5; up to 20 here
    echo: Optional[StrictBool] = False


class TextContentPart(_Base):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool"]
    content: Optional[Union[StrictStr, List[TextContentPart]]] = None
    name: Optional[StrictStr] = None


class ChatCompletionRequest(_SamplingFields):
    messages: List[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
