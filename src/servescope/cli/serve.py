"""`servescope serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn), loopback by default."""

from __future__ import annotations

import argparse
import os
import sys

from servescope.cli.args import add_engine_args, engine_config_from_args, positive_int
from servescope.cli.output import error


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--max-queue", type=positive_int, default=256, metavar="N",
                   help="requests in flight (waiting + running) before new ones get 429")
    s.add_argument("--max-body-bytes", type=positive_int, default=8 * 2**20, metavar="N",
                   help="largest request body accepted (413 above)")
    s.add_argument("--api-key", default=os.environ.get("SERVESCOPE_API_KEY"), metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $SERVESCOPE_API_KEY)")
    s.add_argument("--max-n", type=positive_int, default=8, metavar="N", help="largest n (choices per prompt)")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model name clients send (default: --model, or smollm2-135m)")
    s.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),
                   help="split <think>...</think> reasoning from answers (reasoning_content, "
                        "reasoning items, thinking blocks)")
    add_engine_args(p)


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        return error(f"--port must be in 0..65535, got {args.port}")
    # the server and the engine (fastapi, uvicorn, torch) are imported once the arguments are valid:
    # they are seconds of `servescope --help`
    import uvicorn

    from servescope.engine.async_engine import AsyncEngine
    from servescope.engine.llm_engine import LLMEngine
    from servescope.server.app import build_app

    name = args.served_model_name or args.model or "smollm2-135m"
    engine = LLMEngine(engine_config_from_args(args))
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, model_name=name, max_body_bytes=args.max_body_bytes, api_key=args.api_key,
                    max_n=args.max_n, max_queue=args.max_queue, reasoning_parser=args.reasoning_parser)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"servescope: serving {name!r} at http://{host}:{args.port}/v1 "
          f"(max_model_len {engine.max_model_len}, KV {engine.cache_config.num_blocks} blocks)", flush=True)
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        print("servescope: warning: listening beyond loopback without --api-key", file=sys.stderr, flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_graceful_shutdown=5)
    finally:
        async_engine.shutdown()
        engine.shutdown()  # a parallel engine's workers
    return 0
