"""vLLM's request fields beyond OpenAI's (vLLM's protocol.py: the completion, chat, embedding and
tokenize requests), as mixins of the request models in protocol.py, and the tokenize requests.

What each field does here is in docs/API.md ("vLLM's request fields"). The few that vLLM itself
refuses unless it was started with an option this server does not have (logits_processors without
--logits-processor-pattern, prompt_embeds without --enable-prompt-embeds) are refused the same
way, with a 400 naming the field (vllm_fields.py).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Union

from pydantic import Field, StrictBool, StrictInt, StrictStr

from servescope.server.protocol_base import Base, Float

# guided_* are vLLM's older names of structured_outputs' members
GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


class VllmSamplingFields(Base):
    """Fields vLLM's completion and chat requests share (their sampling and extra parameters)."""

    use_beam_search: Optional[StrictBool] = False
    length_penalty: Optional[Float] = 1.0
    spaces_between_special_tokens: Optional[StrictBool] = True
    truncate_prompt_tokens: Optional[StrictInt] = Field(default=None, ge=1)
    allowed_token_ids: Optional[List[StrictInt]] = None
    bad_words: Optional[List[StrictStr]] = None
    logit_bias: Optional[Dict[str, Float]] = None
    priority: Optional[StrictInt] = 0
    request_id: Optional[StrictStr] = None
    cache_salt: Optional[StrictStr] = None
    return_tokens_as_token_ids: Optional[StrictBool] = None
    logits_processors: Optional[List[Any]] = None
    vllm_xargs: Optional[Dict[str, Union[StrictStr, StrictInt, Float]]] = None
    kv_transfer_params: Optional[Dict[str, Any]] = None
    add_special_tokens: Optional[StrictBool] = None  # default: True for completions, False for chat
    guided_json: Optional[Union[Dict[str, Any], StrictStr]] = None
    guided_regex: Optional[StrictStr] = None
    guided_choice: Optional[List[StrictStr]] = None
    guided_grammar: Optional[StrictStr] = None
    guided_decoding_backend: Optional[StrictStr] = None
    guided_whitespace_pattern: Optional[StrictStr] = None


class StreamUsageFields(Base):
    """stream_options: OpenAI's include_usage and vLLM's continuous_usage_stats (usage in every chunk)."""

    include_usage: Optional[StrictBool] = False
    continuous_usage_stats: Optional[StrictBool] = False


class ChatTemplateFields(Base):
    """How a conversation is rendered (vLLM's chat, chat-embedding and tokenize requests)."""

    add_generation_prompt: Optional[StrictBool] = True
    continue_final_message: Optional[StrictBool] = False
    chat_template: Optional[StrictStr] = None
    chat_template_kwargs: Optional[Dict[str, Any]] = None
    documents: Optional[List[Dict[str, Any]]] = None
    mm_processor_kwargs: Optional[Dict[str, Any]] = None


class VllmChatFields(ChatTemplateFields):
    """vLLM's extras of the chat request (besides the shared ones)."""

    echo: Optional[StrictBool] = False
    include_reasoning: Optional[StrictBool] = True
    reasoning_effort: Optional[StrictStr] = None  # handed to the chat template, as vLLM does
    max_reasoning_tokens: Optional[StrictInt] = None  # servescope's thinking budget (reasoning parser)


class TokenizeRequest(ChatTemplateFields):
    """vLLM's /tokenize: a prompt (TokenizeCompletionRequest) or messages (TokenizeChatRequest)."""

    model: Optional[StrictStr] = None
    prompt: Optional[StrictStr] = None
    messages: Optional[List[Dict[str, Any]]] = None
    tools: Optional[List[Dict[str, Any]]] = None
    add_special_tokens: Optional[StrictBool] = None  # default: True for a prompt, False for messages
    return_token_strs: Optional[StrictBool] = False


class DetokenizeRequest(Base):
    model: Optional[StrictStr] = None
    tokens: List[StrictInt]
