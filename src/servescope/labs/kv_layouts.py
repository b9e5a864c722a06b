"""Lab `kv-layouts`: what a token costs in the KV cache under each attention layout, and what that does to
capacity and to decode time as the context grows.

Five random models of one shape, differing only in attention: MHA (as many KV heads as query heads), GQA
(a quarter), MQA (one), windowed (GQA, every layer over the last W positions, Mistral's layout) and hybrid
(GQA, Gemma 3's five windowed layers to one global). For each, measured beside predicted:
- KV bytes per token: the engine's cache tensors' bytes over their token slots, beside the cost model's
  2 x layers x KV heads x head_dim x dtype bytes (analysis/op_counts.py);
- KV held per sequence vs context: the bytes of the blocks the engine's KV manager holds for one request as it
  decodes (each group's blocks times its layers' bytes), beside analysis/kv_layout.py's count. A windowed model
  gives back what slid out, so it stays flat past W; the hybrid keeps a block table per group of layers
  (kvcache/hybrid.py): its windowed layers flat past W, its global layer growing. What one table for all layers
  would hold (every block in every layer) is shown beside it, predicted;
- capacity: the sequences of each context that a fixed KV budget holds;
- decode step time vs context (one request): the step's wall time and the cost model's prediction.
"""

from __future__ import annotations

import json
import random

from servescope.analysis.kv_layout import kv_groups
from servescope.analysis.op_counts import kv_cache_bytes_per_token
from servescope.config import EngineConfig
from servescope.labs.common import (
    LabOptions, LabResult, LabSession, blocks_for, greedy, md_table, median, new_figure, random_prompt, save_figure,
    write_report,
)
from servescope.measure.local_hardware import measured_engine

KV_BUDGET = 64 << 20  # bytes of KV cache for the capacity comparison
_SHAPE = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 6, "num_attention_heads": 8,
          "head_dim": 32, "vocab_size": 2048, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
          "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}


def sizes(quick: bool) -> dict:
    """the window, the longest context decoded to, the prompt before decoding"""
    return {"window": 64, "context": 512, "prompt": 16} if quick else {"window": 256, "context": 4096, "prompt": 64}


def layouts(window: int) -> dict:
    """name -> config.json of that layout over the shared shape."""
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    local = ["sliding_attention"] * 5 + ["full_attention"]
    return {
        "MHA": {**_SHAPE, **llama, "num_key_value_heads": 8},
        "GQA": {**_SHAPE, **llama, "num_key_value_heads": 2},
        "MQA": {**_SHAPE, **llama, "num_key_value_heads": 1},
        "windowed": {**_SHAPE, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                     "num_key_value_heads": 2, "sliding_window": window},
        # Gemma 3's pattern on plain layers (Qwen2's explicit layer_types), so that only the KV layout differs
        "hybrid": {**_SHAPE, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "num_key_value_heads": 2,
                   "attention_bias": False, "use_sliding_window": True, "sliding_window": window,
                   "max_window_layers": 0, "layer_types": local},
        # DeepSeek-V2's latent attention on dense layers (first_k_dense_replace: every layer): the cache holds
        # kv_lora_rank + qk_rope_head_dim = 80 values per token and layer, whatever the heads
        "MLA": {**_SHAPE, "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
                "num_key_value_heads": 8, "head_dim": 16, "kv_lora_rank": 64, "qk_rope_head_dim": 16,
                "qk_nope_head_dim": 32, "v_head_dim": 32, "q_lora_rank": None, "first_k_dense_replace": 6},
    }


def _engine(opts: LabOptions, config_path, context: int):
    cfg = EngineConfig(model=f"random:{config_path}", dtype=opts.dtype, num_threads=opts.threads,
                       hardware=opts.hardware, seed=opts.seed, enable_prefix_caching=False, skip_tokenizer_init=True,
                       max_num_seqs=1, max_model_len=context + 32, num_kv_blocks=blocks_for(context + 32),
                       max_num_batched_tokens=max(256, context))
    return measured_engine(cfg)


def _cache_bytes_per_token(engine) -> float:
    """The engine's KV tensors' bytes over the token slots they hold (measured on the tensors themselves)."""
    return engine.runner.kv_bytes_per_token  # each layer's tensors' bytes over that layer's token slots


