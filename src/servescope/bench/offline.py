"""Offline throughput: N requests handed to the engine at once, timed from the first add to the last token.

The workload is nano-vLLM's and vLLM's random throughput benchmark: prompts of seeded random token
ids with lengths drawn uniformly (or fixed), `ignore_eos` so that every request produces exactly its
drawn output length, greedy sampling. The defaults are the batching issue's figure: 64 requests,
input 32..512, output 32..256, seed 0.

Definitions (as vLLM's `benchmark_throughput`):
- requests/s = requests / wall seconds;
- output tokens/s = generated tokens / wall seconds;
- total tokens/s = (prompt + generated tokens) / wall seconds.
Wall time covers adding the requests and every engine step until the last one finishes.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Optional, Sequence, Union

from servescope.bench.datasets import BenchRequest, random_requests
from servescope.config import SamplingParams
from servescope.telemetry.trace import write_chrome_trace

Length = Union[int, tuple]


@dataclass(frozen=True)
class Workload:
    """What to send: `num_prompts` requests, lengths fixed (int) or uniform inclusive (lo, hi)."""

    num_prompts: int = 64
    input_len: Length = (32, 512)
    output_len: Length = (32, 256)
    seed: int = 0

    def __post_init__(self):
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")
        for name in ("input_len", "output_len"):
            v = getattr(self, name)
            lo, hi = (v, v) if isinstance(v, int) else v
            if lo < 1 or hi < lo:
                raise ValueError(f"{name} must be >= 1 (and lo <= hi), got {v}")

    def requests(self, vocab_size: int) -> list:
        """The seeded requests (token id prompts) for a model with `vocab_size` ids."""
        return random_requests(self.num_prompts, _bounds(self.input_len), _bounds(self.output_len),
                               vocab_size=vocab_size, seed=self.seed)

    def describe(self) -> dict:
        d = asdict(self)
        for k in ("input_len", "output_len"):
            d[k] = list(_bounds(d[k]))
        return d


def _bounds(v: Length) -> tuple:
    return (int(v), int(v)) if isinstance(v, int) else (int(v[0]), int(v[1]))


def parse_length(s: str) -> Length:
    """'128' -> 128; '32..512' or '32-512' or '32:512' -> (32, 512)."""
    s = s.strip()
    for sep in ("..", ":", "-"):
        if sep in s:
            lo, hi = s.split(sep, 1)
            lo, hi = int(lo), int(hi)
            if lo < 1 or hi < lo:
                raise ValueError(f"a length range needs 1 <= lo <= hi, got {s!r}")
            return (lo, hi) if lo != hi else lo
    v = int(s)
    if v < 1:
        raise ValueError(f"a length must be at least 1, got {s!r}")
    return v


def throughput_figures(num_requests: int, prompt_tokens: int, output_tokens: int, seconds: float) -> dict:
    return {
        "num_requests": num_requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "wall_seconds": seconds,
        "requests_per_s": num_requests / seconds,
        "output_tokens_per_s": output_tokens / seconds,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / seconds,
    }


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def warm_up_engine(llm, vocab_size: int, seed: int = 12345) -> None:
    """Two short requests through the whole path (allocations, thread pools, first-call kernel choice)."""
    reqs = random_requests(2, 16, 4, vocab_size=vocab_size, seed=seed)
    llm.generate([r.prompt for r in reqs], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))


def run_engine_throughput(llm, requests: Sequence[BenchRequest], progress: bool = False) -> dict:
    """Run `requests` through `llm.generate` at once; return throughput, KV and latency figures.

    `llm` is a servescope LLM. The returned dict also holds `_outputs` and `_steps` (not JSON) for
    trace export; callers drop keys starting with '_' before serialising.
    """
    engine = llm.engine
    first_step = len(engine.step_records)
    preempt0 = engine.scheduler.num_preemptions
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in requests]
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=progress)
    wall = time.perf_counter() - t0
    steps = list(engine.step_records)[first_step:]
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    requested = sum(r.output_len for r in requests)
    res = throughput_figures(len(outs), n_in, n_out, wall)
    metrics = [o.metrics for o in outs]
    res.update({
        "requested_output_tokens": requested,
        "num_steps": len(steps),
        "peak_kv_usage": max((s.kv_usage for s in steps), default=0.0),
        "kv_capacity_tokens": engine.cache_config.num_blocks * engine.cache_config.block_size,
        "preemptions": engine.scheduler.num_preemptions - preempt0,
        "max_running": max((s.num_running for s in steps), default=0),
        "median_ttft_s": _median(m.ttft for m in metrics),
        "median_tpot_s": _median(m.tpot for m in metrics),
        "median_e2e_s": _median(m.e2e for m in metrics),
        "errors": sum(1 for o in outs if o.error),
        "_outputs": outs,
        "_steps": steps,
    })
    return res


def public(d: dict) -> dict:
    """`d` without the private (non-JSON) keys, recursively."""
    return {k: (public(v) if isinstance(v, dict) else v) for k, v in d.items() if not str(k).startswith("_")}


def write_trace(path: str, steps, outputs) -> Optional[str]:
    """Write a Chrome trace through servescope.telemetry.trace; the result is why it could not (None:
    every build has the exporter now; callers keep printing a reason when there is one)."""
    write_chrome_trace(path, steps, outputs)
    return None
