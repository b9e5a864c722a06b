"""Latency of one batch: B prompts of the same length, each generating the same number of tokens.

Reports, per iteration and as medians over iterations:
- TTFT (arrival -> first token) and TPOT ((E2E - TTFT) / (out - 1)) of each request;
- the engine's steps split by phase (prefill, decode, mixed): median step time, tokens/s, the
  cost model's FLOPs and bytes divided by measured time (achieved FLOP/s, GB/s), the share of the
  hardware roofline that is (FLOP/s over peak matmul rate of the dtype, bytes/s over the memory
  bandwidth), and predicted vs measured step time.

Each iteration uses fresh random prompts (seed + iteration) so the prefix cache never turns a
later iteration's prefill into a cache hit.

On the CPU the read bandwidth is also measured around the iterations (before each and after the
last, the probe's streaming sum), and each phase's bytes/s is given as a share of that median too:
on a shared VM the bandwidth a cached probe saw minutes earlier can be off by a factor of two
(measured here: 23 to 54 GB/s within a minute), so the share of the bandwidth measured in the same
minutes is the figure to read. Since it also swings within a minute (samples 32..57 GB/s around
one 10-second run here), one more batch is then run step by step with a read sample every 8 steps,
and its decode steps are set against the samples taken just before and after them
(`paired_decode_bandwidth`): the tightest pairing of what decode moved with what the memory could
move at that moment.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable, Optional, Sequence

import torch

from servescope.analysis.bandwidth import measure_read_bandwidth
from servescope.bench.datasets import random_requests
from servescope.config import SamplingParams

PHASES = ("prefill", "decode", "mixed")


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def phase_breakdown(steps: Sequence, peak_flops: Optional[float], bandwidth: Optional[float]) -> dict:
    """Aggregate StepRecords by phase. Rates are time-weighted (sum of work / sum of seconds)."""
    out = {}
    for phase in PHASES:
        ss = [s for s in steps if s.phase == phase]
        if not ss:
            continue
        secs = sum(s.wall_seconds for s in ss)
        toks = sum(s.num_tokens for s in ss)
        d = {
            "num_steps": len(ss),
            "seconds": secs,
            "tokens": toks,
            "median_step_seconds": statistics.median(s.wall_seconds for s in ss),
            "tokens_per_s": toks / secs if secs > 0 else None,
        }
        if all(s.flops is not None and s.bytes is not None for s in ss) and secs > 0:
            flops = sum(s.flops for s in ss)
            nbytes = sum(s.bytes for s in ss)
            pred = sum(s.predicted_seconds for s in ss)
            d.update({
                "achieved_flops_per_s": flops / secs,
                "achieved_bytes_per_s": nbytes / secs,
                "pct_of_peak_flops": 100.0 * flops / secs / peak_flops if peak_flops else None,
                "pct_of_bandwidth": 100.0 * nbytes / secs / bandwidth if bandwidth else None,
                "predicted_seconds": pred,
                "predicted_over_measured": pred / secs,
                "median_predicted_step_seconds": statistics.median(s.predicted_seconds for s in ss),
                "bound": statistics.mode(s.bound for s in ss),
            })
        out[phase] = d
    return out


def latency_prompts(batch_size: int, input_len: int, output_len: int, vocab_size: int, seed: int) -> list:
    return random_requests(batch_size, input_len, output_len, vocab_size=vocab_size, seed=seed)


def paired_decode_bandwidth(llm, batch_size: int, input_len: int, output_len: int, seed: int = 0,
                            every: int = 8, num_bytes: int = 256 * 2**20) -> Optional[dict]:
    """One more batch of the same shape, stepped by hand, with the read bandwidth measured (a streaming
    torch sum over `num_bytes`, the probe's measure, median of 3) before the first step, after every
    `every` steps and after the last. Each segment of decode steps is set against the mean of the two
    samples around it: share = sum(bytes moved) / sum(seconds x that bandwidth), the bytes decode moved
    over those the memory could have streamed in the same seconds at the rate read around them.
    The samples sit between steps, never inside one; a decode step re-reads all weights from memory
    (they do not fit in the caches), so a sample does not change what the next step has to fetch."""
    engine = llm.engine
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)  # ones: every page touched before timing

    def sample() -> float:
        return measure_read_bandwidth(runs=3, buf=buf, warmup=0)

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    reqs = latency_prompts(batch_size, input_len, output_len, engine.model_config.vocab_size, seed + 20_000)
    for i, r in enumerate(reqs):
        engine.add_request(f"bw-pair-{seed}-{i}", r.prompt, params)
    samples = [sample()]
    segments = []  # (bytes, seconds, bandwidth around them)
    nbytes = secs = 0.0
    k = 0
    while engine.has_unfinished():
        engine.step()
        k += 1
        rec = engine.step_records[-1]
        if rec.phase == "decode" and rec.bytes:
            nbytes += rec.bytes
            secs += rec.wall_seconds
        if k % every == 0 or not engine.has_unfinished():
            samples.append(sample())
            if secs:
                segments.append((nbytes, secs, (samples[-2] + samples[-1]) / 2))
            nbytes = secs = 0.0
    if not segments:
        return None
    moved = sum(b for b, _, _ in segments)
    could = sum(s * bw for _, s, bw in segments)
    return {"pct": 100.0 * moved / could, "achieved_bytes_per_s": moved / sum(s for _, s, _ in segments),
            "every_steps": every, "decode_segments": len(segments), "samples": samples,
            "median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def run_engine_latency(llm, batch_size: int, input_len: int, output_len: int, iters: int = 3,
                       warmup: bool = True, seed: int = 0, hardware=None, dtype: str = "float32",
                       on_iteration: Optional[Callable[[int, dict], None]] = None,
                       measure_bandwidth: Optional[bool] = None) -> dict:
    """Time `iters` batches through a servescope LLM. `hardware`: a HardwareSpec for the roofline.
    measure_bandwidth: sample the read bandwidth around the iterations (default: on the CPU)."""
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    if warmup:  # the same shapes, few tokens: first-call allocations and kernel choice stay out
        w = latency_prompts(batch_size, input_len, output_len, vocab, seed + 10_000)
        llm.generate([r.prompt for r in w], params.replace(max_tokens=min(output_len, 4)))
    peak = hardware.flops(dtype) if hardware is not None else None
    bw = hardware.memory_bandwidth if hardware is not None else None
    if measure_bandwidth is None:
        measure_bandwidth = engine.device.type == "cpu"
    bw_samples = []

    def sample_bandwidth():
        if measure_bandwidth:
            bw_samples.append(measure_read_bandwidth(runs=3))

    runs, all_steps = [], []
    for it in range(iters):
        sample_bandwidth()
        reqs = latency_prompts(batch_size, input_len, output_len, vocab, seed + it)
        first = len(engine.step_records)
        t0 = time.perf_counter()
        outs = llm.generate([r.prompt for r in reqs], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        steps = list(engine.step_records)[first:]
        all_steps.extend(steps)
        ms = [o.metrics for o in outs]
        n_out = sum(len(o.outputs[0].token_ids) for o in outs)
        runs.append({
            "wall_seconds": wall,
            "ttft_s": _median(m.ttft for m in ms),
            "max_ttft_s": max(m.ttft for m in ms),
            "tpot_s": _median(m.tpot for m in ms),
            "e2e_s": _median(m.e2e for m in ms),
            "output_tokens": n_out,
            "output_tokens_per_s": n_out / wall,
            "num_steps": len(steps),
        })
        if on_iteration is not None:
            on_iteration(it, runs[-1])
    sample_bandwidth()
    paired = None
    if measure_bandwidth and output_len >= 8:  # enough decode steps to pair (not the TTFT shapes)
        paired = paired_decode_bandwidth(llm, batch_size, input_len, output_len, seed)
    phases = phase_breakdown(all_steps, peak, bw)
    session_bw = statistics.median(bw_samples) if bw_samples else None
    for d in phases.values():
        if session_bw and d.get("achieved_bytes_per_s") is not None:
            d["pct_of_session_bandwidth"] = 100.0 * d["achieved_bytes_per_s"] / session_bw
    dec = phases.get("decode")
    res = {
        "ttft_s": _median(r["ttft_s"] for r in runs),
        "tpot_s": _median(r["tpot_s"] for r in runs),
        "e2e_s": _median(r["e2e_s"] for r in runs),
        "wall_seconds": _median(r["wall_seconds"] for r in runs),
        "output_tokens_per_s": _median(r["output_tokens_per_s"] for r in runs),
        # the decode rate the steps achieve: batch tokens per median decode step
        "decode_tokens_per_s": (batch_size / dec["median_step_seconds"]) if dec else None,
        "phases": phases,
        "iterations": runs,
        "_steps": all_steps,
    }
    if hardware is not None:
        res["hardware"] = {"name": hardware.name, "memory_bandwidth": bw, "peak_flops": peak, "dtype": dtype}
    if paired is not None:
        res["paired_bandwidth"] = paired
    if bw_samples:
        res["session_bandwidth"] = {"samples": bw_samples, "median": session_bw, "min": min(bw_samples),
                                    "max": max(bw_samples)}
    return res
