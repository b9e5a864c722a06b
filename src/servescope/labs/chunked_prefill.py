"""Lab `chunked-prefill`: a long prompt prefilled in one step stalls every running decode for the
whole prefill (one huge inter-token gap); chunked prefill splits it into steps of at most
max_num_batched_tokens tokens, each carrying the running decodes too, so their ITL is bounded by
one chunk's time, at the cost of a later first token for the long prompt.
"""

from __future__ import annotations

import random
import time

from servescope.labs.common import (
    LabOptions, LabResult, LabSession, blocks_for, context_line, greedy, interleaved, lab_hardware, md_table,
    median, new_figure, percentile, random_prompt, save_figure, warm_up, write_report,
)

NUM_DECODES = 4
DECODE_PROMPT = 32
CHUNK = 256


QUICK_CHUNK = 64
QUICK_ROUNDS = 3  # quick mode: interleaved repeats of both configs (the median worst gap is reported)


def sizes(quick: bool) -> tuple:
    """(long prompt tokens, decode output tokens, decode tokens before the long prompt arrives). Quick:
    a prompt long enough that its prefill costs a tiny model many decode steps, and decodes that run
    through all of its chunks."""
    return (512, 24, 4) if quick else (2048, 48, 8)


def stall_window(itl_times: list, itls: list, start: float, end: float) -> list:
    """ITLs whose gap overlaps [start, end] (the long prompt's queue + prefill)."""
    return [g for t, g in zip(itl_times, itls) if t >= start and t - g <= end]


def run_scenario(engine, rng: random.Random, long_len: int, out_len: int, lead: int, chunk: int) -> dict:
    vocab = engine.model_config.vocab_size
    tag = time.perf_counter_ns()
    dec_ids = [f"dec{i}-{tag}" for i in range(NUM_DECODES)]
    for rid in dec_ids:
        engine.add_request(rid, random_prompt(rng, DECODE_PROMPT, vocab), greedy(out_len))
    first_step = engine.step_records[-1].step + 1 if engine.step_records else 1
    final, produced = {}, 0
    while produced < lead:  # let the decodes get going
        for out in engine.step():
            if out.request_id == dec_ids[0]:
                produced = len(out.outputs[0].token_ids)
    long_id = f"long-{tag}"
    arrival = time.perf_counter()
    engine.add_request(long_id, random_prompt(rng, long_len, vocab), greedy(2))
    while len(final) < NUM_DECODES + 1:
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    recs = [r for r in engine.step_records if r.step >= first_step]
    lm = final[long_id].metrics
    first_token = lm.token_times[0]
    itl_t, itl = [], []
    for rid in dec_ids:
        tt = final[rid].metrics.token_times
        itl_t += tt[1:]
        itl += [b - a for a, b in zip(tt, tt[1:])]
    stalled = stall_window(itl_t, itl, arrival, first_token)
    before = [g for t, g in zip(itl_t, itl) if t < arrival]
    prefill_steps = [r for r in recs if r.num_prefill_tokens and r.start_time >= arrival - 1e-9]
    return {
        "chunk": chunk, "arrival": arrival, "long_ttft_s": lm.ttft,
        "itl_times": [t - arrival for t in itl_t], "itls": itl,
        "itl_max_s": max(itl), "itl_p50_before_s": median(before), "itl_p99_s": percentile(itl, 99),
        "stalled_itls_s": stalled, "stall_max_s": max(stalled) if stalled else float("nan"),
        "prefill_steps": len(prefill_steps),
        "steps": [{"t": r.start_time - arrival, "wall_s": r.wall_seconds, "predicted_s": r.predicted_seconds,
                   "prefill_tokens": r.num_prefill_tokens, "decode_tokens": r.num_decode_tokens} for r in recs],
    }


def configs(quick: bool, max_len: int) -> tuple:
    """(label, engine settings) of the two runs; the budget of the chunked one is its chunk."""
    chunk = QUICK_CHUNK if quick else CHUNK
    return (("no chunking", {"enable_chunked_prefill": False, "max_num_batched_tokens": max_len}),
            (f"chunked ({chunk} tokens/step)", {"enable_chunked_prefill": True, "max_num_batched_tokens": chunk}))


