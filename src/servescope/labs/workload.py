"""One workload measured on the local engine and checked against the cost model (`explain --measure`).

batch x prompt_len random prompts run for output_len greedy tokens (ignore_eos) on the local CPU;
each phase is compared with the cost model's prediction on the local-cpu spec: prefill = the steps
with prefill tokens (summed), decode = the median decode step.
"""

from __future__ import annotations

import random
from typing import Optional

from servescope.analysis.explain import explain
from servescope.config import EngineConfig
from servescope.engine.llm_engine import LLMEngine
from servescope.measure.local_hardware import measured_engine, probe_local_cpu
from servescope.errors import InvalidParameterError
from servescope.labs.common import blocks_for, median, random_prompt, rel_error, run_to_completion, warm_up

NOTE = ("prefill: sum of the steps with prefill tokens; decode: median decode step; "
        "error = (predicted - measured) / measured; the roofline has no per-step overhead")


def _workload_engine(model: Optional[str], batch: int, prompt_len: int, output_len: int, weight_dtype: str,
                     kv_dtype: Optional[str], threads: Optional[int]) -> LLMEngine:
    """An engine that holds the whole batch at once: no prefix cache (random prompts share nothing
    anyway), no chunking (one prefill step), KV blocks for every token of every sequence."""
    total = prompt_len + output_len
    return measured_engine(EngineConfig(
        model=model, dtype="bfloat16" if weight_dtype == "int8" else weight_dtype,
        quantization="int8" if weight_dtype == "int8" else None, kv_cache_dtype=kv_dtype or "auto",
        max_num_seqs=batch, enable_prefix_caching=False, enable_chunked_prefill=False,
        max_num_batched_tokens=max(batch * prompt_len, 1024), max_model_len=total + 16,
        num_kv_blocks=batch * blocks_for(total, margin=1) + 8, num_threads=threads, hardware="local-cpu"))


def _phase(name: str, steps: int, measured: float, predicted: float) -> dict:
    return {"name": name, "steps": steps, "measured_seconds": measured, "predicted_seconds": predicted,
            "error": rel_error(predicted, measured)}


def measure_workload(model: Optional[str], batch: int, prompt_len: int, output_len: int,
                     weight_dtype: str = "float32", kv_dtype: Optional[str] = None,
                     threads: Optional[int] = None) -> dict:
    """Run the workload on the local engine; return {hardware, model, phases: [{name, steps,
    measured_seconds, predicted_seconds, error}], note}.

    `model` is what the engine loads (None: the embedded model; "random:PRESET": random weights);
    `weight_dtype` is explain's (float32 | bfloat16 | int8: bfloat16 activations, int8 linear weights).
    """
    if weight_dtype == "float16":
        raise InvalidParameterError("dtype", "--measure runs on the CPU: use float32 or bfloat16")
    engine = _workload_engine(model, batch, prompt_len, output_len, weight_dtype, kv_dtype, threads)
    rng = random.Random(0)
    warm_up(engine, rng)
    prompts = [random_prompt(rng, prompt_len, engine.model_config.vocab_size) for _ in range(batch)]
    _, recs = run_to_completion(engine, prompts, output_len, "m")
    hw = probe_local_cpu()  # after the engine: the probe is keyed by the torch threads the engine set
    pred = explain(engine.model_config, hw, batch=batch, prompt_len=prompt_len, output_len=output_len,
                   weight_dtype=weight_dtype, kv_dtype=kv_dtype)
    by_name = {p["name"]: p for p in pred["phases"]}
    pre = [r for r in recs if r.num_prefill_tokens]
    dec = [r for r in recs if r.phase == "decode"]
    phases = []
    if pre:
        phases.append(_phase("prefill", len(pre), sum(r.wall_seconds for r in pre),
                             by_name["prefill"]["predicted_seconds"]))
    if dec and "decode" in by_name:
        phases.append(_phase("decode", len(dec), median([r.wall_seconds for r in dec]),
                             by_name["decode"]["predicted_seconds"]))
    return {"hardware": hw.name, "model": engine.model_config.name or str(engine.source_path), "phases": phases,
            "note": NOTE}
