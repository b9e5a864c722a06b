"""POST /v1/embeddings: inputs (text or token ids) -> pooled, normalised hidden states (engine/embedding.py)
in OpenAI's response shape; `encoding_format` float or base64 (little-endian float32)."""

from __future__ import annotations

import base64
import struct

from servescope.engine.embedding import embed
from servescope.errors import InvalidParameterError
from servescope.server.protocol import EmbeddingRequest
from servescope.server.serving_common import ServingContext, check_model
from servescope.server.unsupported import check_fields

MAX_INPUTS = 256


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest) -> dict:
    check_model(ctx, req.model)
    check_fields(req)
    items = req.input
    if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
        items = [items]
    if not items:
        raise InvalidParameterError("input", "input is empty")
    if len(items) > MAX_INPUTS:
        raise InvalidParameterError("input", f"at most {MAX_INPUTS} inputs per request, got {len(items)}")
    ids = []
    vocab = ctx.engine.vocab_size
    for x in items:
        if isinstance(x, str):
            if not x:
                raise InvalidParameterError("input", "an input is an empty string")
            x = await ctx.engine.encode(x)
        if any(not 0 <= t < vocab for t in x):
            raise InvalidParameterError("input", f"token ids must be in 0..{vocab - 1}")
        ids.append(list(x))
    hidden = ctx.engine.engine.model_config.hidden_size
    if req.dimensions is not None and req.dimensions != hidden:
        raise InvalidParameterError("dimensions", f"this model's embeddings have {hidden} dimensions, not "
                                                  f"{req.dimensions} (no truncation)")
    vectors = await ctx.engine.run_on_engine(lambda e: embed(e, ids, req.pooling, req.normalize is not False))
    data = []
    for i, v in enumerate(vectors):
        emb = base64.b64encode(struct.pack(f"<{len(v)}f", *v)).decode() if req.encoding_format == "base64" else v
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(x) for x in ids)
    return {"object": "list", "data": data, "model": ctx.model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
