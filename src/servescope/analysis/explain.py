"""`servescope explain`: what a workload costs on a machine, before running anything.

`explain` returns a JSON-ready dict (the `--json` output); `render_explain_table` turns it into rich
tables for the terminal. Both are pure: the CLI picks the model config and hardware spec.

The workload: `batch` requests, each with `prompt_len` prompt tokens and `output_len` output
tokens, arriving together. Prefill is one step over all prompts (no chunking); it produces each
request's first token, so TTFT = the prefill step. Decode runs output_len - 1 steps of `batch`
tokens. The decode phase reported is the step at the middle context, prompt_len +
(output_len - 2) // 2 cached tokens: every op's FLOPs and bytes grow linearly with context, so
while no op changes bound over the run, the middle step's time is the average step's time.
e2e = TTFT + (output_len - 1) * TPOT.
"""

from __future__ import annotations

import math
from typing import Optional

from rich.console import Group
from rich.table import Table

from servescope.analysis.cost_model import critical_batch_size, step_cost
from servescope.analysis.bandwidth import bandwidth_origin
from servescope.analysis.hardware import HardwareSpec
from servescope.analysis.memory_planner import plan_memory
from servescope.analysis.moe import moe_summary
from servescope.analysis.op_counts import kv_cache_bytes_held, kv_cache_bytes_per_token, resolve_dtypes, weight_bytes
from servescope.config import ModelConfig
from servescope.errors import InvalidParameterError


def _phase(name: str, cost, context_len: int) -> dict:
    d = cost.to_dict()
    return {
        "name": name,
        "num_tokens": d["num_tokens"],
        "num_seqs": d["num_seqs"],
        "context_len": context_len,
        "flops": d["flops"],
        "bytes": d["bytes"],
        "weight_bytes": d["weight_bytes"],
        "arithmetic_intensity": d["arithmetic_intensity"],
        "predicted_seconds": d["predicted_seconds"],
        "overhead_seconds": d["overhead_seconds"],
        "achieved_flops_per_s": d["flops"] / d["predicted_seconds"] if d["predicted_seconds"] else None,
        "bound": d["bound"],
        "ops": d["ops"],
    }


def explain(cfg: ModelConfig, hw: HardwareSpec, batch: int = 1, prompt_len: int = 512, output_len: int = 128,
            weight_dtype: str = "bfloat16", kv_dtype: Optional[str] = None, memory_bytes: Optional[int] = None,
            *, act_dtype: Optional[str] = None, block_size: int = 16, efficiency: Optional[dict] = None,
            overhead_s: Optional[float] = None) -> dict:
    """The cost model's account of one workload; see the module docstring for its assumptions.
    memory_bytes defaults to hw.memory_bytes. Infinite quantities are reported as null."""
    if batch < 1 or prompt_len < 1 or output_len < 1:
        raise InvalidParameterError("batch", f"batch, prompt_len and output_len must be >= 1, "
                                             f"got {batch}, {prompt_len}, {output_len}")
    wdt, adt, kdt = resolve_dtypes(weight_dtype, act_dtype, kv_dtype)
    kw = dict(efficiency=efficiency, overhead_s=overhead_s)
    prefill = step_cost(cfg, [(prompt_len, 0)] * batch, hw, wdt, kdt, adt, **kw)
    phases = [_phase("prefill", prefill, 0)]
    ttft = prefill.predicted_seconds
    mid_ctx = prompt_len + max(output_len - 2, 0) // 2
    tpot = None
    if output_len > 1:
        decode = step_cost(cfg, [(1, mid_ctx)] * batch, hw, wdt, kdt, adt, **kw)
        phases.append(_phase("decode", decode, mid_ctx))
        tpot = decode.predicted_seconds
    e2e = ttft + (output_len - 1) * (tpot or 0.0)
    crit = critical_batch_size(cfg, hw, wdt, mid_ctx, kdt, adt, efficiency=efficiency)
    crit0 = critical_batch_size(cfg, hw, wdt, 0, kdt, adt, efficiency=efficiency)
    total_len = prompt_len + output_len
    plan = plan_memory(cfg, hw.memory_bytes if memory_bytes is None else memory_bytes, wdt, kdt,
                       context_len=total_len, block_size=block_size, act_dtype=adt,
                       max_num_batched_tokens=max(prompt_len * batch, block_size), max_num_seqs=batch)
    return {
        "model": cfg.name or cfg.architecture,
        "hardware": {"name": hw.name, "kind": hw.kind, "peak_flops": hw.flops(adt),
                     "memory_bandwidth": hw.memory_bandwidth, "memory_bytes": hw.memory_bytes,
                     "ridge_point": hw.ridge_point(adt), "probed_bandwidth": hw.probed_bandwidth,
                     "spot_bandwidth": hw.spot_bandwidth, "bandwidth_origin": bandwidth_origin(hw)},
        "workload": {"batch": batch, "prompt_len": prompt_len, "output_len": output_len,
                     "weight_dtype": wdt, "act_dtype": adt, "kv_dtype": kdt},
        "num_parameters": cfg.num_parameters(),
        "weight_bytes": weight_bytes(cfg, wdt, adt),
        "kv_cache_bytes_per_token": kv_cache_bytes_per_token(cfg, kdt),
        "kv_cache_bytes_per_sequence": kv_cache_bytes_held(cfg, kdt, total_len),  # a window caps it
        "critical_batch_size": None if math.isinf(crit) else crit,
        "critical_batch_size_context": mid_ctx,
        "critical_batch_size_no_context": None if math.isinf(crit0) else crit0,
        "max_concurrent_sequences": plan.max_concurrent_sequences,
        "memory": plan.to_dict(),
        "phases": phases,
        "ttft_seconds": ttft,
        "tpot_seconds": tpot,
        "e2e_seconds": e2e,
        "decode_tokens_per_second": batch / tpot if tpot else None,
        # a MoE: experts, active parameters, distinct experts a decode step of `batch` tokens reads per layer
        "moe": moe_summary(cfg, batch),
    }


