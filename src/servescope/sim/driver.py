"""Sending a workload to an engine and turning what came back into bench serve's records.

One loop for the simulated engine (virtual clock) and the real one (wall clock, labs/sim_validation.py),
so that both see the same arrivals and concurrency rule: requests are sent at their arrival times; with
`max_concurrency` a request that finds every slot taken waits for the next to free (its clock starts
when it is sent, as in bench serve and vLLM); the engine takes what was sent while a step ran before
its next step. Per request: TTFT = first token - send, ITL = the gaps between its chunks (the tokens of
one step arrive together), E2E = last token - send (bench/metrics.py's definitions, on the engine's
token times).
"""

from __future__ import annotations

import collections
import heapq
from array import array
from typing import Optional, Protocol, Sequence

import numpy as np

from servescope.bench.metrics import BenchmarkResult, RequestRecord, compute_metrics
from servescope.sim.workload import SimRequest


class Served(Protocol):
    """What the driver needs from an engine: its clock, requests in, steps, finished requests out
    (objects with request_id, metrics: RequestMetrics and error)."""

    def now(self) -> float: ...

    def wait_until(self, t: float) -> None: ...

    def add(self, request_id: str, prompt: Sequence[int], max_tokens: int, arrival_time: float): ...

    def step(self) -> list: ...

    def has_unfinished(self) -> bool: ...


def record_of(req: SimRequest, finished, sent: float, start: float) -> RequestRecord:
    m = finished.metrics
    times = m.token_times
    if finished.error or not times:
        return RequestRecord(success=False, prompt_len=req.prompt_len, start_time=sent - start,
                             latency=max((m.finished_time or sent) - sent, 0.0),
                             error=finished.error or "no token produced")
    return RequestRecord(success=True, prompt_len=req.prompt_len, output_len=len(times), ttft=times[0] - sent,
                         itl=chunk_gaps(times), latency=times[-1] - sent, start_time=sent - start)


def chunk_gaps(times) -> array:
    """The ITLs of a request's token times: tokens that came out of one step (accepted drafts) reach a client
    as one chunk, so the gaps are those between chunks -- b - a of each neighbouring pair of times with b != a
    (the b of a chunk's first token, the a of the chunk before's last, equal to its first). In float64 as
    Python computes them (IEEE subtraction either way; b - a == 0 exactly when b == a), as float64s in an
    array("d") (RequestRecord.itl's form: no Python float made per token)."""
    t = np.frombuffer(times, dtype=np.float64) if isinstance(times, array) else np.asarray(times, dtype=np.float64)
    gaps = t[1:] - t[:-1]
    out = array("d")
    out.frombytes(gaps[gaps != 0].tobytes())
    return out


def drive(engine: Served, requests: Sequence[SimRequest], max_concurrency: Optional[int] = None,
          prefix: str = "req") -> tuple:
    """Run the workload to the end; (records in request order, duration in seconds, finished objects)."""
    start = engine.now()
    n = len(requests)
    arrivals = [start + r.arrival for r in requests]
    free_slots = [start] * max_concurrency if max_concurrency else None  # times the slots became free
    sent: dict = {}
    done: dict = {}
    held: collections.deque = collections.deque()  # arrived, waiting for a slot
    i = 0
    last = start
    while len(done) < n:
        now = engine.now()
        while i < n and arrivals[i] <= now:
            held.append(i)
            i += 1
        while held and (free_slots is None or len(sent) - len(done) < max_concurrency):
            j = held.popleft()
            t = arrivals[j]
            if free_slots is not None:
                t = max(t, heapq.heappop(free_slots))
            sent[j] = t
            refused = engine.add(f"{prefix}-{j}", requests[j].prompt, requests[j].output_len, t)
            if refused is not None:
                _finish(refused, done, free_slots, t)
        if engine.has_unfinished():
            for f in engine.step():
                last = max(last, f.metrics.finished_time or engine.now())
                _finish(f, done, free_slots, engine.now())
        elif i < n:
            engine.wait_until(arrivals[i])
        elif held:  # every slot taken by requests that finished at once; nothing runs
            continue
    records = [record_of(requests[j], done[j], sent[j], start) for j in range(n)]
    return records, max(last - start, 1e-9), [done[j] for j in range(n)]


def _finish(f, done: dict, free_slots: Optional[list], now: float) -> None:
    j = int(f.request_id.rsplit("-", 1)[1])
    done[j] = f
    if free_slots is not None:
        heapq.heappush(free_slots, now)


def bench_result(records: list, duration: float, goodput=None, percentiles=(90.0, 99.0),
                 config: Optional[dict] = None) -> BenchmarkResult:
    """bench serve's aggregates (bench/metrics.compute_metrics) of the run."""
    return compute_metrics(records, duration, goodput=goodput, percentiles=percentiles, config=config)
