"""A real uvicorn server on 127.0.0.1 (a free port), run in a background thread."""

import openai

from servescope.server.background import BackgroundServer as LiveServer

__all__ = ["LiveServer", "openai_client"]


def openai_client(server, api_key: str, strict: bool = True, timeout: float = 300):
    """The real openai SDK against a LiveServer. strict: validate every response against the SDK's
    models (streamed completions cannot pass it: the SDK's Completion model requires a finish_reason,
    while the OpenAI API, and this server, send null until the last chunk)."""
    extra = {"_strict_response_validation": True} if strict else {}
    return openai.OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=timeout, **extra)