# --------------------------------------------------------------------------- rendering

def _bytes(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _flops(n) -> str:
    if n is None:
        return "-"
    for unit, size in (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} FLOP"


def _secs(s) -> str:
    if s is None:
        return "-"
    if s >= 1:
        return f"{s:.2f} s"
    if s >= 1e-3:
        return f"{s * 1e3:.2f} ms"
    return f"{s * 1e6:.1f} µs"


def _num(x, fmt="{:.1f}") -> str:
    return "-" if x is None else ("inf" if math.isinf(x) else fmt.format(x))


def _kv_group_rows(mem: dict) -> list:
    """One row per attention kind when the model has more than one (analysis/kv_layout.py)."""
    groups = mem.get("kv_groups") or ()
    if len(groups) < 2:
        return []
    rows = []
    for g in groups:
        name = "full" if not g["window"] else f"window {g['window']}"
        per_tok = g["bytes_per_token"]
        rows.append((f"KV {name} ({g['layers']} layers): token / seq, one table / per group",
                     f"{_bytes(per_tok)} / {_bytes(per_tok * g['engine_tokens_per_sequence'])}"
                     f" / {_bytes(per_tok * g['needed_tokens_per_sequence'])}"))
    rows.append(("max sequences, block tables per group",
                 str(mem["max_concurrent_sequences_per_group_tables"])))
    return rows


def render_explain_table(result: dict):
    """Rich renderables for `explain`'s result: a summary table, a phase table and one op table
    per phase, grouped so that `console.print(render_explain_table(r))` shows them all."""
    w, hw, mem = result["workload"], result["hardware"], result["memory"]
    summary = Table(title=f"{result['model']} on {hw['name']}: batch {w['batch']}, prompt {w['prompt_len']}, "
                          f"output {w['output_len']} ({w['weight_dtype']} weights, {w['kv_dtype']} KV)",
                    show_header=False)
    summary.add_column("what")
    summary.add_column("value", justify="right")
    crit = result["critical_batch_size"]
    rows = [
        ("parameters", f"{result['num_parameters'] / 1e9:.2f} B"),
        ("weights", _bytes(result["weight_bytes"])),
        ("KV cache per token", _bytes(result["kv_cache_bytes_per_token"])),
        ("KV cache per sequence", _bytes(result["kv_cache_bytes_per_sequence"])),
        ("memory / free for KV", f"{_bytes(mem['memory_bytes'])} / {_bytes(mem['free_for_kv_bytes'])}"),
        ("max concurrent sequences", str(result["max_concurrent_sequences"])),
        *_kv_group_rows(mem),
        (f"critical batch (context {result['critical_batch_size_context']})",
         "never compute-bound" if crit is None else f"{crit:.1f}"),
        ("memory bandwidth", f"{hw['memory_bandwidth'] / 1e9:,.1f} GB/s"
         + (f" ({hw['bandwidth_origin']})" if hw.get("bandwidth_origin") else "")),
        ("ridge point", f"{hw['ridge_point']:.0f} FLOP/B"),
        ("TTFT", _secs(result["ttft_seconds"])),
        ("TPOT", _secs(result["tpot_seconds"])),
        ("end to end", _secs(result["e2e_seconds"])),
        ("decode tokens/s", _num(result["decode_tokens_per_second"])),
    ]
    moe = result.get("moe")
    if moe:
        rows[1:1] = [
            ("active parameters / token", f"{moe['active_parameters'] / 1e9:.2f} B"),
            ("experts", f"{moe['top_k']} of {moe['num_experts']} per token, {moe['sparse_layers']} sparse "
                        "layers" + (f", shared width {moe['shared_expert_width']}" if moe["shared_expert_width"]
                                    else "") + (f", stored {moe['expert_format'].upper()}"
                                                if moe.get("expert_format") else "")),
            (f"distinct experts read / layer (decode, batch {w['batch']})",
             f"{moe['expected_distinct_experts']:.1f} (uniform routing)"),
        ]
    for k, v in rows:
        summary.add_row(k, v)

    phases = Table(title="phases (decode: the step at the middle context)")
    for col in ("phase", "tokens", "context", "FLOPs", "bytes", "FLOP/B", "time", "bound"):
        phases.add_column(col, justify="left" if col in ("phase", "bound") else "right")
    for p in result["phases"]:
        phases.add_row(p["name"], str(p["num_tokens"]), str(p["context_len"]), _flops(p["flops"]),
                       _bytes(p["bytes"]), _num(p["arithmetic_intensity"]), _secs(p["predicted_seconds"]),
                       p["bound"])

    renderables = [summary, phases]
    for p in result["phases"]:
        t = Table(title=f"{p['name']} ops")
        for col in ("op", "FLOPs", "bytes", "FLOP/B", "time", "share", "bound"):
            t.add_column(col, justify="left" if col in ("op", "bound") else "right")
        total = p["predicted_seconds"] or 1.0
        for o in p["ops"]:
            t.add_row(o["name"], _flops(o["flops"]), _bytes(o["bytes"]), _num(o["arithmetic_intensity"]),
                      _secs(o["predicted_seconds"]), f"{100 * o['predicted_seconds'] / total:.1f}%", o["bound"])
        renderables.append(t)
    return Group(*renderables)
