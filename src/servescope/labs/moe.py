"""Lab `moe`: a mixture-of-experts decode step reads the experts its tokens chose, so its bytes grow with
the batch until every expert is read, where a dense model of the same active parameters reads the same
weights whatever the batch.

Two tiny random models with equal attention and equal active parameters per token: a dense Qwen3 with an
MLP of width k * I, and a Qwen3-MoE with E experts of width I, k per token. Measured (the engine's
StepRecords): the median decode step time at each batch, the distinct experts each sparse layer read and
the routed experts' bytes. Predicted: the cost model with the measured routing (what each StepRecord
carries) and with uniform routing, where a step of B tokens reads E(1 - (1 - k/E)^B) experts per layer
(analysis/moe.py).
"""

from __future__ import annotations

import dataclasses
import json

from servescope.analysis.moe import expected_distinct_experts
from servescope.labs.common import (
    decode_sweep, LabOptions, LabResult, LabSession, context_line, lab_hardware, md_table, median,
    new_figure, rel_error, save_figure, seqs_of, write_report,
)

PROMPT_LEN = 16
DECODE_STEPS = 8
QUICK_ROUNDS = 2
EXPERTS, TOP_K, WIDTH = 32, 4, 256
_BASE = {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 64, "vocab_size": 1024, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
         "rope_theta": 10000.0, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}
MODELS = {
    "dense": {**_BASE, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
              "intermediate_size": TOP_K * WIDTH},
    "moe": {**_BASE, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "intermediate_size": TOP_K * WIDTH, "moe_intermediate_size": WIDTH, "num_experts": EXPERTS,
            "num_experts_per_tok": TOP_K, "norm_topk_prob": True},
}


def batch_sizes(quick: bool) -> list:
    return [1, 2, 4, 8, 16, 32] if quick else [1, 2, 4, 8, 16, 32, 64]


def measure(opts: LabOptions, kind: str) -> tuple:
    """(engine, {batch: decode StepRecords where all `batch` sequences decode}) of the `kind` model."""
    path = opts.out / f"{kind}-config.json"
    path.write_text(json.dumps(MODELS[kind]))
    session = LabSession(dataclasses.replace(opts, model=f"random:{path}"))
    return decode_sweep(session, batch_sizes(opts.quick), QUICK_ROUNDS if opts.quick else 1, opts.seed,
                        PROMPT_LEN, DECODE_STEPS, 512, prefix=kind)


def _uniform_prediction(engine, rec) -> tuple:
    """(seconds, bytes) the cost model predicts for the step under uniform routing."""
    cost = engine.step_cost_predictor.predictor.predict(seqs_of(rec), rec.num_decode_seqs)
    return cost.seconds, cost.cost.bytes


def summarise(engine, by_b: dict) -> dict:
    """Per batch: medians of the measured and predicted step, bytes, and for a MoE the routing."""
    out = {k: [] for k in ("measured_step_s", "predicted_step_s", "predicted_bytes", "uniform_step_s",
                           "uniform_bytes", "distinct_measured", "distinct_predicted", "expert_bytes",
                           "imbalance")}
    for b, recs in by_b.items():
        out["measured_step_s"].append(median([r.wall_seconds for r in recs]))
        out["predicted_step_s"].append(median([r.predicted_seconds for r in recs]))
        out["predicted_bytes"].append(median([r.bytes for r in recs]))
        uniform = [_uniform_prediction(engine, r) for r in recs]
        out["uniform_step_s"].append(median([u[0] for u in uniform]))
        out["uniform_bytes"].append(median([u[1] for u in uniform]))
        if engine.model_config.moe is not None:
            # mean over the layers and steps (the expectation is per layer)
            per_layer = [n for r in recs for n in r.moe_experts_active]
            out["distinct_measured"].append(sum(per_layer) / len(per_layer))
            out["distinct_predicted"].append(expected_distinct_experts(EXPERTS, TOP_K, b))
            out["expert_bytes"].append(median([r.moe_expert_bytes for r in recs]))
            out["imbalance"].append(median([r.moe_imbalance for r in recs]))
    return out


