"""`servescope bench throughput` and `servescope bench latency`: parse, call servescope.bench, render.

servescope.bench (and with it the engine, torch and transformers) is imported when a benchmark runs:
it is seconds of `servescope --help` (see cli/bench.py).
"""

from __future__ import annotations

from servescope.cli.args import engine_config_from_args
from servescope.cli.output import console, error, fmt, write_json


def _table(title: str, columns: tuple):
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    t = Table(title=title, box=None, pad_edge=False)
    for col in columns:
        t.add_column(col, justify="left" if col in ("engine", "phase") else "right")
    return t


def _baseline_dtype(args, engine) -> str:
    """The transformers baseline's dtype: --baseline-dtype, else the one --dtype resolved to."""
    return args.baseline_dtype or str(engine.dtype).replace("torch.", "")


def _print_skip(con):
    return lambda name, why: con.print(f"[yellow]baseline {name} skipped:[/yellow] {why}")


# ------------------------------------------------------------------------------------ throughput

def run_throughput(args) -> int:
    from servescope.bench import comparison  # lazy: the engine and torch (module doc)
    from servescope.bench.offline import Workload, run_engine_throughput, warm_up_engine, write_trace

    con = console(highlight=False)
    try:
        wl = Workload(args.num_prompts, args.input_len, args.output_len, args.seed)
    except ValueError as e:
        return error(str(e))
    cfg = engine_config_from_args(args)
    llm = comparison.build_llm(cfg)
    vocab = llm.engine.model_config.vocab_size
    reqs = wl.requests(vocab)
    too_long = [r for r in reqs if r.prompt_len + r.output_len > llm.engine.max_model_len]
    if too_long:
        return error(f"{len(too_long)} requests exceed the model's context ({llm.engine.max_model_len} tokens); "
                     f"use shorter --input-len/--output-len")
    desc = wl.describe()
    con.print(f"workload: {wl.num_prompts} requests, input {desc['input_len']}, output {desc['output_len']}, "
              f"seed {wl.seed}; {sum(r.prompt_len for r in reqs)} prompt + "
              f"{sum(r.output_len for r in reqs)} output tokens")
    if not args.no_warmup:
        warm_up_engine(llm, vocab)
    ours = run_engine_throughput(llm, reqs, progress=not args.no_progress)
    if args.trace:
        why = write_trace(args.trace, ours["_steps"], ours["_outputs"])
        con.print(f"[yellow]trace not written:[/yellow] {why}" if why else f"trace written to {args.trace}")

    base_dtype = _baseline_dtype(args, llm.engine)

    def on_start(name: str) -> None:
        if name == "hf":
            con.print(f"baseline hf: transformers generate, padded batches of {args.hf_batch_size}, {base_dtype}")

    results = {"servescope": ours, **comparison.run_throughput_baselines(
        args.baseline, reqs, model=args.model, dtype=base_dtype, vocab_size=vocab,
        hf_batch_size=args.hf_batch_size, warmup=not args.no_warmup, progress=not args.no_progress,
        on_start=on_start, on_skip=_print_skip(con))}
    ratios = comparison.throughput_ratios(results)
    _print_throughput(con, results, ratios)
    if args.json:
        write_json(args.json, comparison.benchmark_document("throughput", llm, cfg, results, ratios, workload=desc))
        con.print(f"results written to {args.json}")
    return 0


def _print_throughput(con, results: dict, ratios: dict) -> None:
    table = _table("offline throughput",
                   ("engine", "req/s", "output tok/s", "total tok/s", "wall s", "peak KV", "preempt"))
    for name, r in results.items():
        if "skipped" in r:
            continue
        table.add_row(name, fmt(r["requests_per_s"], digits=2), fmt(r["output_tokens_per_s"]),
                      fmt(r["total_tokens_per_s"]), fmt(r["wall_seconds"], digits=1),
                      fmt(r.get("peak_kv_usage"), 100, 0, "%") if "peak_kv_usage" in r else "-",
                      str(r.get("preemptions", "-")))
    con.print(table)
    for k, v in ratios.items():
        con.print(f"servescope / {k.rsplit('_vs_', 1)[1]} output tokens/s: [bold]{v:.2f}x[/bold]")
    hf = results.get("hf", {})
    if "generated_tokens" in hf:
        con.print(f"(hf generated {hf['generated_tokens']} tokens in padded batches; only the "
                  f"{hf['output_tokens']} requested ones count)")


# --------------------------------------------------------------------------------------- latency

