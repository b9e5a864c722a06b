"""`servescope bench throughput | latency | serve`: benchmarks with the field's definitions, and baselines.

throughput  offline batch through our engine (vLLM / nano-vLLM random workload), optionally the same
            prompts through transformers (`--baseline hf`) and llama.cpp (`--baseline llama-cpp`)
latency     one batch shape: TTFT, TPOT, per-phase step breakdown against the roofline
serve       load generator for any OpenAI-compatible server (Poisson/gamma arrivals, SLO goodput)

The runs live in cli/bench_offline.py (throughput, latency) and here (serve); what they measure and
compute lives in servescope.bench.
"""

from __future__ import annotations

import argparse
import math

from servescope.cli import bench_offline
from servescope.cli.args import add_engine_args, positive_float, positive_int, request_rate
from servescope.cli.output import console, error, write_json

BASELINES = ("hf", "llama-cpp")  # servescope.bench.comparison.BASELINES (not imported: start-up, below)


def _length(s: str):
    # servescope.bench imports numpy and httpx (0.5 s of `servescope --help`'s 0.7 s), so it is
    # imported when a length is parsed; the defaults are strings, which argparse parses only for the
    # subcommand that runs
    from servescope.bench.offline import parse_length

    try:
        return parse_length(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))


def _rates(s: str) -> list:
    return [request_rate(x) for x in s.split(",") if x.strip()]


def _percentiles(s: str) -> tuple:
    try:
        ps = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated percentiles, got {s!r}")
    if not ps or any(not 0 <= p <= 100 for p in ps):
        raise argparse.ArgumentTypeError(f"percentiles must be in [0, 100], got {s!r}")
    return ps


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="throughput, latency and serving benchmarks (with baselines)")
    bsub = b.add_subparsers(dest="bench_command", metavar="BENCH", parser_class=type(b))

    t = bsub.add_parser("throughput", help="offline throughput: N requests at once (vLLM's random workload)")
    _add_workload_args(t, num_prompts=64, input_len="32..512", output_len="32..256")
    _add_baseline_args(t)
    t.add_argument("--hf-batch-size", type=positive_int, default=16,
                   help="static batch size of the transformers baseline (default 16)")
    t.add_argument("--trace", default=None, metavar="FILE", help="write a Chrome trace of our engine's steps")
    t.add_argument("--no-warmup", action="store_true", help="skip the short warm-up of each engine")
    t.add_argument("--no-progress", action="store_true")
    t.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
    add_engine_args(t)

    lat = bsub.add_parser("latency", help="one batch shape: TTFT, TPOT, prefill/decode steps vs the roofline")
    lat.add_argument("--batch-size", type=positive_int, default=1)
    lat.add_argument("--input-len", type=positive_int, default=128)
    lat.add_argument("--output-len", type=positive_int, default=64)
    lat.add_argument("--iters", type=positive_int, default=3, help="timed iterations (medians are reported)")
    lat.add_argument("--seed", type=int, default=0)
    lat.add_argument("--no-warmup", action="store_true")
    _add_baseline_args(lat)
    lat.add_argument("--json", default=None, metavar="FILE")
    add_engine_args(lat)

    _add_serve_parser(bsub)


