"""The model name an OpenAI-compatible server serves, read from its GET /v1/models."""

from __future__ import annotations

from typing import Optional

import httpx

from servescope.bench.serve_client import endpoint_url
from servescope.errors import InvalidParameterError


def discover_model(base_url: str, api_key: Optional[str] = None, timeout: float = 10.0) -> str:
    """The id of the first model the server lists; InvalidParameterError("model") when it cannot be read."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(endpoint_url(base_url, "/v1/models"), headers=headers, timeout=timeout)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:  # any failure (connection, status, shape) means the same to the user: pass --model
        raise InvalidParameterError("model", f"could not read the model name from {base_url}/v1/models "
                                             f"({type(e).__name__}: {e}); pass --model") from None
