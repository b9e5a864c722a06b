"""`servescope bench throughput | latency | serve`: benchmarks with the field's definitions, and baselines.

throughput  offline batch through our engine (vLLM / nano-vLLM random workload), optionally the same
            prompts through transformers (`--baseline hf`) and llama.cpp (`--baseline llama-cpp`)
latency     one batch shape: TTFT, TPOT, per-phase step breakdown against the roofline
serve       load generator for any OpenAI-compatible server (Poisson/gamma arrivals, SLO goodput)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

from servescope.cli import EXIT_USAGE, _positive_int, add_engine_args, engine_config_from_args

BASELINES = ("hf", "llama-cpp")


def _length(s: str):
    from servescope.bench.offline import parse_length

    try:
        return parse_length(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _rate(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of requests/s or 'inf', got {s!r}")
    if not v > 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 (or inf), got {s!r}")
    return v


def _rates(s: str) -> list:
    return [_rate(x) for x in s.split(",") if x.strip()]


def _pos_float(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}")
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {s!r}")
    return v


def _percentiles(s: str) -> tuple:
    try:
        ps = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles, got {s!r}")
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {s!r}")
    return ps


def add_parsers(sub) -> None:
    b = sub.add_parser("bench", help="throughput, latency and serving benchmarks (with baselines)")
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=type(b))

    t = bsub.add_parser("throughput", help="offline throughput: N requests at once (vLLM's random workload)")
    _add_workload_args(t, num_prompts=64, input_len="32..512", output_len="32..256")
    _add_baseline_args(t)
    t.add_argument("--hf-batch-size", type=_positive_int, default=16,
                   help="static batch size of the transformers baseline (default 16)")
    t.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace of our engine's steps")
    t.add_argument("--no-warmup", action="store_true", help="skip the short warm-up of each engine")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    add_engine_args(t)

    lat = bsub.add_parser("latency", help="one batch shape: TTFT, TPOT, prefill/decode steps vs the roofline")
    lat.add_argument("--batch-size", type=_positive_int, default=1)
    lat.add_argument("--input-len", type=_positive_int, default=128)
    lat.add_argument("--output-len", type=_positive_int, default=64)
    lat.add_argument("--iters", type=_positive_int, default=3, help="timed iterations (medians are reported)")
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--no-warmup", action="store_true")
    _add_baseline_args(lat)
    lat.add_argument("--json", default=None, metavar="FILE")
    add_engine_args(lat)

    s = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (ours, vLLM, llama.cpp, ...)")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    s.add_argument("--endpoint", default="completions",
                   help="completions, chat, or a path such as /v1/completions (default completions)")
    _add_workload_args(s, num_prompts=32, input_len="128", output_len="64")
    s.add_argument("--request-rate", type=_rate, default=math.inf, help="requests/s (default inf: all at once)")
    s.add_argument("--burstiness", type=_pos_float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier (default 1)")
    s.add_argument("--max-concurrency", type=_positive_int, default=None)
    s.add_argument("--goodput", nargs="+", default=None, metavar="SLO",
                   help="SLOs in ms, e.g. ttft:500 tpot:100 e2el:20000")
    s.add_argument("--percentiles", type=_percentiles, default=(90.0, 99.0), help="default 90,99")
    s.add_argument("--sweep", type=_rates, default=None, metavar="R1,R2,...",
                   help="run once per request rate (overrides --request-rate); the i-th rate draws its "
                        "prompts with seed + i, so that no point finds the previous one's prompts in the "
                        "server's prefix cache")
    s.add_argument("--plot", default=None, metavar="FILE", help="latency-vs-throughput plot of a sweep (PNG)")
    s.add_argument("--json", default=None, metavar="FILE")
    s.add_argument("--include-records", action="store_true", help="per-request records in the JSON")
    s.add_argument("--api-key", default=None)
    s.add_argument("--tokenizer", default=None,
                   help="model path/name whose tokenizer turns prompts into text (needed for chat; default "
                        "for chat: the embedded model)")
    s.add_argument("--vocab-size", type=_positive_int, default=32000,
                   help="token ids are drawn below this without --tokenizer (default 32000)")
    s.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    s.add_argument("--timeout", type=_pos_float, default=600.0, help="per-request timeout in s")
    s.add_argument("--no-progress", action="store_true")


def _add_workload_args(p, num_prompts: int, input_len: str, output_len: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=_positive_int, default=num_prompts, help=f"default {num_prompts}")
    g.add_argument("--input-len", type=_length, default=_length(input_len),
                   help=f"prompt tokens: N or LO..HI (uniform); default {input_len}")
    g.add_argument("--output-len", type=_length, default=_length(output_len),
                   help=f"output tokens: N or LO..HI (uniform), ignore_eos; default {output_len}")
    g.add_argument("--seed", type=int, default=0, help="seed of the lengths and token ids (default 0)")


def _add_baseline_args(p) -> None:
    p.add_argument("--baseline", action="append", choices=BASELINES, default=[],
                   help="also run transformers (hf) or llama-cpp-python on the same prompts (repeatable)")


# ------------------------------------------------------------------------------------------ run


def run(args) -> int:
    cmd = getattr(args, "bench_command", None)
    if cmd is None:
        sys.stderr.write("servescope: error: bench needs a subcommand: throughput, latency or serve\n")
        return EXIT_USAGE
    return {"throughput": run_throughput, "latency": run_latency, "serve": run_serve}[cmd](args)


def _console():
    from rich.console import Console

    return Console(stderr=False, highlight=False)


def _make_llm(args):
    import torch

    from servescope.engine.llm import LLM

    if args.threads:
        torch.set_num_threads(args.threads)  # the baselines run in this process with the same threads
    cfg = engine_config_from_args(args)
    return LLM(**dataclasses.asdict(cfg))


def _write_json(path, data) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n")


def _engine_desc(args, llm) -> dict:
    e = llm.engine
    return {"model": args.model or "smollm2-135m", "source": str(e.source_path), "dtype": args.dtype,
            "device": args.device, "quantization": args.quantization, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens, "block_size": args.block_size,
            "kv_capacity_tokens": e.cache_config.num_blocks * e.cache_config.block_size,
            "prefix_caching": not args.no_prefix_caching, "chunked_prefill": not args.no_chunked_prefill,
            "attention_backend": e.runner.backend.name, "weight_bytes": e.weight_bytes}


def _fmt(x, scale=1.0, digits=1, unit=""):
    return "-" if x is None else f"{x * scale:.{digits}f}{unit}"


def _skip(results: dict, name: str, reason: str, con) -> None:
    results[name] = {"skipped": reason}
    con.print(f"[yellow]baseline {name} skipped:[/yellow] {reason}")


def run_throughput(args) -> int:
    from rich.table import Table

    from servescope.bench import baselines as bl
    from servescope.bench.envinfo import environment_info
    from servescope.bench.offline import Workload, public, run_engine_throughput, warm_up_engine, write_trace

    con = _console()
    try:
        wl = Workload(args.num_prompts, args.input_len, args.output_len, args.seed)
    except ValueError as e:
        sys.stderr.write(f"servescope: error: {e}\n")
        return EXIT_USAGE
    llm = _make_llm(args)
    vocab = llm.engine.model_config.vocab_size
    reqs = wl.requests(vocab)
    too_long = [r for r in reqs if r.prompt_len + r.output_len > llm.engine.max_model_len]
    if too_long:
        sys.stderr.write(f"servescope: error: {len(too_long)} requests exceed the model's context "
                         f"({llm.engine.max_model_len} tokens); use shorter --input-len/--output-len\n")
        return EXIT_USAGE
    progress = not args.no_progress
    con.print(f"workload: {wl.num_prompts} requests, input {wl.describe()['input_len']}, "
              f"output {wl.describe()['output_len']}, seed {wl.seed}; "
              f"{sum(r.prompt_len for r in reqs)} prompt + {sum(r.output_len for r in reqs)} output tokens")
    if not args.no_warmup:
        warm_up_engine(llm, vocab)
    ours = run_engine_throughput(llm, reqs, progress=progress)
    results = {"servescope": ours}
    if args.trace:
        why = write_trace(args.trace, ours["_steps"], ours["_outputs"])
        con.print(f"[yellow]trace not written:[/yellow] {why}" if why else f"trace written to {args.trace}")

    for name in dict.fromkeys(args.baseline):
        if name == "hf":
            con.print(f"baseline hf: transformers generate, padded batches of {args.hf_batch_size}, {args.dtype}")
            hf = bl.load_hf_model(args.model, args.dtype)
            if not args.no_warmup:
                bl.hf_warm_up(hf, vocab)
            bar = _bar(len(reqs), "hf requests", progress)
            results["hf"] = bl.run_hf_throughput(hf, reqs, args.hf_batch_size, on_batch=bar.update)
            bar.close()
            del hf
        else:
            why = bl.llama_cpp_missing_reason()
            gguf = bl.llama_cpp_gguf_path(args.model)
            if why is None and gguf is None:
                why = "llama.cpp needs a GGUF model; --model is not a .gguf file"
            if why:
                _skip(results, "llama-cpp", why, con)
                continue
            import torch

            n_ctx = max(r.prompt_len + r.output_len for r in reqs) + 16
            lc = bl.load_llama_cpp(gguf, n_ctx, torch.get_num_threads())
            bar = _bar(len(reqs), "llama.cpp requests", progress)
            results["llama-cpp"] = bl.run_llama_cpp_throughput(lc, reqs, on_request=bar.update)
            bar.close()
            results["llama-cpp"]["gguf"] = gguf
            del lc

    ratios = {}
    for name in ("hf", "llama-cpp"):
        r = results.get(name)
        if r and "output_tokens_per_s" in r:
            ratios[f"output_tokens_per_s_vs_{name}"] = ours["output_tokens_per_s"] / r["output_tokens_per_s"]

    table = Table(title="offline throughput", box=None, pad_edge=False)
    for col in ("engine", "req/s", "output tok/s", "total tok/s", "wall s", "peak KV", "preempt"):
        table.add_column(col, justify="left" if col == "engine" else "right")
    for name, r in results.items():
        if "skipped" in r:
            continue
        table.add_row(name, _fmt(r["requests_per_s"], digits=2), _fmt(r["output_tokens_per_s"]),
                      _fmt(r["total_tokens_per_s"]), _fmt(r["wall_seconds"], digits=1),
                      _fmt(r.get("peak_kv_usage"), 100, 0, "%") if "peak_kv_usage" in r else "-",
                      str(r.get("preemptions", "-")))
    con.print(table)
    for k, v in ratios.items():
        con.print(f"servescope / {k.rsplit('_vs_', 1)[1]} output tokens/s: [bold]{v:.2f}x[/bold]")
    if "hf" in results and "generated_tokens" in results["hf"]:
        con.print(f"(hf generated {results['hf']['generated_tokens']} tokens in padded batches; only the "
                  f"{results['hf']['output_tokens']} requested ones count)")
    if args.json:
        data = {"benchmark": "throughput", **environment_info(), "workload": wl.describe(),
                "engine": _engine_desc(args, llm), "results": public(results), "ratios": ratios}
        _write_json(args.json, data)
        con.print(f"results written to {args.json}")
    return 0


def _bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", disable=not enabled, dynamic_ncols=True)


def run_latency(args) -> int:
    from rich.table import Table

    from servescope.bench import baselines as bl
    from servescope.bench.envinfo import environment_info
    from servescope.bench.latency import run_engine_latency
    from servescope.bench.offline import public
    from servescope.engine.local_hardware import hardware_for_device

    con = _console()
    llm = _make_llm(args)
    e = llm.engine
    if args.input_len + args.output_len > e.max_model_len:
        sys.stderr.write(f"servescope: error: input {args.input_len} + output {args.output_len} tokens exceed "
                         f"the model's context ({e.max_model_len})\n")
        return EXIT_USAGE
    hw = hardware_for_device(e.device, args.hardware)  # the spec the engine's step predictions use
    dtype = str(e.dtype).replace("torch.", "")
    con.print(f"latency: batch {args.batch_size}, input {args.input_len}, output {args.output_len}, "
              f"{dtype}, {args.iters} iterations; roofline: {hw.name} "
              f"({hw.memory_bandwidth / 1e9:.1f} GB/s, {hw.flops(dtype) / 1e9:.0f} GFLOP/s {dtype})")
    ours = run_engine_latency(
        llm, args.batch_size, args.input_len, args.output_len, iters=args.iters, warmup=not args.no_warmup,
        seed=args.seed, hardware=hw, dtype=dtype,
        on_iteration=lambda i, r: con.print(
            f"  iter {i + 1}/{args.iters}: wall {r['wall_seconds']:.2f} s, TTFT {r['ttft_s'] * 1e3:.0f} ms, "
            f"TPOT {_fmt(r['tpot_s'], 1e3, 1)} ms"))
    results = {"servescope": ours}
    vocab = e.model_config.vocab_size
    for name in dict.fromkeys(args.baseline):
        if name == "hf":
            hf = bl.load_hf_model(args.model, args.dtype)
            results["hf"] = bl.run_hf_latency(hf, args.batch_size, args.input_len, args.output_len, vocab,
                                              iters=args.iters, seed=args.seed, warmup=not args.no_warmup)
            del hf
        else:
            why = bl.llama_cpp_missing_reason()
            gguf = bl.llama_cpp_gguf_path(args.model)
            if why is None and gguf is None:
                why = "llama.cpp needs a GGUF model; --model is not a .gguf file"
            if why is None and args.batch_size != 1:
                why = "the llama.cpp baseline measures batch 1 only (its Python API does not batch)"
            if why:
                _skip(results, "llama-cpp", why, con)
                continue
            import torch

            lc = bl.load_llama_cpp(gguf, args.input_len + args.output_len + 16, torch.get_num_threads())
            results["llama-cpp"] = bl.run_llama_cpp_latency(lc, args.input_len, args.output_len, vocab,
                                                            iters=args.iters, seed=args.seed,
                                                            warmup=not args.no_warmup)
            del lc

    ratios = {}
    for name in ("hf", "llama-cpp"):
        r = results.get(name)
        if not r or "skipped" in r:
            continue
        if r.get("decode_tokens_per_s") and ours.get("decode_tokens_per_s"):
            ratios[f"decode_tokens_per_s_vs_{name}"] = ours["decode_tokens_per_s"] / r["decode_tokens_per_s"]
        if r.get("ttft_s") and ours.get("ttft_s"):
            ratios[f"ttft_vs_{name}"] = ours["ttft_s"] / r["ttft_s"]

    t = Table(title="per-request latency (medians)", box=None, pad_edge=False)
    for col in ("engine", "TTFT ms", "TPOT ms", "E2E s", "decode tok/s"):
        t.add_column(col, justify="left" if col == "engine" else "right")
    for name, r in results.items():
        if "skipped" in r:
            continue
        t.add_row(name, _fmt(r["ttft_s"], 1e3), _fmt(r["tpot_s"], 1e3, 2), _fmt(r["e2e_s"], 1, 2),
                  _fmt(r["decode_tokens_per_s"]))
    con.print(t)
    p = Table(title="servescope steps by phase (time-weighted rates)", box=None, pad_edge=False)
    for col in ("phase", "steps", "median step ms", "tok/s", "GB/s", "% BW", "% BW now", "GFLOP/s", "% peak",
                "bound", "pred/meas"):
        p.add_column(col, justify="left" if col == "phase" else "right")
    for phase, d in ours["phases"].items():
        p.add_row(phase, str(d["num_steps"]), _fmt(d["median_step_seconds"], 1e3, 2), _fmt(d["tokens_per_s"]),
                  _fmt(d.get("achieved_bytes_per_s"), 1e-9, 1), _fmt(d.get("pct_of_bandwidth"), 1, 0, "%"),
                  _fmt(d.get("pct_of_session_bandwidth"), 1, 0, "%"),
                  _fmt(d.get("achieved_flops_per_s"), 1e-9, 1), _fmt(d.get("pct_of_peak_flops"), 1, 0, "%"),
                  str(d.get("bound", "-")), _fmt(d.get("predicted_over_measured"), 1, 2))
    con.print(p)
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
    for k, v in ratios.items():
        what, name = k.rsplit("_vs_", 1)
        label = "decode tokens/s" if what.startswith("decode") else "TTFT"
        con.print(f"servescope / {name} {label}: [bold]{v:.2f}x[/bold]"
                  + (" (lower is better)" if label == "TTFT" else ""))
    if args.json:
        data = {"benchmark": "latency", **environment_info(),
                "shape": {"batch_size": args.batch_size, "input_len": args.input_len,
                          "output_len": args.output_len, "iters": args.iters, "seed": args.seed},
                "engine": _engine_desc(args, llm), "results": public(results), "ratios": ratios}
        _write_json(args.json, data)
        con.print(f"results written to {args.json}")
    return 0


def _discover_model(base_url: str, api_key) -> str:
    import httpx

    from servescope.bench.serve_client import endpoint_url
    from servescope.errors import InvalidParameterError

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    try:
        r = httpx.get(endpoint_url(base_url, "/v1/models"), headers=headers, timeout=10.0)
        r.raise_for_status()
        return r.json()["data"][0]["id"]
    except Exception as e:
        raise InvalidParameterError("model", f"could not read the model name from {base_url}/v1/models "
                                             f"({type(e).__name__}: {e}); pass --model") from None


def run_serve(args) -> int:
    from servescope.bench.datasets import random_requests
    from servescope.bench.envinfo import environment_info
    from servescope.bench.report import plot_sweep, render_result_table
    from servescope.bench.serve_client import CHAT_COMPLETIONS, COMPLETIONS, is_chat_endpoint, sweep

    con = _console()
    endpoint = {"completions": COMPLETIONS, "chat": CHAT_COMPLETIONS}.get(args.endpoint, args.endpoint)
    chat = is_chat_endpoint(endpoint)
    tok = None
    if args.tokenizer or chat:
        from servescope.loader.source import resolve_model_path
        from servescope.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model_path(args.tokenizer)).hf
    model = args.model or _discover_model(args.base_url, args.api_key)
    lo_hi = lambda v: v if isinstance(v, tuple) else (v, v)  # noqa: E731

    def point_requests(seed: int) -> list:
        return random_requests(args.num_prompts, lo_hi(args.input_len), lo_hi(args.output_len),
                               vocab_size=None if tok is not None else args.vocab_size, seed=seed, tokenizer=tok)

    def on_start(rate, seed, reqs) -> None:
        con.print(f"bench serve: {len(reqs)} requests to {args.base_url} ({endpoint}), model {model}, "
                  f"rate {rate} req/s, burstiness {args.burstiness}, max concurrency {args.max_concurrency}, "
                  f"seed {seed}")

    def on_result(res) -> None:
        con.print(render_result_table(res))
        if res.error_counts:
            con.print(f"[red]errors:[/red] {dict(res.error_counts)}")

    results = sweep(
        args.sweep or [args.request_rate], args.base_url, model, point_requests, seed=args.seed,
        on_start=on_start, on_result=on_result, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, goodput=args.goodput, endpoint=endpoint, api_key=args.api_key,
        progress=not args.no_progress, ignore_eos=not args.no_ignore_eos,
        request_timeout_s=args.timeout, tokenizer=tok, percentiles=args.percentiles)
    if args.plot:
        plot_sweep(results, args.plot)
        con.print(f"plot written to {args.plot}")
    if args.json:
        env = environment_info()
        data = [dict(r.to_dict(args.include_records), **env) for r in results]
        _write_json(args.json, data if args.sweep else data[0])
        con.print(f"results written to {args.json}")
    return 0 if all(r.completed for r in results) else 1
