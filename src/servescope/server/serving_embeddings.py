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
from servescope.server.chat_engine import template_kwargs
from servescope.server.request_checks import check_prompt_chars, check_request, render_options
from servescope.server.serving_common import ServingContext, check_model, new_id, run_until_disconnect
from servescope.server.unsupported import check_fields
from servescope.server.vllm_fields import check_template_fields, response_id, truncate_prompt


async def _chat_input(ctx: ServingContext, req: EmbeddingRequest) -> list:
    """vLLM's chat embedding request: the rendered conversation is the one input."""
    check_template_fields(req)
    messages = [m.model_dump(exclude_none=True, exclude={"annotations"}) for m in req.messages]
    _, ids = await ctx.engine.render_chat(messages,
                                          add_generation_prompt=req.add_generation_prompt is not False,
                                          add_special_tokens=bool(req.add_special_tokens),
                                          **template_kwargs(req), **render_options(ctx))
    return [ids]


def _inputs(ctx: ServingContext, req: EmbeddingRequest, items) -> list:
    """The inputs, checked cheaply (count, characters, token ids) before any is tokenised."""
    if isinstance(items, str) or (isinstance(items, list) and items and isinstance(items[0], int)):
        items = [items]
    if not items:
        raise InvalidParameterError("input", "input is empty")
    limit = ctx.limits.max_embedding_inputs
    if len(items) > limit:
        raise InvalidParameterError("input", f"at most {limit} inputs per request, got {len(items)}")
    vocab = ctx.engine.vocab_size
    for x in items:
        if isinstance(x, str):
            if not x:
                raise InvalidParameterError("input", "an input is an empty string")
            check_prompt_chars(ctx, len(x), "input")
        elif not x:
            raise InvalidParameterError("input", "an input is an empty list of token ids")
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
    if (req.input is None) == (req.messages is None):
        raise InvalidParameterError("input", "give input or messages (one of them)")
    items = _inputs(ctx, req, req.input if req.messages is None else await _chat_input(ctx, req))
    ids = []
    for x in items:
        x = await ctx.engine.encode(x, req.add_special_tokens is not False) if isinstance(x, str) else list(x)
        ids.append(truncate_prompt(x, req.truncate_prompt_tokens, ctx.engine.max_model_len))
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
    return {"id": response_id("embd", req, new_id("embd")), "object": "list", "data": data,
            "model": ctx.model_name, "usage": {"prompt_tokens": n, "total_tokens": n}}
