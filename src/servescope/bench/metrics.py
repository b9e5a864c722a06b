"""Serving-benchmark metrics: per-request records in, vLLM-compatible aggregates out.

Definitions follow vLLM's `benchmarks/serve.py::calculate_metrics`, so numbers
from `servescope bench` compare directly with `vllm bench serve`:

- TTFT: send -> first content chunk.
- E2E latency: send -> last content chunk.
- TPOT (per request): (e2e - ttft) / (output_len - 1), only for output_len > 1.
- ITL: every gap between consecutive content chunks, pooled over all requests
  (a chunk may carry several tokens, so ITL need not equal TPOT).
- Throughputs divide by the benchmark's wall-clock duration; failed requests
  count towards nothing but `failed`.
- Goodput: completed requests per second meeting every SLO given; an SLO is met
  when metric <= SLO. A request with output_len <= 1 has TPOT 0 for goodput.

Times inside records are seconds; aggregated latencies are milliseconds (`*_ms`).
"""

from __future__ import annotations

import math
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from servescope.errors import InvalidParameterError

GOODPUT_METRICS = ("ttft", "tpot", "e2el")
DEFAULT_PERCENTILES = (90.0, 99.0)
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class RequestRecord:
    """What the client saw for one request. Times are seconds (perf_counter based).

    `start_time` is relative to the benchmark start; `latency` is e2e for a success
    and time until the failure otherwise (used only for the concurrency timeline).
    `itl` is kept as float64s in an array("d") (8 bytes a gap and no object per gap: a simulated cluster
    hour pools tens of millions of them, which compute_metrics reads and a worker process sends back in
    bulk); any sequence of numbers may be given. Read it, do not mutate it.
    """

    success: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    itl: array = field(default_factory=lambda: array("d"))
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""
    generated_text: str = ""

    def __post_init__(self):
        if self.prompt_len < 0 or self.output_len < 0:
            raise ValueError(f"token counts must be >= 0, got {self.prompt_len}/{self.output_len}")
        if self.ttft < 0 or self.latency < 0:
            raise ValueError(f"times must be >= 0, got ttft={self.ttft} latency={self.latency}")
        itl = self.itl
        if not (isinstance(itl, array) and itl.typecode == "d"):
            object.__setattr__(self, "itl", array("d", map(float, itl)))

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first; None when output_len <= 1."""
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


@dataclass(frozen=True)
class LatencyStats:
    """One latency distribution in milliseconds. Empty input gives all zeros (as vLLM)."""

    mean_ms: float
    median_ms: float
    std_ms: float
    percentiles_ms: Mapping[float, float]

    @classmethod
    def from_seconds(cls, values: Sequence[float], percentiles: Sequence[float]) -> "LatencyStats":
        arr = np.asarray(values if len(values) else [0.0], dtype=np.float64) * 1000.0  # (a new array: ours)
        # mean and std first (they sum in the array's order); then the order statistics partition `arr` in
        # place, which leaves their values as they are (a pooled ITL array is large: no copy per statistic)
        mean, std = float(np.mean(arr)), float(np.std(arr))
        median = float(np.median(arr, overwrite_input=True))
        qs = [float(p) for p in percentiles]
        # numpy's default method is "linear", vLLM's choice; all percentiles from one partition
        values_ms = np.percentile(arr, qs, overwrite_input=True).tolist() if qs else []
        return cls(mean_ms=mean, median_ms=median, std_ms=std, percentiles_ms=dict(zip(qs, values_ms)))


def percentile_key(p: float) -> str:
    """90 -> 'p90', 99.9 -> 'p99.9' (vLLM's naming)."""
    return f"p{int(p)}" if float(p).is_integer() else f"p{p}"


def parse_goodput(spec: str | Iterable[str] | Mapping[str, float] | None) -> dict[str, float]:
    """`"ttft:200 tpot:50"` or `["ttft:200", "tpot:50"]` -> {"ttft": 200.0, "tpot": 50.0} (ms)."""
    if spec is None:
        return {}
    if isinstance(spec, Mapping):
        items = [(str(k), v) for k, v in spec.items()]
    else:
        parts = spec.split() if isinstance(spec, str) else [p for s in spec for p in str(s).split()]
        items = []
        for part in parts:
            name, sep, value = part.partition(":")
            if not sep:
                raise InvalidParameterError("goodput", f"expected NAME:MS, got {part!r}")
            items.append((name, value))
    slos: dict[str, float] = {}
    for name, value in items:
        name = name.strip().lower()
        if name not in GOODPUT_METRICS:
            raise InvalidParameterError("goodput", f"unknown SLO {name!r}; use one of {GOODPUT_METRICS}")
        try:
            ms = float(value)
        except (TypeError, ValueError):
            raise InvalidParameterError("goodput", f"SLO {name} must be a number of ms, got {value!r}") from None
        if not math.isfinite(ms) or ms < 0:
            raise InvalidParameterError("goodput", f"SLO {name} must be >= 0 ms, got {ms}")
        slos[name] = ms
    return slos


def max_concurrency_seen(records: Sequence[RequestRecord]) -> int:
    """Peak number of requests in flight, from each record's [start, start + latency).

    An end at the same instant as a start is processed first (half-open intervals).
    """
    events = []
    for r in records:
        events.append((r.start_time + r.latency, -1))
        events.append((r.start_time, +1))
    events.sort()  # at equal times -1 sorts before +1
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak


@dataclass(frozen=True)
class BenchmarkResult:
    """Aggregates of one benchmark run plus the settings that produced it."""

    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    request_goodput: float | None
    max_concurrency_seen: int
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats
    e2el: LatencyStats
    goodput_slos_ms: Mapping[str, float] = field(default_factory=dict)
    config: Mapping[str, Any] = field(default_factory=dict)
    records: tuple[RequestRecord, ...] = ()
    error_counts: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self, include_records: bool = False) -> dict[str, Any]:
        """JSON-able dict with stable keys (`mean_ttft_ms`, `p99_itl_ms`, `request_throughput`, ...)."""
        d: dict[str, Any] = {
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": self.duration_s,
            "total_input_tokens": self.total_input_tokens,
            "total_output_tokens": self.total_output_tokens,
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_token_throughput,
            "request_goodput": self.request_goodput,
            "max_concurrency_seen": self.max_concurrency_seen,
            "goodput_slos_ms": dict(self.goodput_slos_ms),
        }
        for name in LATENCY_METRICS:
            stats: LatencyStats = getattr(self, name)
            d[f"mean_{name}_ms"] = stats.mean_ms
            d[f"median_{name}_ms"] = stats.median_ms
            d[f"std_{name}_ms"] = stats.std_ms
            for p, v in stats.percentiles_ms.items():
                d[f"{percentile_key(p)}_{name}_ms"] = v
        d["config"] = dict(self.config)
        d["error_counts"] = dict(self.error_counts)
        if include_records:
            d["records"] = [
                {
                    "success": r.success, "prompt_len": r.prompt_len, "output_len": r.output_len,
                    "ttft_s": r.ttft, "itl_s": r.itl.tolist(), "latency_s": r.latency,
                    "start_time_s": r.start_time, "error": r.error,
                }
                for r in self.records
            ]
        return d


