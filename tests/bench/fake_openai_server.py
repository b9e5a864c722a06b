"""A tiny OpenAI-compatible streaming server with known timings, for client tests.

Behaviour is chosen by the request's `model`:
  "fake"            TTFT_S before the first token, then ITL_S between tokens, usage at the end
  "fake-multi"      as "fake" but two tokens per chunk (usage counts tokens, not chunks)
  "fake-nousage"    as "fake" without a usage chunk
  "fake-slow"       sleeps SLOW_S before anything (to hit client timeouts)
  "fake-500"        HTTP 500
  "fake-midstream"  one token, then an error event
  "fake-empty"      no content at all, only [DONE]
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

TTFT_S = 0.2
ITL_S = 0.05
SLOW_S = 3.0


class FakeState:
    def __init__(self):
        self.in_flight = 0
        self.peak_in_flight = 0
        self.payloads: list[dict] = []
        self.headers: list[dict] = []


def make_app(state: FakeState) -> Starlette:
    def chunk(text: str, chat: bool) -> str:
        choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
        return f"data: {json.dumps({'id': 'x', 'choices': [choice]})}\n\n"

    async def handle(request: Request):
        body = await request.json()
        state.payloads.append(body)
        state.headers.append(dict(request.headers))
        chat = "messages" in body
        model = body["model"]
        n = int(body.get("max_tokens", 4))
        if model == "fake-500":
            return JSONResponse({"error": {"message": "boom"}}, status_code=500)

        async def stream():
            state.in_flight += 1
            state.peak_in_flight = max(state.peak_in_flight, state.in_flight)
            try:
                if model == "fake-slow":
                    await asyncio.sleep(SLOW_S)
                if chat:  # OpenAI sends the role first, with no content
                    yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'role': 'assistant'}}]})}\n\n"
                if model == "fake-empty":
                    yield "data: [DONE]\n\n"
                    return
                await asyncio.sleep(TTFT_S)
                per_chunk = 2 if model == "fake-multi" else 1
                sent = 0
                while sent < n:
                    if sent:
                        await asyncio.sleep(ITL_S)
                    k = min(per_chunk, n - sent)
                    yield chunk("t" * k, chat)
                    sent += k
                    if model == "fake-midstream":
                        yield f"data: {json.dumps({'error': {'message': 'engine died'}})}\n\n"
                        return
                yield ": keep-alive comment\n\n"
                if model != "fake-nousage":
                    usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
                    yield f"data: {json.dumps({'id': 'x', 'choices': [], 'usage': usage})}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                state.in_flight -= 1

        return StreamingResponse(stream(), media_type="text/event-stream")

    return Starlette(routes=[Route("/v1/completions", handle, methods=["POST"]),
                             Route("/v1/chat/completions", handle, methods=["POST"])])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class FakeServer:
    """Runs the app with uvicorn in a daemon thread on 127.0.0.1."""

    def __init__(self):
        self.state = FakeState()
        self.port = free_port()
        config = uvicorn.Config(make_app(self.state), host="127.0.0.1", port=self.port,
                                log_level="warning", lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
