"""build_app: the FastAPI application in front of an AsyncEngine.

Endpoints: POST /v1/completions, POST /v1/chat/completions, POST /v1/embeddings, POST /v1/responses,
POST /v1/messages (+ /count_tokens), POST /tokenize, POST /detokenize, GET /v1/models, GET /health,
GET /metrics (Prometheus text, this app's own registry), GET /v1/internals?n=N (the last N step
records and the KV cache state, read on the engine thread), GET /dashboard and its feed
GET /v1/internals/stream (server/dashboard.py). Every limit on what a client may send or hold is a
field of ServerLimits (server/limits.py), reported under "limits" in /v1/internals.

Several apps may share one AsyncEngine (e.g. with different max_queue); each keeps its own metrics.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Optional

from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse, Response

from servescope.engine.async_engine import AsyncEngine
from servescope.server.dashboard import install_dashboard
from servescope.server.errors import error_response, install_error_handlers, to_api_error
from servescope.server.grammar_service import GrammarService
from servescope.server.limits import ServerLimits
from servescope.server.request_checks import limits_report
from servescope.server.internals_stream import EngineSource
from servescope.server.metrics import CONTENT_TYPE, ServerMetrics
from servescope.server.middleware import GuardMiddleware
from servescope.server.protocol import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from servescope.server.serving_chat import create_chat_completion
from servescope.server.serving_common import ServingContext, TokenText
from servescope.server.serving_completions import create_completion
from servescope.server.reasoning import make_reasoning_parser
from servescope.server.serving_embeddings import create_embedding
from servescope.server.serving_messages import install_messages
from servescope.server.serving_responses import install_responses
from servescope.server.serving_tokenize import install_tokenize



def _json_safe(x):
    """NaN/inf -> None, recursively (JSON has neither)."""
    if isinstance(x, float):
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def build_app(async_engine: AsyncEngine, model_name: str = "servescope", api_key: Optional[str] = None,
              limits: Optional[ServerLimits] = None, reasoning_parser: Optional[str] = None,
              **limit_overrides) -> FastAPI:
    """limits: the server's limits (ServerLimits' defaults if None); limit_overrides: single fields
    (e.g. max_queue=4) replaced on top of them; reasoning_parser: deepseek_r1 | qwen3 | openai_gptoss | None."""
    limits = dataclasses.replace(limits or ServerLimits(), **limit_overrides)
    app = FastAPI(title="servescope", version="0.1.0",
                  description="OpenAI-compatible API of the servescope engine.")
    ctx = ServingContext(engine=async_engine, model_name=model_name, max_n=limits.max_n,
                         max_queue=limits.max_queue, token_text=TokenText(async_engine.tokenizer),
                         limits=limits, grammars=GrammarService(async_engine, limits),
                         reasoning=make_reasoning_parser(reasoning_parser, async_engine.tokenizer))
    metrics = ctx.metrics = ServerMetrics(model_name)
    async_engine.output_listeners.append(metrics.on_output)
    app.state.ctx, app.state.metrics, app.state.async_engine, app.state.limits = ctx, metrics, async_engine, limits
    ctx.grammars.warm()
    install_error_handlers(app)
    app.add_middleware(GuardMiddleware, limits=limits, api_key=api_key)
    previews = limits.dashboard_previews if limits.dashboard_previews is not None else api_key is not None
    install_dashboard(app, EngineSource(async_engine, model_name, previews=previews),  # /dashboard + its feed
                      max_viewers=limits.max_dashboard_viewers)
    install_tokenize(app, ctx)  # /tokenize, /detokenize (vLLM's)
    install_responses(app, ctx)  # /v1/responses (OpenAI's Responses API)
    install_messages(app, ctx)  # /v1/messages, /v1/messages/count_tokens (Anthropic's Messages API)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        try:
            return await create_completion(ctx, body, request)
        except Exception as e:  # answered here: Starlette's catch-all would re-raise and drop the connection
            raise to_api_error(e) from None

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        try:
            return await create_chat_completion(ctx, body, request)
        except Exception as e:
            raise to_api_error(e) from None

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request):
        try:
            return await create_embedding(ctx, body, request)
        except Exception as e:
            raise to_api_error(e) from None

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": ctx.created, "owned_by": "servescope",
            "max_model_len": async_engine.max_model_len}]}

    @app.get("/health")
    async def health():
        if not async_engine.is_running:
            return error_response(503, "the engine is not running", code="engine_closed")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus_metrics():
        if async_engine.is_running:
            metrics.update_state(await async_engine.run_on_engine(lambda e: e.kv_cache_state()))
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/internals")
    async def internals(n: int = Query(100, ge=0, le=limits.max_internals_steps,
                                       description="how many of the latest step records")):
        def read(engine):
            recs = engine.step_records
            last = list(itertools.islice(reversed(recs), n))[::-1]
            return {"steps": [r.as_dict() for r in last], "kv_cache": engine.kv_cache_state(),
                    "num_unfinished": engine.num_unfinished}

        data = await async_engine.run_on_engine(read)
        data["num_in_flight"] = async_engine.num_inflight
        data["limits"] = limits_report(ctx)
        return JSONResponse(_json_safe(data))

    return app
