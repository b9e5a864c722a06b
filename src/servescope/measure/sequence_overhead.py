"""The engine's host work per scheduled sequence and per detokenised token, measured on the engine.

measure/overhead.py measures what a step costs whatever its batch (per step, per layer) on a model too
small to cost anything else. A step also pays host work per sequence in it (its scheduling, its rows of
the step's tensors, its sample, its token's bookkeeping, its StepRecord entries): measured the same way,
as the slope of the tiny model's decode step between batch 1 and batch BATCH. And per output token of a
model with a tokenizer, the incremental detokeniser's work: timed on the embedded model's tokenizer.
The simulator adds both to its steps (sim/spec.HostCosts); cached beside the probe's spec, under the
same key (CPU, kernel path, threads).
"""

from __future__ import annotations

import json
import logging
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Optional

from servescope.analysis.cpu_isa import local_isa
from servescope.analysis.probe import cpu_model, default_cache_path, torch_threads
from servescope.config import EngineConfig, SamplingParams
from servescope.engine.llm_engine import LLMEngine
from servescope.measure.overhead import _tiny_config
from servescope.loader.source import load_model_source
from servescope.telemetry.step_record import step_period
from servescope.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)

BATCH = 32
DETOKENISED_TOKENS = 2000
CACHE_NAME = "host_costs.json"


def _decode_step_seconds(engine, batch: int, steps: int = 24) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    times = []
    for rep in range(2):  # the first pass warms the allocator and the kernels at this batch
        for b in range(batch):
            engine.add_request(f"seq-{batch}-{rep}-{b}", [3 + (b * 31 + i * 7) % 500 for i in range(32)], params)
        first = len(engine.step_records)
        while engine.has_unfinished():
            engine.step()
        if rep:
            recs = list(engine.step_records)[first:]
            # a step's period (to the next step's start): the work between steps belongs to the batch too
            times = [step_period(recs, i) for i, r in enumerate(recs)
                     if r.phase == "decode" and r.num_decode_seqs == batch]
    return statistics.median(times)


def measure_per_sequence_seconds(dtype: str = "float32", device: str = "cpu") -> float:
    """Host seconds each extra sequence adds to a decode step (the tiny model's slope, batch 1 -> BATCH)."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(_tiny_config(2)))
        engine = LLMEngine(EngineConfig(model=f"random:{path}", dtype=dtype, device=device, num_kv_blocks=512,
                                        max_model_len=256, max_num_seqs=BATCH, hardware="H100-SXM"))
    t1, tb = _decode_step_seconds(engine, 1), _decode_step_seconds(engine, BATCH)
    return max((tb - t1) / (BATCH - 1), 0.0)


def measure_detokenise_seconds(model: Optional[str] = None) -> float:
    """Seconds the OutputProcessor's incremental detokeniser takes per token of the model's tokenizer."""
    tok = load_tokenizer(load_model_source(model).tokenizer_source)
    rng = random.Random(0)
    ids = [rng.randrange(1000, 40000) for _ in range(DETOKENISED_TOKENS)]
    best = float("inf")
    for _ in range(3):
        detok = IncrementalDetokenizer(tok, ids[:32])
        t0 = time.perf_counter()
        for t in ids:
            detok.add(t)
        best = min(best, (time.perf_counter() - t0) / len(ids))
    return best


def host_costs(dtype: str, with_tokenizer: bool, force: bool = False) -> tuple:
    """(per-sequence seconds, per-token seconds, source), measured once per machine and dtype, cached."""
    path = default_cache_path().with_name(CACHE_NAME)
    key = f"{cpu_model()}|{local_isa()}|threads={torch_threads()}|{dtype}"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    entry = None if force else cache.get(key)
    if entry is None:
        entry = {"per_seq_s": measure_per_sequence_seconds(dtype), "per_token_s": measure_detokenise_seconds()}
        cache[key] = entry
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1))
        logger.info("host costs: %.1f us per sequence, %.1f us per detokenised token",
                    entry["per_seq_s"] * 1e6, entry["per_token_s"] * 1e6)
    per_token = entry["per_token_s"] if with_tokenizer else 0.0
    return entry["per_seq_s"], per_token, f"measured on the engine, {path}"
