"""POST /tokenize and /detokenize, as vLLM serves them (at the root, not under /v1).

/tokenize takes a prompt (special tokens added by default) or messages (rendered by the chat
template, with its fields: add_generation_prompt, continue_final_message, chat_template,
chat_template_kwargs, tools) and answers {count, max_model_len, tokens[, token_strs]}.
/detokenize takes {tokens} and answers {prompt}. Nothing reaches the engine thread.
"""

from __future__ import annotations

from fastapi import FastAPI

from servescope.errors import InvalidParameterError
from servescope.server.chat_engine import template_kwargs
from servescope.server.errors import to_api_error
from servescope.server.protocol import Tool
from servescope.server.protocol_vllm import DetokenizeRequest, TokenizeRequest
from servescope.server.serving_common import ServingContext, check_model
from servescope.server.vllm_fields import check_template_fields

MAX_DETOKENIZE_TOKENS = 1 << 20


async def tokenize(ctx: ServingContext, req: TokenizeRequest) -> dict:
    check_model(ctx, req.model)
    check_template_fields(req)
    tok = ctx.engine.tokenizer
    if tok is None:
        raise InvalidParameterError("prompt", "this model has no tokenizer")
    if (req.prompt is None) == (req.messages is None):
        raise InvalidParameterError("prompt", "give a prompt or messages (one of them)")
    if req.prompt is not None:
        ids = await ctx.engine.encode(req.prompt, req.add_special_tokens is not False)
    else:
        tools = (
            [Tool.model_validate(t).model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        )
        _, ids = await ctx.engine.render_chat(
            req.messages,
            add_generation_prompt=req.add_generation_prompt is not False,
            tools=tools,
            add_special_tokens=bool(req.add_special_tokens),
            **template_kwargs(req),
        )
    body = {"count": len(ids), "max_model_len": ctx.engine.max_model_len, "tokens": ids}
    if req.return_token_strs:
        body["token_strs"] = [tok.id_to_token(t) for t in ids]
    return body


async def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> dict:
    check_model(ctx, req.model)
    tok = ctx.engine.tokenizer
    if tok is None:
        raise InvalidParameterError("tokens", "this model has no tokenizer")
    vocab = ctx.engine.vocab_size
    if len(req.tokens) > MAX_DETOKENIZE_TOKENS or any(not 0 <= t < vocab for t in req.tokens):
        raise InvalidParameterError(
            "tokens", f"tokens must be at most {MAX_DETOKENIZE_TOKENS} ids in 0..{vocab - 1}"
        )
    return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}


def install_tokenize(app: FastAPI, ctx: ServingContext) -> None:
    @app.post("/tokenize")
    async def tokenize_route(body: TokenizeRequest):
        try:
            return await tokenize(ctx, body)
        except Exception as e:  # answered here, as the other routes do
            raise to_api_error(e) from None

    @app.post("/detokenize")
    async def detokenize_route(body: DetokenizeRequest):
        try:
            return await detokenize(ctx, body)
        except Exception as e:
            raise to_api_error(e) from None