def measure(opts: LabOptions, session: LabSession) -> tuple:
    """(an engine, {label: the first round's scenario, plus the worst stall of every round and their
    median}); both configs see the same prompts (one seed each)."""
    long_len, out_len, lead = sizes(opts.quick)
    max_len = long_len + 32
    engines, rngs = {}, {}
    for label, extra in configs(opts.quick, max_len):
        engines[label] = session.engine(max_num_seqs=NUM_DECODES + 2, max_model_len=max_len,
                                        num_kv_blocks=blocks_for(max_len) + NUM_DECODES * blocks_for(
                                            DECODE_PROMPT + out_len) + 8, **extra)
        rngs[label] = random.Random(opts.seed)
        warm_up(engines[label], rngs[label])
    chunk_of = {label: extra["max_num_batched_tokens"] if extra["enable_chunked_prefill"] else None
                for label, extra in configs(opts.quick, max_len)}

    def scenario(label, rnd):
        return run_scenario(engines[label], rngs[label], long_len, out_len, lead, chunk_of[label])

    runs = interleaved(list(engines), QUICK_ROUNDS if opts.quick else 1, scenario)
    results = {label: {**rr[0], "stall_max_rounds_s": [r["stall_max_s"] for r in rr],
                       "stall_max_median_s": median([r["stall_max_s"] for r in rr])} for label, rr in runs.items()}
    return engines[list(engines)[-1]], results


def run(opts: LabOptions, session: LabSession) -> LabResult:
    long_len, out_len, lead = sizes(opts.quick)
    chunk = QUICK_CHUNK if opts.quick else CHUNK
    engine, results = measure(opts, session)
    hw = lab_hardware(opts, engine)
    fig, (ax1, ax2) = new_figure(2)
    for (label, r), color in zip(results.items(), ("tab:red", "tab:blue")):
        order = sorted(range(len(r["itls"])), key=lambda i: r["itl_times"][i])
        ax1.plot([r["itl_times"][i] for i in order], [r["itls"][i] * 1e3 for i in order], ".", color=color,
                 label=f"{label}: ITL of running decodes")
        ax1.axvline(r["long_ttft_s"], color=color, linestyle=":", label=f"{label}: long prompt's first token")
        st = r["steps"]
        ax2.step([s["t"] for s in st], [s["predicted_s"] * 1e3 for s in st], where="post", color=color,
                 linestyle="--", label=f"{label}: predicted step")
        ax2.plot([s["t"] for s in st], [s["wall_s"] * 1e3 for s in st], "o", color=color, markersize=3,
                 label=f"{label}: measured step")
    ax1.set_xlabel("time since the long prompt arrived (s)")
    ax1.set_ylabel("inter-token latency (ms)")
    ax1.set_yscale("log")
    ax1.set_title(f"Decodes' ITL when a {long_len}-token prompt arrives")
    ax1.legend(fontsize=7)
    ax1.grid(True, which="both", linewidth=0.3)
    ax2.set_xlabel("time since the long prompt arrived (s)")
    ax2.set_ylabel("step time (ms)")
    ax2.set_yscale("log")
    ax2.set_title("Step times: measured vs roofline")
    ax2.legend(fontsize=7)
    ax2.grid(True, which="both", linewidth=0.3)
    plot = save_figure(fig, opts.out / "chunked_prefill.png")

    rows = [[label, r["prefill_steps"], r["itl_p50_before_s"] * 1e3, r["stall_max_median_s"] * 1e3,
             r["itl_p99_s"] * 1e3, r["long_ttft_s"] * 1e3] for label, r in results.items()]
    (l0, r0), (l1, r1) = results.items()
    summary = {label: {k: v for k, v in r.items()} for label, r in results.items()}
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\n{NUM_DECODES} requests decode ({DECODE_PROMPT}-token "
         f"prompts, {out_len} greedy tokens); after {lead} tokens a {long_len}-token prompt arrives. Run twice: "
         f"without chunked prefill (the whole prompt in one step) and with chunks of {chunk} tokens per step "
         "(decodes first, the prompt fills the rest of the budget)"
         + (f"; {QUICK_ROUNDS} interleaved rounds, the worst gap is their median, the rest from the first."
            if opts.quick else ".")),
        ("Results", md_table(["config", "steps with prefill", "ITL p50 before ms", "worst ITL during prefill ms",
                              "ITL p99 ms", "long prompt TTFT ms"], rows)),
        ("What it shows",
         f"Without chunking the running decodes wait {r0['stall_max_median_s'] * 1e3:.0f} ms for one token (the "
         f"whole prefill), x{r0['stall_max_median_s'] / r0['itl_p50_before_s']:.0f} their normal ITL. With "
         f"{chunk}-token chunks the worst gap is {r1['stall_max_median_s'] * 1e3:.0f} ms, spread over "
         f"{r1['prefill_steps']} steps that each "
         f"also produce a decode token; the long prompt's TTFT moves from {r0['long_ttft_s'] * 1e3:.0f} to "
         f"{r1['long_ttft_s'] * 1e3:.0f} ms (chunks re-read the weights and per-step overhead repeats)."),
    ]
    report = write_report(opts.out, "Lab: chunked prefill bounds the decode stall", sections, [plot], summary)
    return LabResult("chunked-prefill", opts.out, report, [plot], summary)
