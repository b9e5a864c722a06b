"""Workloads for the simulator: `bench serve`'s synthetic one, or a trace file.

Synthetic: bench/datasets.random_requests and bench/arrivals.arrival_times with bench serve's flags and
seeds, so that a simulated run and a measured one send the same prompts at the same times.

Trace (JSONL, one request per line):
    {"arrival_time": 0.25, "prompt_len": 512, "output_len": 128, "session_id": "user-7"}
arrival_time in seconds from the start (non-decreasing order is not required; the file is sorted),
prompt_len / output_len in tokens (input_len is accepted for prompt_len), session_id optional.
Requests of one session share real token ids: each session has one token stream and a request's
prompt is its first prompt_len tokens, so a later turn that extends an earlier one hits the prefix
cache on the blocks they share, as the same prompts would in the engine. Without a session id a
request's prompt is its own.
"""

from __future__ import annotations

import json
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from servescope.bench.arrivals import arrival_times
from servescope.bench.datasets import random_requests
from servescope.errors import InvalidParameterError


@dataclass(frozen=True)
class SimRequest:
    arrival: float  # seconds from the start of the run
    prompt: tuple  # token ids
    output_len: int
    session: Optional[str] = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt)


def synthetic_workload(num_prompts: int, input_len, output_len, vocab_size: int, request_rate: float = math.inf,
                       burstiness: float = 1.0, seed: int = 0) -> list:
    """bench serve's requests and send times for these flags (lengths: N or an inclusive (lo, hi))."""
    lo_hi = lambda v: v if isinstance(v, tuple) else (v, v)  # noqa: E731  (bench serve's own rule)
    reqs = random_requests(num_prompts, lo_hi(input_len), lo_hi(output_len), vocab_size=vocab_size, seed=seed)
    times = arrival_times(num_prompts, request_rate, burstiness, seed)
    return [SimRequest(float(t), tuple(r.prompt), r.output_len) for r, t in zip(reqs, times)]


def _int_field(entry: dict, names: tuple, where: str, minimum: int) -> int:
    for name in names:
        if name in entry:
            v = entry[name]
            if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
                raise InvalidParameterError("trace", f"{where}: {name} must be an integer >= {minimum}, got {v!r}")
            return v
    raise InvalidParameterError("trace", f"{where}: missing {names[0]}")


def _parse_line(line: str, where: str) -> tuple:
    try:
        entry = json.loads(line)
    except ValueError as e:
        raise InvalidParameterError("trace", f"{where}: not JSON ({e})") from None
    if not isinstance(entry, dict):
        raise InvalidParameterError("trace", f"{where}: each line must be a JSON object")
    t = entry.get("arrival_time")
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise InvalidParameterError("trace", f"{where}: arrival_time must be a number of seconds >= 0, got {t!r}")
    prompt_len = _int_field(entry, ("prompt_len", "input_len"), where, 1)
    output_len = _int_field(entry, ("output_len",), where, 1)
    session = entry.get("session_id")
    if session is not None and not isinstance(session, (str, int)):
        raise InvalidParameterError("trace", f"{where}: session_id must be a string or an integer")
    return float(t), prompt_len, output_len, None if session is None else str(session)


def _stream(key: str, length: int, vocab_size: int) -> list:
    rng = random.Random(zlib.crc32(key.encode()))
    return [rng.randrange(vocab_size) for _ in range(length)]


def read_trace(path: str | Path, vocab_size: int, seed: int = 0) -> list:
    """The trace's requests in arrival order (InvalidParameterError naming the line of a bad entry)."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise InvalidParameterError("trace", f"cannot read {path}: {e.strerror or e}") from None
    parsed = [_parse_line(line, f"{path}:{i + 1}") for i, line in enumerate(lines) if line.strip()]
    if not parsed:
        raise InvalidParameterError("trace", f"{path} holds no requests")
    longest: dict = {}
    for _, n, _, s in parsed:
        if s is not None:
            longest[s] = max(longest.get(s, 0), n)
    streams = {s: _stream(f"{seed}/session/{s}", n, vocab_size) for s, n in longest.items()}
    reqs = []
    for i, (t, n, m, s) in enumerate(parsed):
        prompt = streams[s][:n] if s is not None else _stream(f"{seed}/request/{i}", n, vocab_size)
        reqs.append(SimRequest(t, tuple(prompt), m, s))
    return sorted(reqs, key=lambda r: r.arrival)
