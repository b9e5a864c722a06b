"""`servescope simulate`: bench serve's workload on a simulated deployment (no weights, virtual time).

The engine's own scheduler and KV cache manager run on a virtual clock whose steps take what the cost
model predicts (servescope.sim). Any model preset on any hardware spec, TP x PP, engine settings,
speculative decoding, data-parallel replicas behind a router, prefill/decode disaggregation; prints
what `bench serve` prints, `--json` with the same keys, `--trace` for `servescope replay`.
`--search` finds the cheapest layout that meets the SLOs at the rate (cli/simulate_search.py).
"""

from __future__ import annotations

import argparse
import math

from servescope.cli.args import positive_float, positive_int, request_rate
from servescope.cli.bench import _add_workload_args, _percentiles
from servescope.cli.output import console, error, write_json

ROUTERS = ("round-robin", "least-tokens", "prefix")  # sim/cluster.ROUTERS (not imported: start-up)


def add_parser(sub) -> None:
    s = sub.add_parser("simulate", help="simulate a deployment on bench serve's workload (virtual time, no weights)")
    m = s.add_argument_group("model and hardware")
    m.add_argument("--model", default="smollm2-135m",
                   help="a preset (servescope explain --help lists them), random:PRESET, or a config.json")
    m.add_argument("--hardware", default="local-cpu", help="a hardware spec (servescope hardware list)")
    m.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    m.add_argument("--quantization", "-q", default=None, metavar="WEIGHTS",
                   help="the weights' dtype or packed format: int8 (per channel), fp8 (FP8 tensor cores: Hopper, "
                        "Ada, MI300), int4, int8-g32, q4_0, q4_1, q8_0 (default: the activation dtype)")
    m.add_argument("--kv-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16", "float16", "int8", "fp8", "fp8_e4m3"])
    m.add_argument("--tensor-parallel-size", "-tp", type=positive_int, default=1)
    m.add_argument("--pipeline-parallel-size", "-pp", type=positive_int, default=1)
    m.add_argument("--expert-parallel-size", "-ep", type=positive_int, default=1)
    m.add_argument("--pipeline-micro-batches", type=int, default=0)
    m.add_argument("--link", default=None, help="link between ranks (default: the GPU's; none: compute only)")
    m.add_argument("--host-overhead", default="auto", choices=["auto", "none"],
                   help="auto: on local-cpu, the detokeniser's work per output token, measured once on the "
                        "tokenizer (cached); none: the cost model's host overhead only (the probe's, per step, "
                        "layer and sequence)")
    e = s.add_argument_group("engine settings (as serve's)")
    e.add_argument("--block-size", type=positive_int, default=16)
    e.add_argument("--num-kv-blocks", type=positive_int, default=None)
    e.add_argument("--kv-cache-memory", type=positive_int, default=None, metavar="BYTES")
    e.add_argument("--max-num-seqs", type=positive_int, default=64)
    e.add_argument("--max-num-batched-tokens", type=positive_int, default=1024)
    e.add_argument("--max-model-len", type=positive_int, default=None)
    e.add_argument("--no-prefix-caching", action="store_true")
    e.add_argument("--no-chunked-prefill", action="store_true")
    e.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K")
    e.add_argument("--spec-acceptance", type=float, default=0.7, help="per-draft acceptance rate (with K)")
    _add_workload_args(s, num_prompts=32, input_len="128", output_len="64")
    w = s.add_argument_group("arrivals and report (as bench serve's)")
    w.add_argument("--request-rate", type=request_rate, default=math.inf)
    w.add_argument("--burstiness", type=positive_float, default=1.0)
    w.add_argument("--max-concurrency", type=positive_int, default=None)
    m.add_argument("--step-table", default=None, metavar="JSON",
                   help="measured / predicted step times (lab simulate writes one): scales each predicted step")
    m.add_argument("--context-quantum", type=int, default=None, metavar="TOKENS",
                   help="step predictions are memoised with one-token rows at their mean context rounded to "
                        "this many tokens (default 16; 0: every step predicted on its exact shape, slower)")
    w.add_argument("--trace-file", default=None, metavar="JSONL",
                   help="requests from a trace (arrival_time, prompt_len, output_len, session_id per line) "
                        "instead of the synthetic workload")
    w.add_argument("--goodput", nargs="+", default=None, metavar="SLO", help="e.g. ttft:500 tpot:100")
    w.add_argument("--percentiles", type=_percentiles, default=(90.0, 99.0))
    w.add_argument("--json", default=None, metavar="FILE")
    w.add_argument("--include-records", action="store_true")
    w.add_argument("--trace", default=None, metavar="FILE",
                   help="write instance 0's steps and requests as a Chrome trace (servescope replay plays it)")
    c = s.add_argument_group("cluster")
    c.add_argument("--replicas", type=positive_int, default=1, help="data-parallel replicas (colocated)")
    c.add_argument("--router", default="least-tokens", choices=ROUTERS)
    c.add_argument("--no-fast-forward", action="store_true",
                   help="step every replica one step at a time (the same results, slower; sim/fast_forward.py)")
    c.add_argument("--prefill-instances", type=int, default=0, metavar="P",
                   help="prefill/decode disaggregation: P prefill instances ...")
    c.add_argument("--decode-instances", type=int, default=0, metavar="D", help="... and D decode instances")
    c.add_argument("--kv-link", default=None, help="link the KV of a finished prefill crosses (default: the "
                                                   "hardware's network, analysis/collectives.py)")
    c.add_argument("--search", action="store_true",
                   help="find the cheapest layout (replicas x TP, or P x D) meeting --goodput at --request-rate")
    c.add_argument("--max-devices", type=positive_int, default=64, help="largest layout --search tries")
    c.add_argument("--slo-attainment", type=float, default=0.9,
                   help="--search: share of requests that must meet every SLO (default 0.9)")


def run(args: argparse.Namespace) -> int:
    # servescope.sim: numpy, the scheduler; the engine (torch) only to measure host overhead once
    from servescope.cli.simulate_run import run_simulate

    if args.num_speculative_tokens < 0 or not 0 <= args.spec_acceptance <= 1:
        return error("--num-speculative-tokens must be >= 0 and --spec-acceptance in [0, 1]")
    if (args.prefill_instances > 0) != (args.decode_instances > 0) or min(args.prefill_instances,
                                                                          args.decode_instances) < 0:
        return error("disaggregation needs both --prefill-instances and --decode-instances (>= 1 each)")
    if args.search and not args.goodput:
        return error("--search needs --goodput SLOs (e.g. ttft:2000 tpot:100) and a finite --request-rate")
    return run_simulate(args, console(highlight=False), write_json)
