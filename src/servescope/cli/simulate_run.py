"""`servescope simulate`'s run: arguments -> instance spec, workload, deployment; bench serve's output."""

from __future__ import annotations

import math

from servescope.analysis.hardware import get_hardware
from servescope.analysis.presets import load_preset
from servescope.bench.report import render_result_table
from servescope.cli.simulate_search import run_search
from servescope.config.engine import BatchingConfig, KVCacheConfig, ParallelConfig
from servescope.sim.cluster import Deployment
from servescope.sim.disagg import Disaggregated
from servescope.sim.run import simulate, write_trace
from servescope.sim.spec import DEFAULT_CONTEXT_QUANTUM, HostCosts, SpecDecodeSpec, describe, instance_spec
from servescope.sim.step_table import StepTable
from servescope.sim.workload import read_trace, synthetic_workload

RANDOM_PREFIX = "random:"


def host_costs_for(args, hw) -> HostCosts:
    """The detokeniser's work per output token: measured on the local tokenizer for local-cpu (a random:
    model has no tokenizer, so nothing is detokenised), none on a datasheet spec."""
    if args.host_overhead == "none" or hw.kind != "cpu":
        return HostCosts()
    # the tokenizer: only here, to measure its cost once (cached)
    from servescope.measure.detokenise import detokenise_cost

    return HostCosts(*detokenise_cost(with_tokenizer=not args.model.startswith(RANDOM_PREFIX)))


def local_link(args, hw):
    """On local-cpu, ranks and instances talk over gloo between processes of this machine: its link is
    measured once on the engine (measure/local_hardware.py), unless a link is named."""
    if hw.kind != "cpu":
        return None
    needs = args.tensor_parallel_size * args.pipeline_parallel_size > 1 and args.link is None
    needs = needs or (args.prefill_instances and args.kv_link in (None, "local-gloo"))
    if not needs:
        return None
    from servescope.measure.local_hardware import local_gloo_link  # the engine (torch): measures two processes

    return local_gloo_link(measure=True)


def local_kv_link(args, hw):
    """On local-cpu, a prefill instance hands its KV to a decode instance over the engine's send path between
    two processes (gather, gloo send/recv, scatter): measured once (measure/kv_send.py), unless a link is named."""
    if hw.kind != "cpu" or args.kv_link not in (None, "local-gloo"):
        return None
    from servescope.measure.local_hardware import local_kv_link as measured  # the engine (torch): two processes

    return measured(measure=True)


def _preset(model: str) -> str:
    return model[len(RANDOM_PREFIX):] if model.startswith(RANDOM_PREFIX) else model


def spec_from_args(args, tp: int = None, host: HostCosts = None):
    hw = get_hardware(args.hardware)
    model = _preset(args.model)
    host = host if host is not None else host_costs_for(args, hw)
    return instance_spec(
        model, hw, dtype=args.dtype, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
        cache=KVCacheConfig(block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
                            kv_cache_memory_bytes=args.kv_cache_memory,
                            enable_prefix_caching=not args.no_prefix_caching),
        batching=BatchingConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                max_model_len=args.max_model_len, enable_chunked_prefill=not args.no_chunked_prefill),
        parallel=ParallelConfig(tensor_parallel_size=tp or args.tensor_parallel_size,
                                pipeline_parallel_size=args.pipeline_parallel_size,
                                pipeline_micro_batches=args.pipeline_micro_batches),
        ep=args.expert_parallel_size, link=args.link or local_link(args, hw),
        spec_decode=SpecDecodeSpec(args.num_speculative_tokens,
                                   args.spec_acceptance if args.num_speculative_tokens else 0.0),
        host=host, step_table=StepTable.load(args.step_table) if args.step_table else None,
        context_quantum=DEFAULT_CONTEXT_QUANTUM if args.context_quantum is None else args.context_quantum)


def workload_from_args(args, vocab_size: int) -> list:
    if args.trace_file:
        return read_trace(args.trace_file, vocab_size, args.seed)
    return synthetic_workload(args.num_prompts, args.input_len, args.output_len, vocab_size, args.request_rate,
                              args.burstiness, args.seed)


def deployment_from_args(args, spec, keep_steps: bool = True):
    if args.prefill_instances:
        link = args.kv_link if args.kv_link not in (None, "local-gloo") else local_kv_link(args, spec.hardware)
        return Disaggregated(spec, args.prefill_instances, args.decode_instances, kv_link=link or args.kv_link,
                             keep_steps=keep_steps)
    return Deployment(spec, args.replicas, args.router, keep_steps=keep_steps,
                      fast_forward=not args.no_fast_forward)


def run_simulate(args, con, write_json) -> int:
    if args.search:
        hw = get_hardware(args.hardware)
        host = host_costs_for(args, hw)
        vocab = load_preset(_preset(args.model)).vocab_size
        return run_search(args, workload_from_args(args, vocab), con, hw,
                          lambda tp: spec_from_args(args, tp=tp, host=host))
    spec = spec_from_args(args)
    requests = workload_from_args(args, spec.model.vocab_size)
    deployment = deployment_from_args(args, spec)
    rate = args.request_rate
    config = {"simulated": True, "model": spec.model.name, "hardware": spec.hardware.name,
              "num_prompts": len(requests), "request_rate": rate if math.isfinite(rate) else "inf",
              "burstiness": args.burstiness, "max_concurrency": args.max_concurrency, "ignore_eos": True,
              "seed": args.seed, "deployment": deployment.describe(), "instance": describe(spec)}
    con.print(f"simulate: {len(requests)} requests to {deployment.describe()}, rate {rate} req/s, burstiness "
              f"{args.burstiness}, max concurrency {args.max_concurrency}, seed {args.seed}")
    con.print(f"instance: {describe(spec)}")
    run = simulate(deployment, requests, args.max_concurrency, args.goodput, args.percentiles, config)
    con.print(render_result_table(run.result))
    if run.result.error_counts:
        con.print(f"[red]errors:[/red] {dict(run.result.error_counts)}")
    busy = ", ".join(f"{i['name']} {i['busy']:.0%}" for i in run.stats["instances"][:8])
    con.print(f"simulated {run.result.duration_s:.1f} s in {run.wall_seconds:.2f} s; busy: {busy}")
    if args.trace:
        write_trace(args.trace, run)
        con.print(f"trace written to {args.trace} (servescope replay {args.trace})")
    if args.json:
        write_json(args.json, dict(run.result.to_dict(args.include_records), simulation=run.stats))
        con.print(f"results written to {args.json}")
    return 0 if run.result.completed else 1
