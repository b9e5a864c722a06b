"""servescope.analysis: op counts, cost model, hardware specs, memory planner, roofline (pure functions).

Nothing here imports the engine; torch is imported only by the local hardware probe, lazily.
The names below load their module on first use: importing one module of the package (the kernel build
reads cpu_isa before anything else is installed, see the Makefile) must not import rich or matplotlib.
"""

import importlib

_EXPORTS = {
    "cost_model": ("OpCost", "StepCost", "critical_batch_size", "decode_cost", "predict_tpot", "predict_ttft",
                   "prefill_cost", "step_cost"),
    "hardware": ("HARDWARE_SPECS", "HardwareSpec", "get_hardware", "list_hardware"),
    "memory_planner": ("MemoryPlan", "max_context_for_concurrency", "plan_memory"),
    "op_counts": ("attention_flops", "attention_flops_noncausal", "kv_cache_bytes_per_token", "matmul_flops",
                  "weight_bytes"),
    "presets": ("list_presets", "load_preset"),
    "roofline": ("attainable_flops", "plot_roofline"),
    # (explain() itself is servescope.analysis.explain.explain: the name is its module's)
    "explain": ("render_explain_table",),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name):
    if name in _MODULE_OF:
        return getattr(importlib.import_module(f"servescope.analysis.{_MODULE_OF[name]}"), name)
    raise AttributeError(f"module 'servescope.analysis' has no attribute {name!r}")
