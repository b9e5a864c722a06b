"""servescope.analysis: op counts, cost model, hardware specs, memory planner, roofline (pure functions).

Nothing here imports the engine; torch is imported only by the local hardware probe, lazily.
"""

from servescope.analysis.cost_model import (
    OpCost, StepCost, critical_batch_size, decode_cost, predict_tpot, predict_ttft, prefill_cost, step_cost,
)
from servescope.analysis.explain import explain, render_explain_table
from servescope.analysis.hardware import HARDWARE_SPECS, HardwareSpec, get_hardware, list_hardware
from servescope.analysis.memory_planner import MemoryPlan, max_context_for_concurrency, plan_memory
from servescope.analysis.op_counts import (
    attention_flops, attention_flops_noncausal, kv_cache_bytes_per_token, matmul_flops, weight_bytes,
)
from servescope.analysis.presets import list_presets, load_preset
from servescope.analysis.roofline import attainable_flops, plot_roofline

__all__ = [
    "OpCost", "StepCost", "attention_flops", "attention_flops_noncausal", "critical_batch_size", "decode_cost",
    "kv_cache_bytes_per_token", "matmul_flops", "predict_tpot", "predict_ttft", "prefill_cost", "step_cost",
    "weight_bytes", "explain", "render_explain_table", "HARDWARE_SPECS", "HardwareSpec", "get_hardware",
    "list_hardware", "MemoryPlan", "max_context_for_concurrency", "plan_memory", "list_presets", "load_preset",
    "attainable_flops", "plot_roofline",
]
