"""Lab `latency-vs-throughput`: batching more requests raises tokens/s (they share each step's
weight read) and each request's TPOT (steps get longer, and new arrivals' prefills interrupt the
decodes). Closed loop: C clients each send a request, wait for it to finish, send the next; the
engine is driven directly with LLMEngine.add_request / step.

Metrics follow vLLM: TTFT = first token - arrival, TPOT = (E2E - TTFT) / (n_out - 1), ITL = every
gap between consecutive tokens; throughput = output tokens / wall time of the run.
"""

from __future__ import annotations

import random
import time

from servescope.labs.common import (
    LabOptions, LabResult, LabSession, blocks_for, context_line, greedy, interleaved, lab_hardware, md_table,
    median, new_figure, percentile, random_prompt, save_figure, warm_up, write_report,
)

PROMPT_LEN = 64
OUTPUT_LEN = 32
QUICK_ROUNDS = 3  # quick mode: interleaved repeats of every level, their requests pooled


def concurrencies(quick: bool) -> list:
    return [1, 4] if quick else [1, 2, 4, 8, 16, 32]


def closed_loop(engine, rng: random.Random, concurrency: int, num_requests: int, prompt_len: int,
                output_len: int) -> dict:
    """Keep `concurrency` requests in flight until `num_requests` have finished. Returns the raw run:
    the finished requests' metrics, output tokens, wall seconds and the run's StepRecords."""
    vocab = engine.model_config.vocab_size
    sent = 0
    metrics, out_tokens = [], 0
    first_step = engine.step_records[-1].step + 1 if engine.step_records else 1
    t0 = time.perf_counter()

    def send():
        nonlocal sent
        engine.add_request(f"c{concurrency}-{sent}-{time.perf_counter_ns()}",
                           random_prompt(rng, prompt_len, vocab), greedy(output_len))
        sent += 1

    for _ in range(min(concurrency, num_requests)):
        send()
    while len(metrics) < num_requests:
        for out in engine.step():
            if out.finished:
                metrics.append(out.metrics)
                out_tokens += out.metrics.num_output_tokens
                if sent < num_requests:
                    send()
        if not engine.has_unfinished() and len(metrics) < num_requests:
            raise RuntimeError("the engine stopped with requests unfinished")
    elapsed = time.perf_counter() - t0
    return {"metrics": metrics, "output_tokens": out_tokens, "seconds": elapsed,
            "records": [r for r in engine.step_records if r.step >= first_step]}


def level_stats(concurrency: int, runs: list) -> dict:
    """One level's latency percentiles over the requests of all its runs, throughput = their output
    tokens / their wall time, and what the steps held (decode batch, steps mixing a prefill in)."""
    metrics = [m for r in runs for m in r["metrics"]]
    recs = [x for r in runs for x in r["records"]]
    elapsed = sum(r["seconds"] for r in runs)
    itls = [x for m in metrics for x in m.itls]
    with_decode = [x for x in recs if x.num_decode_seqs]
    return {
        "concurrency": concurrency, "requests": len(metrics), "seconds": elapsed,
        "output_tokens_per_s": sum(r["output_tokens"] for r in runs) / elapsed,
        "ttft_p50": median([m.ttft for m in metrics]), "ttft_p99": percentile([m.ttft for m in metrics], 99),
        "tpot_p50": median([m.tpot for m in metrics]), "tpot_p99": percentile([m.tpot for m in metrics], 99),
        "itl_p50": percentile(itls, 50), "itl_p99": percentile(itls, 99),
        "steps": len(recs), "mixed_steps": sum(1 for x in recs if x.phase == "mixed"),
        "mean_decode_batch": sum(x.num_decode_seqs for x in with_decode) / max(len(with_decode), 1),
    }


