"""SamplingParams: how to sample one request, validated here so that every entry point rejects alike."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from servescope.errors import InvalidParameterError

SAMPLING_EPS = 1e-5  # temperatures below this are greedy (vLLM's _SAMPLING_EPS)


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request. Validated here so that every entry point rejects the same way."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: tuple = ()  # stop strings, trimmed from the output
    stop_token_ids: tuple = ()
    max_tokens: int = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # number of top alternatives (0..20) besides the sampled token
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # logprobs of the prompt's tokens (each with this many top alternatives), computed in the
    # prefill that runs anyway; such a request does not reuse the prefix cache (its logits are due)
    prompt_logprobs: Optional[int] = None
    structured: Optional["StructuredOutput"] = None  # a grammar the output must follow
    # vLLM's logits controls (sampling/logit_controls.py): ((token id, bias), ...) added to the logits,
    # the only token ids that may be sampled, token sequences that may not be completed
    logit_bias: tuple = ()
    allowed_token_ids: Optional[tuple] = None
    bad_words_token_ids: tuple = ()
    thinking_budget: Optional["ThinkingBudget"] = None  # forces the end of a reasoning block
    cache_salt: Optional[str] = None  # salts the prefix-cache hashes: only equal salts share blocks

    MAX_LOGPROBS = 20

    def __post_init__(self):
        # normalise list inputs so the object stays hashable and immutable
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        self._normalise_controls()
        _check(isinstance(self.n, int) and self.n >= 1, "n", f"n must be at least 1, got {self.n}")
        _check(self.temperature >= 0.0, "temperature", f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, "top_p", f"top_p must be in (0, 1], got {self.top_p}")
        _check(self.top_k == -1 or self.top_k >= 0, "top_k", f"top_k must be -1, 0 (off) or positive, got {self.top_k}")
        _check(0.0 <= self.min_p <= 1.0, "min_p", f"min_p must be in [0, 1], got {self.min_p}")
        _check(self.repetition_penalty > 0.0, "repetition_penalty",
               f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty",
               f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
               f"max_tokens must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= self.max_tokens, "min_tokens",
               f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        _check(self.logprobs is None or 0 <= self.logprobs <= self.MAX_LOGPROBS, "logprobs",
               f"logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.logprobs}")
        _check(self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= self.MAX_LOGPROBS, "prompt_logprobs",
               f"prompt_logprobs must be between 0 and {self.MAX_LOGPROBS}, got {self.prompt_logprobs}")
        _check(self.structured is None or isinstance(self.structured, StructuredOutput), "structured",
               "structured must be a StructuredOutput")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
               "stop_token_ids must be non-negative integers")
        _check(self.seed is None or isinstance(self.seed, int), "seed", f"seed must be an integer, got {self.seed!r}")

    def _normalise_controls(self) -> None:
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else (self.logit_bias or ())
        object.__setattr__(self, "logit_bias", tuple((int(t), float(b)) for t, b in bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", tuple(self.allowed_token_ids))
        words = tuple(tuple(w) for w in self.bad_words_token_ids or ())
        object.__setattr__(self, "bad_words_token_ids", words)
        _check(all(t >= 0 for t, _ in self.logit_bias), "logit_bias",
               "logit_bias keys must be token ids >= 0")
        _check(self.allowed_token_ids is None or (bool(self.allowed_token_ids) and all(
            isinstance(t, int) and t >= 0 for t in self.allowed_token_ids)), "allowed_token_ids",
            "allowed_token_ids must be a non-empty list of token ids >= 0")
        _check(all(w and all(isinstance(t, int) and t >= 0 for t in w) for w in self.bad_words_token_ids),
               "bad_words", "each bad word must be a non-empty sequence of token ids >= 0")
        _check(self.thinking_budget is None or isinstance(self.thinking_budget, ThinkingBudget),
               "thinking_budget", "thinking_budget must be a ThinkingBudget")
        _check(self.cache_salt is None or (isinstance(self.cache_salt, str) and bool(self.cache_salt)),
               "cache_salt", "cache_salt must be a non-empty string")

    @property
    def has_logit_controls(self) -> bool:
        """Whether the sampler must edit this request's logits beyond penalties (logit_controls.py)."""
        return bool(self.logit_bias or self.allowed_token_ids is not None or self.bad_words_token_ids
                    or self.thinking_budget is not None)

    @property
    def greedy(self) -> bool:
        """Temperatures below SAMPLING_EPS sample by argmax (the sampler's rule, vLLM's epsilon)."""
        return self.temperature < SAMPLING_EPS

    def replace(self, **kw) -> "SamplingParams":
        return dataclasses.replace(self, **kw)


STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output: `kind` json (spec: a JSON schema, as a JSON string),
    json_object (any JSON object; spec unused), regex, choice (spec: a tuple of strings) or grammar
    (EBNF). Compiled by servescope.structured; only its shape is checked here. `compiled`: the
    grammar the server compiled for this request, carried to the engine so that the engine thread
    never compiles (not part of the constraint's identity)."""

    kind: str
    spec: object = None
    compiled: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        _check(self.kind in STRUCTURED_KINDS, "structured",
               f"structured output kind must be one of {', '.join(STRUCTURED_KINDS)}, got {self.kind!r}")
        if self.kind == "choice":
            _check(isinstance(self.spec, tuple) and bool(self.spec) and all(isinstance(c, str) for c in self.spec),
                   "structured", "a choice needs a non-empty tuple of strings")
        elif self.kind != "json_object":
            _check(isinstance(self.spec, str) and bool(self.spec), "structured",
                   f"a {self.kind} constraint needs a non-empty string")


@dataclass(frozen=True)
class ThinkingBudget:
    """At most `max_tokens` reasoning tokens: after that many output tokens (counted after
    `start_token_ids` where given: the output must open the reasoning block itself, else no budget
    applies) without `end_token_ids`, the sampler forces the end sequence, token by token."""

    max_tokens: int
    end_token_ids: tuple
    start_token_ids: tuple = ()

    def __post_init__(self):
        object.__setattr__(self, "end_token_ids", tuple(self.end_token_ids))
        object.__setattr__(self, "start_token_ids", tuple(self.start_token_ids))
        _check(isinstance(self.max_tokens, int) and self.max_tokens >= 0, "max_reasoning_tokens",
               f"the reasoning budget must be >= 0 tokens, got {self.max_tokens}")
        _check(bool(self.end_token_ids) and all(isinstance(t, int) and t >= 0 for t in self.end_token_ids),
               "max_reasoning_tokens", "the reasoning budget needs the end-of-reasoning token ids")


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidParameterError(param, message)
