"""The engine's host work per detokenised output token, measured on the model's tokenizer.

The host work per step, per layer and per scheduled sequence is the probe's (measure/overhead.py, in
the HardwareSpec the cost model prices every step with: the engine's StepRecords and the simulator's
clock alike). What it cannot see is the incremental detokeniser of a model with a tokenizer (the probe's
tiny model has none): timed here on the embedded model's tokenizer, per token. The simulator adds it per
sampled row (sim/spec.HostCosts); cached beside the probe's spec, under the CPU's key.
"""

from __future__ import annotations

import json
import logging
import random
import time
from typing import Optional

from servescope.analysis.cpu_isa import local_isa
from servescope.analysis.probe import cpu_model, default_cache_path
from servescope.loader.source import load_model_source
from servescope.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)

DETOKENISED_TOKENS = 2000
CACHE_NAME = "detokenise.json"


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


def detokenise_cost(with_tokenizer: bool, force: bool = False) -> tuple:
    """(seconds per detokenised token, source): measured once per machine, cached; 0 without a tokenizer."""
    if not with_tokenizer:
        return 0.0, "no tokenizer: nothing detokenised"
    path = default_cache_path().with_name(CACHE_NAME)
    key = f"{cpu_model()}|{local_isa()}"
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        cache = {}
    per_token = None if force else cache.get(key)
    if per_token is None:
        per_token = cache[key] = measure_detokenise_seconds()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(cache, indent=1))
        logger.info("host costs: %.1f us per detokenised token", per_token * 1e6)
    return float(per_token), f"measured on the tokenizer, {path}"