def run(opts: LabOptions, session: LabSession) -> LabResult:
    levels = concurrencies(opts.quick)
    out_len = 8 if opts.quick else OUTPUT_LEN
    prompt_len = 16 if opts.quick else PROMPT_LEN
    max_c = max(levels)
    engine = session.engine(max_num_seqs=max_c, max_num_batched_tokens=1024,
                            max_model_len=prompt_len + out_len + 16,
                            num_kv_blocks=max_c * blocks_for(prompt_len + out_len, margin=1) + 8)
    hw = lab_hardware(opts, engine)
    rng = random.Random(opts.seed)
    warm_up(engine, rng)
    rounds = QUICK_ROUNDS if opts.quick else 1
    runs = interleaved(levels, rounds, lambda c, rnd: closed_loop(engine, rng, c, max(2 * c, 4), prompt_len, out_len))
    points = [level_stats(c, runs[c]) for c in levels]

    fig, (ax1, ax2) = new_figure(2)
    thr = [p["output_tokens_per_s"] for p in points]
    ax1.plot(thr, [p["tpot_p50"] * 1e3 for p in points], "o-", label="TPOT p50")
    ax1.plot(thr, [p["itl_p50"] * 1e3 for p in points], "s--", label="ITL p50")
    ax1.plot(thr, [p["itl_p99"] * 1e3 for p in points], "^:", label="ITL p99")
    for p in points:
        ax1.annotate(f"C={p['concurrency']}", (p["output_tokens_per_s"], p["tpot_p50"] * 1e3),
                     textcoords="offset points", xytext=(4, -10), fontsize=8)
    ax1.set_xlabel("throughput (output tokens / s)")
    ax1.set_ylabel("per-token latency (ms)")
    ax1.set_title("Latency vs throughput (closed loop)")
    ax1.set_ylim(bottom=0)
    ax1.legend(fontsize=8)
    ax1.grid(True, linewidth=0.3)
    ax2.plot(thr, [p["ttft_p50"] * 1e3 for p in points], "o-", label="TTFT p50")
    ax2.plot(thr, [p["ttft_p99"] * 1e3 for p in points], "^:", label="TTFT p99")
    ax2.set_xlabel("throughput (output tokens / s)")
    ax2.set_ylabel("TTFT (ms)")
    ax2.set_title("Time to first token vs throughput")
    ax2.set_ylim(bottom=0)
    ax2.legend(fontsize=8)
    ax2.grid(True, linewidth=0.3)
    plot = save_figure(fig, opts.out / "latency_vs_throughput.png")

    rows = [[p["concurrency"], p["requests"], p["output_tokens_per_s"], p["ttft_p50"] * 1e3, p["ttft_p99"] * 1e3,
             p["tpot_p50"] * 1e3, p["tpot_p99"] * 1e3, p["itl_p50"] * 1e3, p["itl_p99"] * 1e3,
             p["mean_decode_batch"], p["mixed_steps"]] for p in points]
    first, last = points[0], points[-1]
    summary = {"points": points, "prompt_len": prompt_len, "output_len": out_len}
    sections = [
        ("Setup", context_line(opts, engine, hw) + f"\n\nClosed loop: C clients, each request a {prompt_len}-token "
         f"random prompt and {out_len} greedy output tokens, 2·C requests per level (at least 4)"
         + (f", in each of {rounds} interleaved rounds" if rounds > 1 else "") + "; chunked "
         "prefill with a 1024-token step budget."),
        ("Results", md_table(["C", "requests", "output tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms",
                              "TPOT p99 ms", "ITL p50 ms", "ITL p99 ms", "mean decode batch",
                              "steps mixing a prefill"], rows)),
        ("What it shows",
         f"From C = {first['concurrency']} to C = {last['concurrency']} throughput goes from "
         f"{first['output_tokens_per_s']:.1f} to {last['output_tokens_per_s']:.1f} tokens/s "
         f"(x{last['output_tokens_per_s'] / first['output_tokens_per_s']:.1f}) while TPOT p50 goes from "
         f"{first['tpot_p50'] * 1e3:.0f} to {last['tpot_p50'] * 1e3:.0f} ms "
         f"(x{last['tpot_p50'] / first['tpot_p50']:.1f}). While decode is memory-bound, a larger batch costs "
         "little latency per token; past the critical batch every extra request lengthens every step, and "
         "prefills of newly admitted requests land between decode steps (the ITL p99 tail)."),
    ]
    report = write_report(opts.out, "Lab: latency vs throughput", sections, [plot], summary)
    return LabResult("latency-vs-throughput", opts.out, report, [plot], summary)