def run_latency(args) -> int:
    from servescope.analysis.bandwidth import bandwidth_origin  # lazy: as the engine's imports below
    from servescope.bench import comparison  # lazy: the engine and torch (module doc)
    from servescope.bench.latency import run_engine_latency
    from servescope.measure.local_hardware import hardware_for_device  # lazy: torch

    con = console(highlight=False)
    cfg = engine_config_from_args(args)
    llm = comparison.build_llm(cfg)
    e = llm.engine
    if args.input_len + args.output_len > e.max_model_len:
        return error(f"input {args.input_len} + output {args.output_len} tokens exceed the model's context "
                     f"({e.max_model_len})")
    # the spec the engine's step predictions use (resolving it again would take a second spot check)
    hw = e.hardware or hardware_for_device(e.device, args.hardware)
    dtype = str(e.dtype).replace("torch.", "")
    origin = bandwidth_origin(hw)
    con.print(f"latency: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
              f"{dtype}, {args.iters} iterations; roofline: {hw.name} "
              f"({hw.memory_bandwidth / 1e9:.1f} GB/s, {hw.flops(dtype) / 1e9:.0f} GFLOP/s {dtype})"
              + (f"; bandwidth {origin}" if origin else ""))
    ours = run_engine_latency(
        llm, args.batch_size, args.input_len, args.output_len, iters=args.iters, warmup=not args.no_warmup,
        seed=args.seed, hardware=hw, dtype=dtype,
        on_iteration=lambda i, r: con.print(
            f"  iter {i + 1}/{args.iters}: wall {r['wall_seconds']:.2f} s, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
            f"TPOT {fmt(r['tpot_s'], 1e3, 1)} ms"))
    results = {"servescope": ours, **comparison.run_latency_baselines(
        args.baseline, model=args.model, dtype=_baseline_dtype(args, e), batch_size=args.batch_size,
        input_len=args.input_len,
        output_len=args.output_len, vocab_size=e.model_config.vocab_size, iters=args.iters, seed=args.seed,
        warmup=not args.no_warmup, on_skip=_print_skip(con))}
    ratios = comparison.latency_ratios(results)
    _print_latency(con, results, ratios)
    if args.json:
        shape = {"batch_size": args.batch_size, "input_len": args.input_len, "output_len": args.output_len,
                 "iters": args.iters, "seed": args.seed}
        write_json(args.json, comparison.benchmark_document("latency", llm, cfg, results, ratios, shape=shape))
        con.print(f"results written to {args.json}")
    return 0


def _print_latency(con, results: dict, ratios: dict) -> None:
    t = _table("per-request latency (medians)", ("engine", "TTFT ms", "TPOT ms", "E2E s", "decode tok/s"))
    for name, r in results.items():
        if "skipped" in r:
            continue
        t.add_row(name, fmt(r["ttft_s"], 1e3), fmt(r["tpot_s"], 1e3, 2), fmt(r["e2e_s"], 1, 2),
                  fmt(r["decode_tokens_per_s"]))
    con.print(t)
    ours = results["servescope"]
    con.print(_phase_table(ours["phases"]))
    _print_bandwidth(con, ours)
    for k, v in ratios.items():
        what, name = k.rsplit("_vs_", 1)
        label = "decode tokens/s" if what.startswith("decode") else "TTFT"
        con.print(f"servescope / {name} {label}: [bold]{v:.2f}x[/bold]"
                  + (" (lower is better)" if label == "TTFT" else ""))


def _phase_table(phases: dict):
    p = _table("servescope steps by phase (time-weighted rates)",
               ("phase", "steps", "median step ms", "tok/s", "GB/s", "% BW", "% BW now", "GFLOP/s", "% peak",
                "bound", "pred/meas"))
    for phase, d in phases.items():
        p.add_row(phase, str(d["num_steps"]), fmt(d["median_step_seconds"], 1e3, 2), fmt(d["tokens_per_s"]),
                  fmt(d.get("achieved_bytes_per_s"), 1e-9, 1), fmt(d.get("pct_of_bandwidth"), 1, 0, "%"),
                  fmt(d.get("pct_of_session_bandwidth"), 1, 0, "%"),
                  fmt(d.get("achieved_flops_per_s"), 1e-9, 1), fmt(d.get("pct_of_peak_flops"), 1, 0, "%"),
                  str(d.get("bound", "-")), fmt(d.get("predicted_over_measured"), 1, 2))
    return p


def _print_bandwidth(con, ours: dict) -> None:
    sb = ours.get("session_bandwidth")
    if sb:
        con.print(f"% BW: of the probe's cached bandwidth; % BW now: of the read bandwidth measured around the "
                  f"iterations (median {sb['median'] / 1e9:.1f} GB/s, {sb['min'] / 1e9:.1f}..{sb['max'] / 1e9:.1f} "
                  f"over {len(sb['samples'])} samples)")
    pb = ours.get("paired_bandwidth")
    if pb:
        con.print(f"decode paired with the read bandwidth sampled every {pb['every_steps']} steps (one more batch): "
                  f"{pb['achieved_bytes_per_s'] / 1e9:.1f} GB/s moved, [bold]{pb['pct']:.0f}%[/bold] of the bandwidth "
                  f"read around each segment ({pb['min'] / 1e9:.1f}..{pb['max'] / 1e9:.1f} GB/s over "
                  f"{len(pb['samples'])} samples)")
