"""POST /v1/embeddings: inputs (text or token ids) -> pooled, normalised hidden states (engine/embedding.py)
in OpenAI's response shape; `encoding_format` float or base64 (little-endian float32).

Embeddings are admitted like generation requests: the cheap checks first (request_checks), each
input holds an in-flight slot (429 beyond --max-queue), they run a chunk at a time between engine
steps (AsyncEngine.embed), and a client that disconnects stops its work after the running chunk.
"""

from __future__ import annotations

import base64
import struct

from starlette.requests import Request

from servescope.errors import InvalidParameterError
from servescope.server.protocol import EmbeddingRequest
from servescope.server.request_checks import check_prompt_chars, check_request
from servescope.server.serving_common import ServingContext, check_model, run_until_disconnect
from servescope.server.unsupported import check_fields


def _inputs(ctx: ServingContext, req: EmbeddingRequest) -> list:
    items = req.input
    if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
        items = [items]
    if not items:
        raise InvalidParameterError("input", "input is empty")
    limit = ctx.limits.max_embedding_inputs
    if len(items) > limit:
        raise InvalidParameterError("input", f"at most {limit} inputs per request, got {len(items)}")
    vocab, max_len = ctx.engine.vocab_size, ctx.engine.max_model_len
    for x in items:
        if isinstance(x, str):
            if not x:
                raise InvalidParameterError("input", "an input is an empty string")
            check_prompt_chars(ctx, len(x), "input")
        elif not x or len(x) > max_len:
            raise InvalidParameterError("input", f"each input needs 1..{max_len} tokens, got {len(x)}")
        elif any(not 0 <= t < vocab for t in x):
            raise InvalidParameterError("input", f"token ids must be in 0..{vocab - 1}")
    hidden = ctx.engine.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        raise InvalidParameterError(
            "dimensions",
            f"this model's embeddings have {hidden} dimensions, not {req.dimensions} (no truncation)",
        )
    ctx.engine.check_capacity(len(items), ctx.max_queue)
    return items


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest, request: Request) -> dict:
    check_model(ctx, req.model)
    check_fields(req)
    check_request(ctx, req)
    ids = []
    for x in _inputs(ctx, req):
        ids.append(await ctx.engine.encode(x) if isinstance(x, str) else list(x))
    for x in ids:
        if len(x) > ctx.engine.max_model_len:
            raise InvalidParameterError(
                "input", f"each input needs 1..{ctx.engine.max_model_len} tokens, got {len(x)}"
            )
    vectors = await run_until_disconnect(
        request, ctx.engine.embed(ids, req.pooling, req.normalize is not False, max_queue=ctx.max_queue)
    )
    data = []
    for i, v in enumerate(vectors):
        emb = (
            base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode()
            if req.encoding_format == "base64"
            else v
        )
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(x) for x in ids)
    return {
        "object": "list",
        "data": data,
        "model": ctx.model_name,
        "usage": {"prompt_tokens": n, "total_tokens": n},
    }