def _add_serve_parser(bsub) -> None:
    s = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (ours, vLLM, llama.cpp, ...)")
    s.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    s.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    s.add_argument("--endpoint", default="completions",
                   help="completions, chat, or a path such as /v1/completions (default completions)")
    _add_workload_args(s, num_prompts=32, input_len="128", output_len="64")
    s.add_argument("--request-rate", type=request_rate, default=math.inf,
                   help="requests/s (default inf: all at once)")
    s.add_argument("--burstiness", type=positive_float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson, < 1 burstier (default 1)")
    s.add_argument("--max-concurrency", type=positive_int, default=None)
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
    s.add_argument("--vocab-size", type=positive_int, default=32000,
                   help="token ids are drawn below this without --tokenizer (default 32000)")
    s.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos")
    s.add_argument("--timeout", type=positive_float, default=600.0, help="per-request timeout in s")
    s.add_argument("--no-progress", action="store_true")
    s.add_argument("--dashboard", action="store_true",
                   help="watch the server's /dashboard feed during the run (a headless reader; a browser "
                        "is opened on a desktop) and report what it saw")


def _add_workload_args(p, num_prompts: int, input_len: str, output_len: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--num-prompts", type=positive_int, default=num_prompts, help=f"default {num_prompts}")
    g.add_argument("--input-len", type=_length, default=input_len,
                   help=f"prompt tokens: N or LO..HI (uniform); default {input_len}")
    g.add_argument("--output-len", type=_length, default=output_len,
                   help=f"output tokens: N or LO..HI (uniform), ignore_eos; default {output_len}")
    g.add_argument("--seed", type=int, default=0, help="seed of the lengths and token ids (default 0)")


def _add_baseline_args(p) -> None:
    p.add_argument("--baseline", action="append", choices=BASELINES, default=[],
                   help="also run transformers (hf) or llama-cpp-python on the same prompts (repeatable)")
    p.add_argument("--baseline-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="dtype of the transformers baseline (default: the engine's, as --dtype resolved)")


def run(args: argparse.Namespace) -> int:
    cmd = getattr(args, "bench_command", None)
    if cmd is None:
        return error("bench needs a subcommand: throughput, latency or serve")
    runs = {"throughput": bench_offline.run_throughput, "latency": bench_offline.run_latency, "serve": run_serve}
    return runs[cmd](args)


def run_serve(args) -> int:
    # servescope.bench: numpy, httpx, matplotlib (see _length)
    from servescope.bench.datasets import random_requests
    from servescope.bench.envinfo import environment_info
    from servescope.bench.report import plot_sweep, render_result_table
    from servescope.bench.serve_client import CHAT_COMPLETIONS, COMPLETIONS, is_chat_endpoint, sweep
    from servescope.bench.serve_models import discover_model

    con = console(highlight=False)
    endpoint = {"completions": COMPLETIONS, "chat": CHAT_COMPLETIONS}.get(args.endpoint, args.endpoint)
    tok = None
    if args.tokenizer or is_chat_endpoint(endpoint):
        # the tokenizer (transformers): seconds, and only for a chat endpoint or --tokenizer
        from servescope.loader.source import resolve_model_path
        from servescope.tokenizer import load_tokenizer

        tok = load_tokenizer(resolve_model_path(args.tokenizer)).hf
    model = args.model or discover_model(args.base_url, args.api_key)
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

    viewer = _start_viewer(args) if args.dashboard else None
    results = sweep(
        args.sweep or [args.request_rate], args.base_url, model, point_requests, seed=args.seed,
        on_start=on_start, on_result=on_result, burstiness=args.burstiness,
        max_concurrency=args.max_concurrency, goodput=args.goodput, endpoint=endpoint, api_key=args.api_key,
        progress=not args.no_progress, ignore_eos=not args.no_ignore_eos,
        request_timeout_s=args.timeout, tokenizer=tok, percentiles=args.percentiles)
    if viewer:
        viewer.stop()
        con.print(viewer.summary())
    if args.plot:
        plot_sweep(results, args.plot)
        con.print(f"plot written to {args.plot}")
    if args.json:
        env = environment_info()
        data = [dict(r.to_dict(args.include_records), **env) for r in results]
        write_json(args.json, data if args.sweep else data[0])
        con.print(f"results written to {args.json}")
    return 0 if all(r.completed for r in results) else 1


def _start_viewer(args):
    from servescope.bench.dashboard_viewer import DashboardViewer  # servescope.bench: see _length
    from servescope.cli.live import announce_dashboard

    announce_dashboard(args.base_url.rstrip("/") + "/dashboard")
    return DashboardViewer(args.base_url, args.api_key).start()