def _plot(opts: LabOptions, sizes: list, dense: dict, moe: dict):
    fig, (ax1, ax2, ax3) = new_figure(3, size=(6.0 * 3, 4.2))
    ax1.plot(sizes, [m * 1e3 for m in dense["measured_step_s"]], "o-", label="dense: measured")
    ax1.plot(sizes, [p * 1e3 for p in dense["predicted_step_s"]], "s--", label="dense: predicted")
    ax1.plot(sizes, [m * 1e3 for m in moe["measured_step_s"]], "o-", label="MoE: measured")
    ax1.plot(sizes, [p * 1e3 for p in moe["predicted_step_s"]], "s--",
             label="MoE: predicted (measured routing)")
    ax1.plot(sizes, [p * 1e3 for p in moe["uniform_step_s"]], "^:", label="MoE: predicted (uniform routing)")
    ax1.set_ylabel("decode step time (ms)")
    ax1.set_title("Decode step time vs batch (equal active parameters)")
    ax2.plot(sizes, [x / 2**20 for x in dense["predicted_bytes"]], "s--", label="dense")
    ax2.plot(sizes, [x / 2**20 for x in moe["predicted_bytes"]], "o-", label="MoE (measured routing)")
    ax2.plot(sizes, [x / 2**20 for x in moe["uniform_bytes"]], "^:", label="MoE (uniform routing)")
    ax2.set_ylabel("bytes read per step (MiB)")
    ax2.set_title("Bytes per decode step vs batch")
    ax3.plot(sizes, moe["distinct_measured"], "o-", label="measured (mean over layers and steps)")
    ax3.plot(sizes, moe["distinct_predicted"], "s--", label=f"E(1 - (1 - k/E)^B), E={EXPERTS}, k={TOP_K}")
    ax3.axhline(EXPERTS, color="gray", linestyle=":", label="all experts")
    ax3.set_ylabel("distinct experts read per layer")
    ax3.set_title("Experts read vs batch")
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("decode batch size (sequences)")
        ax.set_ylim(bottom=0)
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, opts.out / "moe.png")


def run(opts: LabOptions, session: LabSession) -> LabResult:
    opts.out.mkdir(parents=True, exist_ok=True)
    dense_engine, dense_by_b = measure(opts, "dense")
    engine, moe_by_b = measure(opts, "moe")
    sizes = list(moe_by_b)
    dense, moe = summarise(dense_engine, dense_by_b), summarise(engine, moe_by_b)
    hw = lab_hardware(opts, engine)
    plot = _plot(opts, sizes, dense, moe)
    errors = [rel_error(p, m) for p, m in zip(moe["distinct_predicted"], moe["distinct_measured"])]
    table = [[b, dense["measured_step_s"][i] * 1e3, dense["predicted_step_s"][i] * 1e3,
              moe["measured_step_s"][i] * 1e3, moe["predicted_step_s"][i] * 1e3,
              moe["uniform_step_s"][i] * 1e3,
              moe["distinct_measured"][i], moe["distinct_predicted"][i], 100 * errors[i],
              moe["expert_bytes"][i] / 2**20, moe["imbalance"][i]] for i, b in enumerate(sizes)]
    summary = {"batch_sizes": sizes, "dense": dense, "moe": moe, "distinct_rel_errors": errors,
               "max_distinct_rel_error": max(abs(e) for e in errors), "experts": EXPERTS, "top_k": TOP_K,
               "dense_weight_bytes": dense_engine.weight_bytes, "moe_weight_bytes": engine.weight_bytes}
    grow = moe["expert_bytes"][-1] / moe["expert_bytes"][0]
    sections = [
        ("Setup", context_line(opts, engine, hw) + "\n\nTwo random models, 4 layers, width 256, equal "
         f"attention: dense (MLP width {TOP_K * WIDTH}) and MoE ({EXPERTS} experts of width {WIDTH}, "
         f"{TOP_K} per token: the same active parameters). Each batch: {PROMPT_LEN}-token random prompts, "
         f"{DECODE_STEPS + 1} greedy tokens; medians of the steps where all sequences decode."),
        ("Results", md_table(["batch", "dense ms", "dense pred ms", "MoE ms", "MoE pred ms (routing)",
                              "MoE pred ms (uniform)", "experts read / layer", "E(1-(1-k/E)^B)", "error %",
                              "expert MiB / step", "imbalance max/mean"], table)),
        ("What it shows",
         f"At batch 1 each sparse layer reads {TOP_K} of its {EXPERTS} experts; as the batch grows the "
         f"tokens choose different experts and a step reads x{grow:.1f} the expert bytes at batch "
         f"{sizes[-1]}, "
         f"while the dense model reads its weights once whatever the batch. The distinct experts read follow "
         f"E(1 - (1 - k/E)^B) within {100 * summary['max_distinct_rel_error']:.1f}% (random weights route "
         "nearly uniformly; a trained router's skew reads fewer). The step time of the MoE rises with the "
         "batch where the dense one stays flat: more bytes, and one pass per active expert."),
    ]
    report = write_report(opts.out, "Lab: moe (experts read vs batch)", sections, [plot], summary)
    return LabResult("moe", opts.out, report, [plot], summary)