def _decode_trace(engine, sz: dict, rng: random.Random) -> list:
    """(context, blocks held, wall s, predicted s) after each decode step of one request decoding to the context."""
    prompt = random_prompt(rng, sz["prompt"], engine.model_config.vocab_size)
    engine.add_request("kv", prompt, greedy(sz["context"] - sz["prompt"]))
    out = []
    while engine.has_unfinished():
        engine.step()
        rec = engine.step_records[-1]
        if rec.num_decode_seqs and engine.has_unfinished():
            out.append((rec.context_lens[0], engine.kv_manager.held_kv_tokens("kv"), rec.wall_seconds,
                        rec.predicted_seconds))
    return out


def measure_layout(opts: LabOptions, name: str, config: dict, sz: dict) -> dict:
    path = opts.out / "configs" / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config))
    engine = _engine(opts, path, sz["context"])
    cfg, cc = engine.model_config, engine.cache_config
    kdt = str(engine.kv_dtype).replace("torch.", "")
    rng = random.Random(opts.seed)
    _decode_trace(engine, {**sz, "context": sz["prompt"] + 8}, rng)  # warm-up
    trace = _decode_trace(engine, sz, rng)
    per_tok = kv_cache_bytes_per_token(cfg, kdt)
    points = []
    for c in _checkpoints(sz):
        ctx, held, _, _ = min(trace, key=lambda t: abs(t[0] - c))
        groups = kv_groups(cfg, kdt, ctx, cc.block_size)
        held_bytes = round(held * per_tok)
        per_group = sum(g.needed_bytes_per_sequence for g in groups)
        points.append({"context": ctx, "held_bytes": held_bytes, "predicted_held_bytes": per_group,
                       "one_table_bytes": sum(g.engine_bytes_per_sequence for g in groups),
                       "capacity": KV_BUDGET // held_bytes, "predicted_capacity": KV_BUDGET // per_group})
    bins = _bins(trace, sz)
    return {"kv_heads": cfg.kv_cache_geometry[0], "bytes_per_token": _cache_bytes_per_token(engine),
            "predicted_bytes_per_token": per_tok, "points": points, "steps": bins,
            "kinds": [s.attention.kind for s in cfg.layer_specs()]}


def _checkpoints(sz: dict) -> list:
    c, out = sz["context"], []
    while c > sz["prompt"] + 8:
        out.append(c - 8)
        c //= 2
    return sorted(out)


def _bins(trace: list, sz: dict, n: int = 6) -> list:
    """Median wall and predicted step time over n equal context ranges of the decode."""
    lo, hi = trace[0][0], trace[-1][0] + 1
    edges = [lo + (hi - lo) * i // n for i in range(n + 1)]
    out = []
    for a, b in zip(edges, edges[1:]):
        rows = [t for t in trace if a <= t[0] < b]
        if rows:
            out.append({"context": (a + b) // 2, "measured_s": median([t[2] for t in rows]),
                        "predicted_s": median([t[3] for t in rows])})
    return out


def _plot(results: dict, sz: dict, path):
    fig, (ax1, ax2, ax3) = new_figure(3, size=(5.5, 4.2))
    names = list(results)
    ax1.bar(range(len(names)), [results[n]["bytes_per_token"] / 1024 for n in names], label="measured")
    ax1.plot(range(len(names)), [results[n]["predicted_bytes_per_token"] / 1024 for n in names], "kx",
             markersize=9, label="predicted")
    ax1.set_xticks(range(len(names)), names, fontsize=7)
    ax1.set_ylabel("KV KiB per token (all layers)")
    ax1.set_title("KV bytes per token", fontsize=9)
    for n in names:
        pts = results[n]["points"]
        line, = ax2.plot([p["context"] for p in pts], [p["held_bytes"] / 2**20 for p in pts], "o-", label=n)
        ax2.plot([p["context"] for p in pts], [p["predicted_held_bytes"] / 2**20 for p in pts], "x",
                 color=line.get_color())
        if n == "hybrid":
            ax2.plot([p["context"] for p in pts], [p["one_table_bytes"] / 2**20 for p in pts], ":",
                     color=line.get_color(), label="hybrid, one table for all layers (predicted)")
        steps = results[n]["steps"]
        ax3.plot([s["context"] for s in steps], [s["measured_s"] * 1e3 for s in steps], "o-", color=line.get_color(),
                 label=n)
        ax3.plot([s["context"] for s in steps], [s["predicted_s"] * 1e3 for s in steps], "--", color=line.get_color())
    ax2.axvline(sz["window"], color="grey", linewidth=0.5)
    ax2.set(xlabel="context (tokens)", ylabel="KV MiB held by one sequence")
    ax2.set_title("KV held per sequence (o measured, x predicted)", fontsize=9)
    ax3.set(xlabel="context (tokens)", ylabel="decode step (ms)")
    ax3.set_ylim(bottom=0)
    ax3.set_title("decode step vs context (-- cost model)", fontsize=9)
    for ax in (ax1, ax2, ax3):
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=6)
    return save_figure(fig, path)


def _shows(results: dict, sz: dict) -> str:
    g = results["GQA"]
    last = {n: r["points"][-1] for n, r in results.items()}
    ratio = {n: r["steps"][-1]["measured_s"] / r["steps"][0]["measured_s"] for n, r in results.items()}
    return "\n\n".join([
        "Per token, the cache holds K and V for every layer and KV head: MHA "
        f"{results['MHA']['bytes_per_token']:.0f} B, GQA {g['bytes_per_token']:.0f} B, MQA "
        f"{results['MQA']['bytes_per_token']:.0f} B here (measured on the cache tensors, equal to the prediction). "
        f"Latent attention (MLA) holds one compressed row per token and layer instead: "
        f"{results['MLA']['bytes_per_token']:.0f} B, "
        f"{results['MHA']['bytes_per_token'] / results['MLA']['bytes_per_token']:.1f}x "
        f"less than MHA over the same 8 heads.",
        f"At {last['GQA']['context']} tokens of context one GQA sequence holds {last['GQA']['held_bytes'] / 2**20:.2f} "
        f"MiB; the windowed model {last['windowed']['held_bytes'] / 2**20:.2f} MiB, flat past its window of "
        f"{sz['window']} (the manager gives back the blocks that slid out). The hybrid holds "
        f"{last['hybrid']['held_bytes'] / 2**20:.2f} MiB with a block table per group of layers (its windowed "
        f"layers flat past the window, its global one growing); one table for all layers would keep every block "
        f"in every layer: {last['hybrid']['one_table_bytes'] / 2**20:.2f} MiB (predicted). In {KV_BUDGET >> 20} "
        f"MiB: GQA {last['GQA']['capacity']} sequences, windowed {last['windowed']['capacity']}, hybrid "
        f"{last['hybrid']['capacity']} (predicted {last['hybrid']['predicted_capacity']}).",
        "Decode step, last context bin over first: " + ", ".join(f"{n} x{r:.2f}" for n, r in ratio.items())
        + f". The windowed model reads at most {sz['window']} keys per layer, so its predicted step stops growing "
        "past the window; on a model this small a measured step is mostly fixed costs (and, on a shared machine, "
        "noise), so the slopes show best at the full run's longer context.",
    ])


def run(opts: LabOptions, session: LabSession) -> LabResult:
    sz = sizes(opts.quick)
    results = {name: measure_layout(opts, name, cfg, sz) for name, cfg in layouts(sz["window"]).items()}
    plot = _plot(results, sz, opts.out / "kv_layouts.png")
    rows = [[n, r["kv_heads"], "/".join(sorted(set(r["kinds"]))), round(r["bytes_per_token"]),
             r["predicted_bytes_per_token"],
             r["points"][-1]["held_bytes"] / 2**20, r["points"][-1]["one_table_bytes"] / 2**20,
             r["points"][-1]["capacity"], r["steps"][0]["measured_s"] * 1e3, r["steps"][-1]["measured_s"] * 1e3,
             r["steps"][-1]["predicted_s"] * 1e3] for n, r in results.items()]
    ctx = results["GQA"]["points"][-1]["context"]
    sections = [
        ("Setup", f"Random models: hidden {_SHAPE['hidden_size']}, {_SHAPE['num_hidden_layers']} layers, "
                  f"{_SHAPE['num_attention_heads']} query heads of {_SHAPE['head_dim']}, {opts.dtype}; window "
                  f"{sz['window']}; one request decoding from a {sz['prompt']}-token prompt to {sz['context']}."),
        ("Layouts", md_table(["layout", "KV heads", "kinds", "B/token measured", "B/token predicted",
                              f"MiB held at {ctx}", "MiB with one table", f"seqs in {KV_BUDGET >> 20} MiB",
                              "first step ms", "last step ms", "last predicted ms"], rows)),
        ("What it shows", _shows(results, sz)),
    ]
    summary = {"layouts": results, "sizes": sz, "kv_budget_bytes": KV_BUDGET}
    report = write_report(opts.out, "Lab: KV layouts (MHA, GQA, MQA, windowed, hybrid)", sections, [plot], summary)
    return LabResult("kv-layouts", opts.out, report, [plot], summary)