def compute_metrics(
    records: Sequence[RequestRecord],
    duration_s: float,
    goodput: str | Iterable[str] | Mapping[str, float] | None = None,
    percentiles: Sequence[float] = DEFAULT_PERCENTILES,
    config: Mapping[str, Any] | None = None,
) -> BenchmarkResult:
    """Aggregate per-request records of one run lasting `duration_s` seconds (vLLM semantics)."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    for p in percentiles:
        if not 0 <= p <= 100:
            raise ValueError(f"percentiles must be in [0, 100], got {p}")
    slos_ms = parse_goodput(goodput)

    ok = [r for r in records if r.success]
    ttfts = [r.ttft for r in ok]
    e2els = [r.latency for r in ok]
    tpots = [r.tpot for r in ok if r.tpot is not None]
    # For goodput a request with a single output token has TPOT 0: it cannot miss a TPOT SLO.
    all_tpots = [r.tpot if r.tpot is not None else 0.0 for r in ok]
    # pooled in request order, straight from the records' float64 arrays: their bytes joined in one pass (an array
    # per record to concatenate costs more than the copy itself at a cluster hour's 180k records)
    itls = np.frombuffer(b"".join([r.itl for r in ok]), dtype=np.float64)

    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)

    request_goodput = None
    if slos_ms:
        per_metric = {"ttft": ttfts, "tpot": all_tpots, "e2el": e2els}
        good = sum(
            all(per_metric[name][i] <= slo / 1000.0 for name, slo in slos_ms.items())
            for i in range(len(ok))
        )
        request_goodput = good / duration_s

    return BenchmarkResult(
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=float(duration_s),
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration_s,
        output_throughput=total_out / duration_s,
        total_token_throughput=(total_in + total_out) / duration_s,
        request_goodput=request_goodput,
        max_concurrency_seen=max_concurrency_seen(records),
        ttft=LatencyStats.from_seconds(ttfts, percentiles),
        tpot=LatencyStats.from_seconds(tpots, percentiles),
        itl=LatencyStats.from_seconds(itls, percentiles),
        e2el=LatencyStats.from_seconds(e2els, percentiles),
        goodput_slos_ms=slos_ms,
        config=dict(config or {}),
        records=tuple(records),
        error_counts=dict(Counter(r.error or "unknown error" for r in records if not r.success)),
    )
