"""No silent ignores: every request field is implemented (a field of the protocol models) or rejected
here with a 400 naming it. (Nested objects forbid unknown keys in the protocol models themselves.)

A field in NEUTRAL is accepted only with a value that changes nothing about the answer (e.g.
`store: false`, `modalities: ["text"]`); any other value, any field in UNSUPPORTED, and any field
nobody defined are rejected. tests/server/test_request_fields.py walks the openai SDK's request
types and checks that each field is either answered or rejected by name.
"""

from __future__ import annotations

from servescope.errors import InvalidParameterError

# field -> the values accepted (they leave the answer as it is)
NEUTRAL = {
    "store": (None, False),
    "metadata": (None, {}),
    "modalities": (None, ["text"]),
    "service_tier": (None, "auto", "default"),
    "prompt_cache_key": None,  # any value: a routing hint; prefix caching here is automatic
    "safety_identifier": None,  # any value: an end-user id, like `user`
    "best_of": (None, 1),
    "suffix": (None, ""),
    "function_call": (None, "none"),
    "functions": (None, []),
}

UNSUPPORTED = {
    "audio": "audio output is not supported (text only)",
    "best_of": "best_of > 1 is not supported; use n",
    "function_call": "function_call is deprecated; use tools and tool_choice",
    "functions": "functions is deprecated; use tools",
    "metadata": "metadata needs store, which this server does not offer",
    "modalities": "only the text modality is supported",
    "moderation": "moderation is not supported",
    "prediction": "predicted outputs are not supported",
    "prompt_cache_options": "prompt cache options are not supported (prefix caching is automatic)",
    "prompt_cache_retention": "prompt cache retention is not supported (prefix caching is automatic)",
    "service_tier": "only the default service tier exists here",
    "store": "storing completions is not supported",
    "suffix": "suffix (insertion) is not supported",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
}


def check_fields(req, neutral: dict = NEUTRAL, unsupported: dict = UNSUPPORTED) -> None:
    """Raise InvalidParameterError naming the first request field this server would ignore. neutral:
    {field: the values accepted because they change nothing (None: any value)}; unsupported: {field: why
    not}. Each API passes its own tables (the Responses and Messages APIs have theirs)."""
    for name, value in (req.model_extra or {}).items():
        ok = neutral.get(name, ())
        if name in neutral and (ok is None or value in ok):
            continue
        if name in unsupported:
            raise InvalidParameterError(name, f"{name}: {unsupported[name]}")
        if name in neutral:
            raise InvalidParameterError(name, f"{name}: only {', '.join(map(repr, ok))} is accepted here")
        raise InvalidParameterError(name, f"unknown field {name!r}: this server does not implement it")
