"""vLLM's request fields -> what the engine gets: checks (a 400 naming the field where vLLM refuses
it too, or where this server lacks the feature), the logits controls with their vocabulary checks,
prompt truncation, guided_* as structured outputs, token strings as ids. docs/API.md has the table.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from servescope.errors import InvalidParameterError
from servescope.server.protocol import StructuredOutputsParams
from servescope.server.protocol_vllm import GUIDED_FIELDS

MAX_LOGIT_BIAS = 100.0  # vLLM clamps biases to [-100, 100]
MAX_BAD_WORDS = 128
MAX_ALLOWED_TOKEN_IDS = 1 << 20
GUIDED_BACKENDS = (None, "auto", "xgrammar")


def check_vllm_fields(req) -> None:
    """The fields whose values this server refuses (vLLM's own refusals among them)."""
    if req.use_beam_search:
        raise InvalidParameterError("use_beam_search", "use_beam_search: beam search is not implemented here")
    if req.length_penalty not in (None, 1, 1.0):
        raise InvalidParameterError(
            "length_penalty", "length_penalty applies to beam search only, which is not implemented here"
        )
    if req.logits_processors:
        raise InvalidParameterError(
            "logits_processors",
            "logits_processors: this server loads no logits "
            "processors by name (vLLM refuses them too unless "
            "started with --logits-processor-pattern)",
        )
    if req.kv_transfer_params is not None:
        raise InvalidParameterError(
            "kv_transfer_params",
            "kv_transfer_params: disaggregated serving (a KV connector) is not implemented here",
        )
    if req.guided_whitespace_pattern is not None:
        raise InvalidParameterError(
            "guided_whitespace_pattern",
            "guided_whitespace_pattern: the JSON grammar here allows no free whitespace",
        )
    if req.guided_decoding_backend not in GUIDED_BACKENDS:
        raise InvalidParameterError(
            "guided_decoding_backend", "guided_decoding_backend: the only backend here is xgrammar"
        )
    if getattr(req, "prompt_embeds", None) is not None:
        raise InvalidParameterError(
            "prompt_embeds",
            "prompt_embeds: prompt embeddings are not accepted (vLLM "
            "refuses them too unless started with --enable-prompt-embeds)",
        )
    check_template_fields(req)
    _guided_as_structured_outputs(req)


def check_template_fields(req) -> None:
    if getattr(req, "continue_final_message", False) and getattr(req, "add_generation_prompt", False):
        raise InvalidParameterError(
            "continue_final_message",
            "cannot set both continue_final_message and add_generation_prompt to true",
        )
    if getattr(req, "mm_processor_kwargs", None):
        raise InvalidParameterError(
            "mm_processor_kwargs", "mm_processor_kwargs: this server serves text only"
        )


def _guided_as_structured_outputs(req) -> None:
    """guided_json | guided_regex | guided_choice | guided_grammar -> req.structured_outputs."""
    given = [f for f in GUIDED_FIELDS if getattr(req, f) is not None]
    if not given:
        return
    if len(given) > 1:
        raise InvalidParameterError(
            given[1], f"only one kind of guided decoding per request (got {', '.join(given)})"
        )
    if req.structured_outputs is not None or (
        req.response_format is not None and req.response_format.type != "text"
    ):
        raise InvalidParameterError(
            given[0], f"{given[0]} cannot be combined with structured_outputs or response_format"
        )
    key = {
        "guided_json": "json",
        "guided_regex": "regex",
        "guided_choice": "choice",
        "guided_grammar": "grammar",
    }
    req.structured_outputs = StructuredOutputsParams(**{key[given[0]]: getattr(req, given[0])})


def logit_controls(tokenizer, vocab: int, req) -> dict:
    """SamplingParams keywords of logit_bias, allowed_token_ids and bad_words, checked against the
    vocabulary (an out-of-vocabulary id is a 400, as in vLLM)."""
    out: dict = {}
    if req.logit_bias:
        bias = {}
        for k, v in req.logit_bias.items():
            try:
                tid = int(k)
            except ValueError:
                raise InvalidParameterError(
                    "logit_bias", f"logit_bias keys are token ids, got {k!r}"
                ) from None
            if not 0 <= tid < vocab:
                raise InvalidParameterError(
                    "logit_bias", f"logit_bias: token id {tid} is out of vocabulary (0..{vocab - 1})"
                )
            bias[tid] = max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(v)))
        out["logit_bias"] = bias
    if req.allowed_token_ids is not None:
        ids = req.allowed_token_ids
        if not ids or len(ids) > MAX_ALLOWED_TOKEN_IDS or any(not 0 <= t < vocab for t in ids):
            raise InvalidParameterError(
                "allowed_token_ids",
                f"allowed_token_ids must be a non-empty list of token ids in 0..{vocab - 1}",
            )
        out["allowed_token_ids"] = tuple(dict.fromkeys(ids))
    if req.bad_words:
        out["bad_words_token_ids"] = bad_words_token_ids(tokenizer, req.bad_words)
    return out


def bad_words_token_ids(tokenizer, words: list) -> tuple:
    """Each word as tokenised alone and after a space (vLLM's two variants), without duplicates."""
    if tokenizer is None:
        raise InvalidParameterError("bad_words", "bad_words needs the model's tokenizer")
    if len(words) > MAX_BAD_WORDS:
        raise InvalidParameterError("bad_words", f"at most {MAX_BAD_WORDS} bad words, got {len(words)}")
    seqs = []
    for w in words:
        if not w.strip():
            raise InvalidParameterError("bad_words", "a bad word is empty")
        for text in (w.lstrip(), " " + w.lstrip()):
            ids = tuple(tokenizer.encode(text, add_special_tokens=False))
            if ids and ids not in seqs:
                seqs.append(ids)
    return tuple(seqs)


def truncate_prompt(ids: list, keep: Optional[int], max_model_len: int) -> list:
    """vLLM's truncate_prompt_tokens: keep the last `keep` tokens (-1: the model's context)."""
    if keep is None:
        return ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise InvalidParameterError(
            "truncate_prompt_tokens",
            f"truncate_prompt_tokens ({keep}) is beyond this model's context of {max_model_len} tokens",
        )
    return ids[-keep:]


def response_id(prefix: str, req, fallback: str) -> str:
    """vLLM: a client's request_id names the response (prefix-request_id)."""
    rid = getattr(req, "request_id", None)
    return f"{prefix}-{rid}" if rid else fallback


class TokenIdText:
    """TokenText's interface with "token_id:N" strings (return_tokens_as_token_ids: every token is
    identifiable, even those that are not valid UTF-8 alone)."""

    def __init__(self, token_text):
        self._tt = token_text

    def text(self, tid: int) -> str:
        return f"token_id:{tid}"

    def bytes(self, tid: int) -> list:
        return self._tt.bytes(tid)


def with_token_ids(ctx, req):
    """The serving context whose logprob tokens read "token_id:N" when the request asks."""
    if getattr(req, "return_tokens_as_token_ids", None):
        return dataclasses.replace(ctx, token_text=TokenIdText(ctx.token_text))
    return ctx
