"""Lab `parallelism`: what tensor and pipeline parallelism do to a step, measured here beside
predicted, and predicted for a 70B model on 8 GPUs.

Measured: the median decode step (batch 1 and 8) and one prefill step of 128 tokens at each layout
the model allows among TP x PP = 1x1, 2x1, 1x2 (two gloo processes, one thread each; one process
with one thread is the baseline), PP=2 both without micro-batches (the stages one after another) and
with 2 (the stages overlapping), and the StepRecords' split of rank 0's time into compute and
collectives. Predicted: the StepRecords' own prediction (the shard's roofline + the collectives on
the local gloo link, measured by the link probe; at P > 1 the pipeline schedule).
Predicted only: Llama-3-70B decode and prefill step time vs TP = 1..8 on H100-SXM and H200 (NVLink 4)
and on PCIe 5, and vs PP = 2..8 with one micro-batch and with 2P.
"""

from __future__ import annotations

import random

from servescope.analysis.collectives import LINKS
from servescope.analysis.hardware import get_hardware
from servescope.analysis.parallel_explain import explain_parallel
from servescope.analysis.presets import load_preset
from servescope.config import EngineConfig
from servescope.measure.local_hardware import local_gloo_link, measured_engine
from servescope.errors import EngineConfigError
from servescope.labs.common import (
    LabOptions, LabResult, LabSession, context_line, lab_hardware, md_table, median, new_figure, random_prompt,
    run_to_completion, save_figure, warm_up, write_report,
)
from servescope.parallel.launcher import stop_parked

LAYOUTS = [(1, 1, 0), (2, 1, 0), (1, 2, 1), (1, 2, 2)]  # TP, PP, pipeline micro-batches
PROMPT_LEN, DECODE_STEPS = 128, 8


def _engine(opts: LabOptions, tp: int, pp: int, micro: int = 0):
    try:
        return measured_engine(EngineConfig(
            model=opts.model, dtype=opts.dtype, num_threads=1, hardware=opts.hardware, seed=opts.seed,
            skip_tokenizer_init=True, enable_prefix_caching=False, num_kv_blocks=128,
            max_model_len=PROMPT_LEN + DECODE_STEPS + 16, max_num_batched_tokens=1024,
            tensor_parallel_size=tp, pipeline_parallel_size=pp, pipeline_micro_batches=micro))
    except EngineConfigError as e:  # this model does not split this way (heads, layers, cores)
        return str(e)


def _measure(engine, rng: random.Random, rounds: int) -> dict:
    vocab = engine.model_config.vocab_size
    out = {"prefill": [], "decode-1": [], "decode-8": []}
    for rnd in range(rounds):
        for b in (1, 8):
            _, recs = run_to_completion(engine, [random_prompt(rng, PROMPT_LEN, vocab) for _ in range(b)],
                                        DECODE_STEPS + 1, f"b{b}r{rnd}-")
            out[f"decode-{b}"] += [r for r in recs if r.phase == "decode" and r.num_decode_seqs == b]
            if b == 1:
                out["prefill"] += [r for r in recs if r.phase == "prefill"]
    return out


def _label(layout: tuple) -> str:
    tp, pp, micro = layout
    return f"{tp}x{pp}" + (f" ({micro} micro-batch{'es' if micro > 1 else ''})" if pp > 1 else "")


def _row(name: str, layout: tuple, recs: list) -> list:
    m = median([r.wall_seconds for r in recs])
    comm = median([r.comm_seconds for r in recs])
    pred = median([r.predicted_seconds for r in recs])
    pc = [r.predicted_comm_seconds for r in recs if r.predicted_comm_seconds is not None]
    return [_label(layout), name, len(recs), m * 1e3, comm * 1e3, (m - comm) * 1e3, pred * 1e3,
            median(pc) * 1e3 if pc else None]


def predicted_70b(batch: int) -> dict:
    """{(hardware, link): {tp: (decode ms, prefill ms)}} for Llama-3-70B, bf16."""
    cfg = load_preset("llama-3-70b")
    out = {}
    for hw_name, link in (("H100-SXM", "nvlink4"), ("H200", "nvlink4"), ("H100-SXM", "pcie5")):
        hw = get_hardware(hw_name)
        out[(hw_name, link)] = {}
        for tp in (1, 2, 4, 8):
            r = explain_parallel(cfg, hw, LINKS[link], tp, 1, batch=batch, prompt_len=1024, output_len=128)
            out[(hw_name, link)][tp] = tuple(p["step_seconds"] * 1e3 for p in r["phases"][::-1])
    return out


def predicted_70b_pipeline(batch: int) -> list:
    """[(PP, micro-batches, decode ms, prefill ms)] for Llama-3-70B bf16 on H100-SXM over NVLink 4."""
    cfg, hw, rows = load_preset("llama-3-70b"), get_hardware("H100-SXM"), []
    for pp in (2, 4, 8):
        for micro in (1, 2 * pp):
            r = explain_parallel(cfg, hw, LINKS["nvlink4"], 1, pp, batch=batch, prompt_len=1024, output_len=128,
                                 micro_batches=micro)
            rows.append((pp, micro, *(p["step_seconds"] * 1e3 for p in r["phases"][::-1])))
    return rows


