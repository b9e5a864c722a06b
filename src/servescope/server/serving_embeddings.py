"""POST /v1/embeddings: inputs (text or token ids) -> pooled, normalised hidden states (engine/embedding.py)
in OpenAI's response shape; `encoding_format` float or base64 (little-endian float32)."""

from __future__ import annotations

import base64
import struct

from servescope.engine.embedding import embed
from servescope.errors import InvalidParameterError
from servescope.server.protocol import EmbeddingRequest
from servescope.server.chat_engine import template_kwargs
from servescope.server.serving_common import ServingContext, check_model, new_id
from servescope.server.unsupported import check_fields
from servescope.server.vllm_fields import check_template_fields, response_id, truncate_prompt

MAX_INPUTS = 256


async def _chat_input(ctx: ServingContext, req: EmbeddingRequest) -> list:
    """vLLM's chat embedding request: the rendered conversation is the one input."""
    check_template_fields(req)
    messages = [m.model_dump(exclude_none=True, exclude={"annotations"}) for m in req.messages]
    _, ids = await ctx.engine.render_chat(messages,
                                          add_generation_prompt=req.add_generation_prompt is not False,
                                          add_special_tokens=bool(req.add_special_tokens),
                                          **template_kwargs(req))
    return [ids]


async def create_embedding(ctx: ServingContext, req: EmbeddingRequest) -> dict:
    check_model(ctx, req.model)
    check_fields(req)
    if (req.input is None) == (req.messages is None):
        raise InvalidParameterError("input", "give input or messages (one of them)")
    items = req.input if req.messages is None else await _chat_input(ctx, req)
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
            x = await ctx.engine.encode(x, req.add_special_tokens is not False)
        if any(not 0 <= t < vocab for t in x):
            raise InvalidParameterError("input", f"token ids must be in 0..{vocab - 1}")
        ids.append(truncate_prompt(list(x), req.truncate_prompt_tokens, ctx.engine.max_model_len))
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
    return {"id": response_id("embd", req, new_id("embd")), "object": "list", "data": data,
            "model": ctx.model_name,
            "usage": {"prompt_tokens": n, "total_tokens": n}}
