"""Async load generator for any OpenAI-compatible streaming server (servescope, vLLM, llama.cpp).

Each request is a streamed POST to /v1/completions or /v1/chat/completions. The
clock starts just before the POST; TTFT is the first chunk carrying non-empty
content, every later content chunk adds one ITL sample, and E2E ends at the last
content chunk (vLLM's definitions, see metrics.py). Output tokens come from the
final `usage` chunk when the server sends one; otherwise from the tokenizer, if
given, else one token per content chunk.

Arrivals follow a gamma process (arrivals.py) on absolute send times, so a slow
event loop does not drift the offered rate; `max_concurrency` caps requests in
flight (a request waiting for a slot keeps its arrival, but its clock starts when
it is sent, as in vLLM). A failing request becomes a failed RequestRecord; the run
never raises for a server error.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from typing import Any, Callable, Mapping, Sequence

import httpx
from tqdm.auto import tqdm

from servescope.bench.arrivals import arrival_times
from servescope.bench.datasets import BenchRequest, encode_text
from servescope.bench.metrics import BenchmarkResult, RequestRecord, compute_metrics, parse_goodput

logger = logging.getLogger(__name__)

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


def endpoint_url(base_url: str, endpoint: str) -> str:
    """Join without doubling /v1: ('http://h:8000/v1', '/v1/completions') -> 'http://h:8000/v1/completions'."""
    base = base_url.rstrip("/")
    path = endpoint if endpoint.startswith("/") else "/" + endpoint
    if base.endswith("/v1") and path.startswith("/v1/"):
        path = path[3:]
    return base + path


def wait_healthy(base_url: str, proc=None, timeout_s: float = 600.0, what: str = "the server") -> None:
    """Poll base_url/health until it answers 200. proc: the server's subprocess.Popen, whose exit is
    an error at once; RuntimeError after timeout_s (a first start may compile the CPU kernels)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with code {proc.returncode}")
        try:
            if httpx.get(base_url.rstrip("/") + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not healthy after {timeout_s:.0f} s")
        time.sleep(0.5)


def is_chat_endpoint(endpoint: str) -> bool:
    return endpoint.rstrip("/").endswith("chat/completions")


def build_payload(
    req: BenchRequest,
    model: str,
    chat: bool,
    ignore_eos: bool = True,
    extra_body: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON body of one streamed request; `extra_body` entries override the defaults."""
    payload: dict[str, Any] = {
        "model": model,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if chat:
        if not isinstance(req.prompt, str):
            raise ValueError("chat endpoints need text prompts: build the dataset with a tokenizer")
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if ignore_eos:
        payload["ignore_eos"] = True  # non-standard; vLLM, llama.cpp and servescope accept it
    payload.update(extra_body or {})
    return payload


def _chunk_content(data: dict[str, Any], chat: bool) -> str:
    """The text a streamed chunk adds ('' for role-only, usage-only or empty chunks)."""
    choices = data.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if chat:
        delta = choice.get("delta") or {}
        return delta.get("content") or delta.get("reasoning_content") or ""
    return choice.get("text") or ""


async def send_request(
    client: httpx.AsyncClient,
    url: str,
    payload: dict[str, Any],
    req: BenchRequest,
    bench_start: float,
    headers: Mapping[str, str] | None = None,
    timeout_s: float | None = None,
    tokenizer: Any = None,
) -> RequestRecord:
    """Stream one request and time it. Never raises for server or network errors."""
    chat = "messages" in payload
    st = time.perf_counter()
    ttft = 0.0
    last = st
    itl: list[float] = []
    pieces: list[str] = []
    usage_tokens: int | None = None

    async def consume() -> None:
        nonlocal ttft, last, usage_tokens
        async with client.stream("POST", url, json=payload, headers=headers) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", "replace")
                raise _RequestFailed(f"HTTP {response.status_code}: {body[:300]}")
            async for line in response.aiter_lines():
                line = line.strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments, event:/id: fields
                data_str = line[len("data:"):].strip()
                if data_str == "[DONE]":
                    break
                try:
                    data = json.loads(data_str)
                except json.JSONDecodeError:
                    raise _RequestFailed(f"bad SSE JSON: {data_str[:200]}") from None
                if "error" in data and not data.get("choices"):
                    raise _RequestFailed(f"server error in stream: {json.dumps(data['error'])[:300]}")
                content = _chunk_content(data, chat)
                if content:
                    now = time.perf_counter()
                    if not pieces:
                        ttft = now - st
                    else:
                        itl.append(now - last)
                    last = now
                    pieces.append(content)
                usage = data.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])  # the last one reported wins

    error = await _failure_of(consume, timeout_s)
    if not error and not pieces:
        error = "no content chunk received (cannot measure TTFT)"

    start_time = st - bench_start
    if error:
        return RequestRecord(success=False, prompt_len=req.prompt_len, latency=time.perf_counter() - st,
                             start_time=start_time, error=error)
    text = "".join(pieces)
    if usage_tokens is not None:
        output_len = usage_tokens
    elif tokenizer is not None:
        output_len = len(encode_text(tokenizer, text))
    else:
        output_len = len(pieces)
    return RequestRecord(success=True, prompt_len=req.prompt_len, output_len=output_len, ttft=ttft,
                         itl=itl, latency=last - st, start_time=start_time, generated_text=text)


class _RequestFailed(Exception):
    """A request failed in a way the server told us about (status, error event, bad stream)."""


async def _failure_of(consume: Callable[[], Any], timeout_s: float | None) -> str:
    """Await consume() (within timeout_s); what went wrong as one line, or "" when nothing did."""
    try:
        if timeout_s is None:
            await consume()
        else:
            await asyncio.wait_for(consume(), timeout_s)
    except _RequestFailed as e:
        return str(e)
    except asyncio.TimeoutError:
        return f"timed out after {timeout_s} s"
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    except Exception as e:  # a benchmark records every failure and carries on
        logger.exception("unexpected error in benchmark request")
        return f"{type(e).__name__}: {e}"
    return ""


async def run_serve_benchmark_async(
    base_url: str,
    model: str,
    requests: Sequence[BenchRequest],
    request_rate: float = math.inf,
    burstiness: float = 1.0,
    max_concurrency: int | None = None,
    goodput: Any = None,
    endpoint: str = COMPLETIONS,
    api_key: str | None = None,
    seed: int = 0,
    progress: bool = True,
    ignore_eos: bool = True,
    request_timeout_s: float | None = 600.0,
    extra_body: Mapping[str, Any] | None = None,
    tokenizer: Any = None,
    percentiles: Sequence[float] = (90.0, 99.0),
) -> BenchmarkResult:
    """Send `requests` at `request_rate` req/s (gamma arrivals) and aggregate what came back."""
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if request_timeout_s is not None and not request_timeout_s > 0:
        raise ValueError(f"request_timeout_s must be > 0, got {request_timeout_s}")
    if not requests:
        raise ValueError("no requests to send")
    if any(not 0 <= p <= 100 for p in percentiles):
        raise ValueError(f"percentiles must be in [0, 100], got {percentiles}")
    slos_ms = parse_goodput(goodput)  # a bad SLO spec must fail before the run, not after it
    url = endpoint_url(base_url, endpoint)
    chat = is_chat_endpoint(endpoint)
    payloads = [build_payload(r, model, chat, ignore_eos, extra_body) for r in requests]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    send_at = arrival_times(len(requests), request_rate, burstiness, seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    # The pool must not be the bottleneck: without a concurrency cap every request
    # may be in flight at once, and pool waits would show up as TTFT.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency)
    timeout = httpx.Timeout(request_timeout_s, connect=min(30.0, request_timeout_s or 30.0))
    logger.info("benchmark: %d requests to %s, rate=%s, burstiness=%s, max_concurrency=%s",
                len(requests), url, request_rate, burstiness, max_concurrency)
    bar = tqdm(total=len(requests), disable=not progress, desc="requests", unit="req")
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        bench_start = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            if semaphore is None:
                rec = await send_request(client, url, payloads[i], requests[i], bench_start, headers,
                                         request_timeout_s, tokenizer)
            else:
                async with semaphore:
                    rec = await send_request(client, url, payloads[i], requests[i], bench_start, headers,
                                             request_timeout_s, tokenizer)
            bar.update(1)
            return rec

        tasks = []
        for i in range(len(requests)):
            delay = bench_start + send_at[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        records = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - bench_start
    bar.close()
    failed = sum(not r.success for r in records)
    if failed:
        logger.warning("%d of %d requests failed; first error: %s", failed, len(records),
                       next(r.error for r in records if not r.success))
    config = {
        "base_url": base_url, "model": model, "endpoint": endpoint, "num_prompts": len(requests),
        "request_rate": request_rate if math.isfinite(request_rate) else "inf",
        "burstiness": burstiness, "max_concurrency": max_concurrency, "ignore_eos": ignore_eos,
        "seed": seed,
    }
    return compute_metrics(records, duration, goodput=slos_ms or None, percentiles=percentiles, config=config)


def run_serve_benchmark(*args: Any, **kwargs: Any) -> BenchmarkResult:
    """Synchronous wrapper of `run_serve_benchmark_async` (same arguments)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run_serve_benchmark_async(*args, **kwargs))
    raise RuntimeError("run_serve_benchmark called inside an event loop; await run_serve_benchmark_async")


def sweep(request_rates: Sequence[float], base_url: str, model: str,
          requests: Sequence[BenchRequest] | Callable[[int], Sequence[BenchRequest]], seed: int = 0,
          on_start: Callable[[float, int, Sequence[BenchRequest]], None] | None = None,
          on_result: Callable[[BenchmarkResult], None] | None = None, **kwargs: Any) -> list[BenchmarkResult]:
    """One benchmark per request rate, in order, with the same settings; point i uses seed + i for its
    arrivals and, when `requests` is a callable (seed -> requests), for its prompts: fresh prompts per
    point, so that a server with prefix caching does not answer every point after the first from the
    cache the first one filled. A sequence is sent as it is at every point. on_start(rate, seed,
    requests) runs before each point, on_result(result) after it."""
    results = []
    for i, rate in enumerate(request_rates):
        point_seed = seed + i
        reqs = requests(point_seed) if callable(requests) else requests
        logger.info("sweep: request_rate=%s seed=%s", rate, point_seed)
        if on_start is not None:
            on_start(rate, point_seed, reqs)
        results.append(run_serve_benchmark(base_url, model, reqs, request_rate=rate, seed=point_seed, **kwargs))
        if on_result is not None:
            on_result(results[-1])
    return results