def run(opts: LabOptions, session: LabSession) -> LabResult:
    rng = random.Random(opts.seed)
    link = local_gloo_link(measure=True)  # so that the StepRecords predict the collectives too
    rows, skipped, measured, comm_share = [], [], {}, {}
    for tp, pp, micro in LAYOUTS:
        engine = _engine(opts, tp, pp, micro)
        if isinstance(engine, str):
            skipped.append(f"TP={tp} x PP={pp}: {engine}")
            continue
        try:
            warm_up(engine, rng)
            by_phase = _measure(engine, rng, 1 if opts.quick else 3)
            hw = lab_hardware(opts, engine)
            context = context_line(opts, engine, hw)
        finally:
            engine.shutdown(keep_workers=True)  # the next layout of two ranks reuses the processes
        measured[(tp, pp, micro)] = {k: median([r.wall_seconds for r in v]) for k, v in by_phase.items()}
        comm_share[_label((tp, pp, micro))] = {k: sum(r.comm_seconds for r in v) / sum(r.wall_seconds for r in v)
                                    for k, v in by_phase.items()}
        rows += [_row(name, (tp, pp, micro), recs) for name, recs in by_phase.items()]
    stop_parked()
    curves = {b: predicted_70b(b) for b in (1, 16)}
    fig, (ax1, ax2) = new_figure(2)
    for (hw_name, link_name), by_tp in curves[16].items():
        tps = list(by_tp)
        ax1.plot(tps, [by_tp[t][0] for t in tps], "o-", label=f"{hw_name} / {link_name}")
        ax2.plot(tps, [by_tp[t][1] for t in tps], "o-", label=f"{hw_name} / {link_name}")
    for ax, what in ((ax1, "decode step, batch 16"), (ax2, "prefill step, 16 x 1024 tokens")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tensor-parallel size")
        ax.set_ylabel("predicted ms")
        ax.set_title(f"Llama-3-70B bf16: {what}")
        ax.grid(True, linewidth=0.3)
        ax.legend(fontsize=8)
    plot = save_figure(fig, opts.out / "parallelism.png")
    pred_rows = [[f"{hw} / {link}", b, tp, d, p] for b, c in curves.items() for (hw, link), by_tp in c.items()
                 for tp, (d, p) in by_tp.items()]
    pipe_rows = [list(r) for r in predicted_70b_pipeline(16)]
    summary = {"measured_step_s": {_label(k): v for k, v in measured.items()}, "skipped": skipped,
               "comm_share": comm_share,
               "local_link": {"bandwidth": link.bandwidth, "latency_s": link.latency_s, "call_s": link.call_s,
                              "step_s": link.step_s, "max_segment_bytes": link.max_segment_bytes},
               "llama_3_70b_pipeline_predicted_ms": {f"pp{r[0]} mb{r[1]}": r[2:] for r in pipe_rows},
               "llama_3_70b_predicted_ms": {f"b{b} {hw}/{link} tp{tp}": v for b, c in curves.items()
                                            for (hw, link), by_tp in c.items() for tp, v in by_tp.items()}}
    sections = [
        ("Setup", (context if measured else "") + f"\n\nEach layout: {PROMPT_LEN}-token random prompts, "
         f"batch 1 and 8, {DECODE_STEPS + 1} output tokens, one thread per process (the 1x1 baseline is one "
         f"process with one thread). Local link (fitted to the probe's all-reduce times): {link.describe()}."
         + ("\n\nNot run: " + "; ".join(skipped) if skipped else "")),
        ("Measured here (gloo) beside predicted", md_table(
            ["TP x PP", "step", "steps", "measured ms", "in collectives ms", "compute ms", "predicted ms",
             "predicted collectives ms"], rows)),
        ("Predicted: Llama-3-70B on 8 GPUs", md_table(
            ["hardware / link", "batch", "TP", "decode step ms", "prefill step ms"], pred_rows)),
        ("Predicted: Llama-3-70B pipelines on H100-SXM / NVLink 4, batch 16", md_table(
            ["PP", "micro-batches", "decode step ms", "prefill step ms"], pipe_rows)),
        ("What it shows",
         "On a CPU, two gloo processes pay each all-reduce through the kernel's loopback (tens of "
         "microseconds to milliseconds per call, 2 per layer): for a small model the collectives are "
         "most of the step, so TP=2 does not speed decode up here. PP=2 with one micro-batch runs the "
         "stages one after the other, so it buys memory, not time (rank 0's time in collectives at PP=2 "
         "includes waiting for the second stage's compute); cut into micro-batches, the second stage "
         "computes one while the first computes the next, which pays for compute-bound steps (prefill) "
         "and not for a memory-bound decode (each micro-batch reads the stage's weights again). On 8 "
         "GPUs with NVLink the prediction is the other way round: a 70B decode step reads 140 GB of "
         "weights, TP=8 divides that by 8 and the all-reduces (latency-bound at these sizes) cost a "
         "fraction of it; over PCIe the link's share is several times larger."),
    ]
    report = write_report(opts.out, "Lab: parallelism (tensor and pipeline parallel)", sections, [plot], summary)
    return LabResult("parallelism", opts.out, report, [plot], summary)
