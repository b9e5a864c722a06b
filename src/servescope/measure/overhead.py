"""Host overhead of an engine step, measured on the engine itself with a model too small to cost
anything but overhead.

The roofline prices FLOPs and bytes. An eager engine also pays host work that neither measures:
per step (schedule, build the step's tensors, sample, process tokens, record the StepRecord), per
decoder layer (a dozen Python-level calls: module dispatch, views, the C++ kernels' launch) and per
sequence in the step (its scheduling, its rows of the step's tensors -- positions, slots, block
table --, its sample, its token's bookkeeping and output). This measures them directly rather than
fitting them to the steps they are meant to predict: the same model class, kernels and engine loop,
on configs whose widths are tiny (hidden 128, one KV head of 64, vocabulary 512) so that the
arithmetic and memory traffic are negligible, at two depths and two batch sizes (1 and BATCH decodes).
At batch 1 the difference between the depths is the per-layer cost, the rest the per-step cost (less
its one sequence's, which the cost model adds per sequence). The slope from batch 1 to BATCH is the
per-sequence cost plus, per layer, what each row adds to the layer's kernels (attention over one more
sequence, norms of one more row); the kernel table prices that share at the real model's shapes, so it
is taken out: the per-sequence cost is the slope at the shallow depth less its layers' share of the
slope's growth with depth.

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
BATCH = 32  # the decodes of the per-sequence slope's wider step
BATCH_STEPS = 16  # decode steps of the wider step (the median of its 15 decodes)


def _tiny_config(layers: int) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
            "intermediate_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "num_hidden_layers": layers, "vocab_size": 512, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
            "bos_token_id": 1, "eos_token_id": 2}


def decode_step_seconds(layers: int, dtype: str = "float32", device: str = "cpu", steps: int = 40,
                        prompt_len: int = 64, batch: int = 1) -> float:
    """Median wall time of a decode step of `batch` sequences of the tiny model with `layers` layers."""
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "config.json"
        path.write_text(json.dumps(_tiny_config(layers)))
        engine = LLMEngine(EngineConfig(model=f"random:{path}", dtype=dtype, device=device,
                                        num_kv_blocks=max(batch * (prompt_len + steps) // 16 + batch, 16) + 8,
                                        max_model_len=256, max_num_seqs=max(batch, 4),
                                        # any datasheet spec: the step's prediction is computed (its host
                                        # cost is part of the overhead) without asking the local probe,
                                        # which is what calls this
                                        hardware="H100-SXM"))
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    times = []
    for rep in range(2):  # the first pass warms the allocator and the kernels' first calls
        for b in range(batch):
            engine.add_request(f"overhead-{rep}-{b}", [3 + (b * 31 + i * 7) % 500 for i in range(prompt_len)], params)
        first = len(engine.step_records)
        while engine.has_unfinished():
            engine.step()
        if rep:
            times = [r.wall_seconds for r in list(engine.step_records)[first:]
                     if r.phase == "decode" and r.num_decode_seqs == batch]
    return statistics.median(times)


def split_host_overhead(times: dict, depths: tuple = DEPTHS, batch: int = BATCH) -> tuple:
    """(per step, per layer, per sequence) seconds from decode step times {(layers, batch size): seconds}
    at the two depths and batch sizes 1 and `batch` (the module's docstring says how)."""
    lo, hi = depths
    per_layer = max((times[hi, 1] - times[lo, 1]) / (hi - lo), 0.0)
    slope = {d: (times[d, batch] - times[d, 1]) / (batch - 1) for d in depths}
    per_row_layer = max((slope[hi] - slope[lo]) / (hi - lo), 0.0)  # the layers' kernels over one more row
    per_seq = max(slope[lo] - lo * per_row_layer, 0.0)
    # a batch-1 step holds one sequence: the cost model adds it per sequence, so it leaves the per-step term
    per_step = max(times[lo, 1] - lo * per_layer - per_seq, 0.0)
    return per_step, per_layer, per_seq


def measure_host_overhead(dtype: str = "float32", device: str = "cpu") -> tuple:
    """(per-step seconds, per-layer seconds, per-sequence seconds) of this engine's host work here."""
    times = {(d, b): decode_step_seconds(d, dtype, device, steps=40 if b == 1 else BATCH_STEPS, batch=b)
             for d in DEPTHS for b in (1, BATCH)}
    per_step, per_layer, per_seq = split_host_overhead(times)
    logger.info("host overhead: %.2f ms per step + %.1f us per layer + %.1f us per sequence", per_step * 1e3,
                per_layer * 1e6, per_seq * 1e6)
    return per_step, per_layer, per_seq
