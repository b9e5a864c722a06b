"""`servescope serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn), loopback by default.

Every limit on clients is a ServerLimits field with its own option (server/limits.py generates them;
docs/SERVER_LIMITS.md lists them). The API key comes from --api-key-file or $SERVESCOPE_API_KEY, so
that it does not show in `ps`; --api-key KEY works too, visible to every local user.
"""

from __future__ import annotations

import argparse
import os
import sys

from servescope.cli.args import add_engine_args, engine_config_from_args
from servescope.cli.output import error
from servescope.server.limits import LOOPBACK_HOSTS, add_limit_args, is_loopback, limits_from_args

KEY_ENV = "SERVESCOPE_API_KEY"


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="require the key in this file (first line) on every route but /health; the key is "
        f"also read from ${KEY_ENV}; both keep it out of `ps`",
    )
    s.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help=f"the key itself (visible to local users in `ps`: prefer --api-key-file or ${KEY_ENV})",
    )
    s.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send (default: --model, or smollm2-135m)",
    )
    s.add_argument(
        "--reasoning-parser",
        default=None,
        choices=("deepseek_r1", "qwen3", "openai_gptoss"),
        help="split <think>...</think> reasoning (openai_gptoss: gpt-oss's analysis channel) from answers "
        "(reasoning_content, reasoning items, thinking blocks)",
    )
    s.add_argument(
        "--disaggregate",
        default=None,
        metavar="LAYOUT",
        help="prefill/decode disaggregation: 1P1D runs the prefill in a second engine process that sends "
        "each prompt's KV to this one over gloo (engine/disaggregated.py)",
    )
    add_limit_args(p)
    add_engine_args(p)


def read_api_key(args: argparse.Namespace):
    """The key from --api-key, --api-key-file or $SERVESCOPE_API_KEY (at most one of them); None
    without. Raises ValueError with a message for the user."""
    given = [
        (name, v)
        for name, v in (("--api-key", args.api_key), ("--api-key-file", args.api_key_file))
        if v is not None
    ]
    if len(given) > 1:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file is not None:
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--api-key-file: cannot read {args.api_key_file} ({e})") from None
    else:
        key = args.api_key if args.api_key is not None else os.environ.get(KEY_ENV)
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return key.strip() if key is not None else None


def run(args: argparse.Namespace) -> int:
    if not 0 <= args.port <= 65535:
        return error(f"--port must be in 0..65535, got {args.port}")
    try:
        api_key = read_api_key(args)
        limits = limits_from_args(args).for_bind(args.host)
    except ValueError as e:
        return error(str(e))
    # the server and the engine (fastapi, uvicorn, torch) are imported once the arguments are valid:
    # they are seconds of `servescope --help`
    import uvicorn

    from servescope.engine.async_engine import AsyncEngine
    from servescope.measure.local_hardware import measured_engine
    from servescope.server.app import build_app
    from servescope.server.http_guard import uvicorn_options

    name = args.served_model_name or args.model or "smollm2-135m"
    config = engine_config_from_args(args)
    if args.disaggregate is not None:
        from servescope.engine.disaggregated import DisaggregatedEngine, check_layout  # torch: after the checks
        from servescope.errors import InvalidParameterError, WorkerFailedError  # with the engine's imports

        try:
            check_layout(args.disaggregate, config)  # before any weights load
        except InvalidParameterError as e:
            return error(str(e))
    engine = measured_engine(config)
    if args.disaggregate is not None:
        try:
            engine = DisaggregatedEngine(engine, args.disaggregate)
        except WorkerFailedError as e:
            engine.shutdown()
            return error(str(e))
    async_engine = AsyncEngine(engine)
    app = build_app(async_engine, model_name=name, api_key=api_key, limits=limits,
                    reasoning_parser=args.reasoning_parser)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(
        f"servescope: serving {name!r} at http://{host}:{args.port}/v1 "
        f"(max_model_len {engine.max_model_len}, KV {engine.cache_config.num_blocks} blocks)",
        flush=True,
    )
    if not is_loopback(args.host) and not api_key:
        print(
            "servescope: warning: listening beyond loopback without an API key", file=sys.stderr, flush=True
        )
    if limits.allowed_hosts == LOOPBACK_HOSTS:
        print(
            f"servescope: accepting Host {', '.join(LOOPBACK_HOSTS)} only (--allowed-hosts to add names)",
            flush=True,
        )
    try:
        uvicorn.run(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            timeout_graceful_shutdown=5,
            **uvicorn_options(limits),
        )
    finally:
        async_engine.shutdown()
        engine.shutdown()  # a parallel engine's workers
    return 0
