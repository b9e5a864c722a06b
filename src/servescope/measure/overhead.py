"""Host overhead of an engine step, measured on the engine itself with a model too small to cost
anything but overhead.

The roofline prices FLOPs and bytes. An eager engine also pays host work that neither measures:
per step (schedule, build the step's tensors, sample, process tokens, record the StepRecord) and
per decoder layer (a dozen Python-level calls: module dispatch, views, the C++ kernels' launch).
This measures both directly rather than fitting them to the steps they are meant to predict: the
same model class, kernels and engine loop, on configs whose widths are tiny (hidden 128, one KV
head of 64, vocabulary 512) so that the arithmetic and memory traffic are negligible, at two depths.
The difference between the depths is the per-layer cost, the rest the per-step cost.

What it cannot see: work that only exists at real sizes (waking the second thread for a large
kernel, cache misses on the model's own weights) stays in the roofline's terms.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
from pathlib import Path

from servescope.config import EngineConfig, SamplingParams
from servescope.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

DEPTHS = (2, 32)


def _tiny_config(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "num_hidden_layers": layers, "vocab_size": 512, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2}


def decode_step_seconds(layers: int, dtype: str = "float32", device: str = "cpu", steps: int = 40,
                        prompt_len: int = 64) -> float:
    """Median wall time of a batch-1 decode step of the tiny model with `layers` layers."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(_tiny_config(layers)))
        engine = LLMEngine(EngineConfig(model=f"random:{path}", dtype=dtype, device=device, num_kv_blocks=64,
                                        max_model_len=256, max_num_seqs=4,
                                        # any datasheet spec: the step's prediction is computed (its host
                                        # cost is part of the overhead) without asking the local probe,
                                        # which is what calls this
                                        hardware="H100-SXM"))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    prompt = [3 + (i * 7) % 500 for i in range(prompt_len)]
    times = []
    for rep in range(2):  # the first pass warms the allocator and the kernels' first calls
        engine.add_request(f"overhead-{rep}", prompt, params)
        first = len(engine.step_records)
        while engine.has_unfinished():
            engine.step()
        if rep:
            times = [r.wall_seconds for r in list(engine.step_records)[first:] if r.phase == "decode"]
    return statistics.median(times)


def measure_host_overhead(dtype: str = "float32", device: str = "cpu") -> tuple:
    """(per-step seconds, per-layer seconds) of this engine's host work on this machine."""
    lo, hi = DEPTHS
    t_lo, t_hi = decode_step_seconds(lo, dtype, device), decode_step_seconds(hi, dtype, device)
    per_layer = max((t_hi - t_lo) / (hi - lo), 0.0)
    per_step = max(t_lo - lo * per_layer, 0.0)
    logger.info("host overhead: %.2f ms per step + %.1f us per layer", per_step * 1e3, per_layer * 1e6)
    return per_step, per_layer
