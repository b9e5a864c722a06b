"""`servescope explain | lab | hardware`: the analysis layer and the labs on the command line.

explain   the cost model's account of a workload (per-phase FLOPs, bytes, intensity, bound, time),
          optionally plotted on the roofline and checked against the local engine (--measure)
lab       list / run the labs (PNG plots + markdown report per lab)
hardware  list the hardware specs; probe the local CPU

The analysis layer is torch-free and imported at the top; the engine, torch, matplotlib and rich are
imported by the functions that need them: they are seconds of `servescope --help` (cli/__init__.py).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from servescope.analysis.bandwidth import bandwidth_origin
from servescope.analysis.cpu_isa import library_caps
from servescope.analysis.collectives import DEFAULT_LINK, LOCAL_GLOO, get_link
from servescope.analysis.explain import explain, render_explain_table
from servescope.analysis.speculative import explain_speculative
from servescope.analysis.parallel_explain import explain_parallel
from servescope.analysis.hardware import (HARDWARE_SPECS, LOCAL_CPU, HardwareSpec, canonical_hardware_name,
                                          get_hardware)
from servescope.analysis.presets import list_presets, load_preset
from servescope.analysis.probe import cached_local_hardware
from servescope.cli.args import positive_int
from servescope.cli.output import console, error
from servescope.errors import InvalidParameterError


def add_parser(sub) -> None:
    e = sub.add_parser("explain", help="predict a workload's cost on a machine (cost model, roofline, memory)")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--model", default=None, metavar="PATH_OR_NAME",
                     help="a HF directory (config only), a .gguf file, or smollm2-135m (default)")
    src.add_argument("--config", default=None, metavar="PRESET_OR_JSON",
                     help="a preset (llama-3-8b, ...) or a config.json path; no weights needed")
    e.add_argument("--hardware", default="H100-SXM", help="hardware spec name (servescope hardware list)")
    e.add_argument("--batch", type=positive_int, default=1)
    e.add_argument("--prompt-len", type=positive_int, default=512)
    e.add_argument("--output-len", type=positive_int, default=128)
    e.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16", "int8", "fp8"],
                   help="weight dtype (int8: weight-only, activations bfloat16; fp8: e4m3 weights multiplied on "
                        "FP8 tensor cores with activations rounded to FP8 per token, vLLM's --quantization fp8)")
    e.add_argument("--kv-dtype", default=None, choices=["float32", "bfloat16", "float16", "int8", "fp8_e4m3"],
                   help="KV cache dtype (default: the activation dtype; int8 / fp8_e4m3 count their "
                        "per-token-per-head float32 scales)")
    e.add_argument("--memory", type=positive_int, default=None, metavar="BYTES",
                   help="device memory for the plan (default: the hardware's)")
    e.add_argument("--json", action="store_true", help="print the result as JSON")
    e.add_argument("--plot", default=None, metavar="FILE", help="write the roofline with each op placed on it")
    e.add_argument("--measure", action="store_true",
                   help="run the workload on the local engine and compare with the local-cpu prediction")
    e.add_argument("--threads", type=positive_int, default=None, help="torch threads for --measure")
    e.add_argument("--speculative", default=None, choices=["ngram", "draft"],
                   help="also predict speculative decoding's speed-up per batch size (see -k, --acceptance)")
    e.add_argument("-k", "--num-speculative-tokens", type=positive_int, default=4, dest="spec_k")
    e.add_argument("--acceptance", type=float, default=0.7, help="per-draft acceptance rate, 0..1")
    e.add_argument("--draft-dtype", default="int8", choices=["float32", "bfloat16", "int8"],
                   help="the draft's weights (a copy of the target's shape)")
    e.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size: per-rank compute + all-reduces")
    e.add_argument("--pp", type=positive_int, default=1, help="pipeline-parallel size: stages + point-to-point sends")
    e.add_argument("--ep", type=positive_int, default=1,
                   help="expert-parallel size (a mixture of experts): its experts split over EP ranks + all-to-alls")
    e.add_argument("--micro-batches", type=int, default=0, metavar="M",
                   help="micro-batches a pipeline step is cut into (0: the engine's auto rule; 1: no overlap)")
    e.add_argument("--link", default=None, help="link between ranks: nvlink4, pcie4, pcie5, local-gloo "
                                                "(default: the GPU's, or the measured local gloo link)")

    lab = sub.add_parser("lab", help="run a lab: an experiment with plots and a report (lab list)")
    lab.add_argument("name", help="a lab name, 'list' or 'all'")
    lab.add_argument("--out", default=None, metavar="DIR", help="output directory (default ./lab-out/NAME)")
    lab.add_argument("--quick", action="store_true",
                     help="small sizes, repeated in interleaved rounds: each effect shows in under a minute; "
                          "the full sizes are the measurement")
    lab.add_argument("--model", default=None, help="model to run (default: the embedded SmolLM2-135M)")
    lab.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    lab.add_argument("--quantization", default=None, metavar="MODE",
                     help="weight-only quantization of the model: int8, int4 (Q4_0's form), int8-g32 (Q8_0's), ...")
    lab.add_argument("--threads", type=positive_int, default=None, help="torch threads (default: torch's)")
    lab.add_argument("--hardware", default=None, help="spec the engine predicts with (default: local-cpu probe)")

    hw = sub.add_parser("hardware", help="hardware specs: list them, probe the local CPU")
    hw_sub = hw.add_subparsers(dest="hardware_command", metavar="ACTION")
    hw_sub.add_parser("list", help="print every spec")
    probe = hw_sub.add_parser("probe", help="measure the local CPU (cached; --force re-measures)")
    probe.add_argument("--force", action="store_true")
    probe.add_argument("--threads", type=positive_int, default=None)


def run(args: argparse.Namespace) -> int:
    return {"explain": run_explain, "lab": run_lab_command, "hardware": run_hardware}[args.command](args)


# --------------------------------------------------------------------------- hardware

def hardware_spec(name: str) -> HardwareSpec:
    """The spec `name` names. The local CPU's measures the engine, so it comes from
    measure.local_hardware, imported only for it: that imports torch, seconds, where a whole `explain`
    on a datasheet spec takes a fraction of one."""
    if canonical_hardware_name(name) == LOCAL_CPU:
        from servescope.measure.local_hardware import resolve_hardware  # lazy: torch, 2 s (see above)

        return resolve_hardware(name)
    return get_hardware(name)


def hardware_table(specs):
    """Specs as a rich table (the numbers), then one line per spec with its source."""
    # lazy: rich is 0.13 s of `--help` (cli/output.py)
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    t = Table(title="hardware specs (dense peaks; GB = 1e9 bytes)")
    for col in ("name", "kind", "bf16 TF/s", "fp32 TF/s", "GB/s", "mem GB", "ridge"):
        t.add_column(col, justify="left" if col in ("name", "kind") else "right", no_wrap=True)

    def tf(x):
        x /= 1e12
        return f"{x:,.0f}" if x >= 100 else (f"{x:.1f}" if x >= 1 else f"{x:.3f}")

    for s in specs:
        t.add_row(s.name, s.kind, tf(s.flops("bfloat16")), tf(s.flops("float32")),
                  f"{s.memory_bandwidth / 1e9:,.0f}", f"{s.memory_bytes / 1e9:.0f}",
                  f"{s.ridge_point('bfloat16'):.0f}")
    sources = Text("sources:\n" + "\n".join(f"  {s.name}: {s.source}" for s in specs))
    return Group(t, sources)


def run_hardware(args) -> int:
    action = getattr(args, "hardware_command", None) or "list"
    con = console()
    if action == "probe":
        import torch  # lazy: 2 s

        from servescope.measure.local_hardware import probe_local_cpu  # lazy: torch

        if args.threads:
            torch.set_num_threads(args.threads)
        with con.status("probing the local CPU (memory bandwidth, matmul FLOP/s, the engine's host overhead)..."):
            spec = probe_local_cpu(force=args.force)
        caps = library_caps()
        con.print(hardware_table([spec]))
        con.print(f"CPU kernel path: {spec.kernel_path or 'unknown (an older probe)'}"
                  + (f"; no fast matmul for {', '.join(spec.slow_dtypes)} here" if spec.slow_dtypes else "")
                  + (f"; packed integer GEMM (group-32 weights, float32 activations) "
                     f"{spec.packed_gemm_flops / 1e9:,.0f} GFLOP/s" if spec.packed_gemm_flops else "")
                  + (f"; torch's kernels capped by {caps}" if caps else ""))
        con.print(spec.notes)
        if bandwidth_origin(spec):  # a cached probe: the bandwidth spot-checked beside it
            con.print(f"read bandwidth: {bandwidth_origin(spec)}")
        return 0
    # the local CPU is listed when it was probed already: listing reads the probe's cache, never probes
    local = cached_local_hardware()
    con.print(hardware_table(list(HARDWARE_SPECS.values()) + ([local] if local else [])))
    if not local:
        con.print("local-cpu: not probed yet; run `servescope hardware probe`")
    return 0


# --------------------------------------------------------------------------- explain

def load_model_config(args):
    """The ModelConfig to explain: --config (preset or JSON), else --model (HF dir: config.json only;
    .gguf: read through the loader), else the embedded model's preset."""
    if args.config:
        return load_preset(args.config)
    model = args.model
    if model is None or model.lower() in ("smollm2-135m", "smollm2", "smollm2-135m-instruct"):
        return load_preset("smollm2-135m")
    p = Path(model).expanduser()
    if p.is_dir() and (p / "config.json").is_file():
        return load_preset(p)
    if p.is_file() and p.suffix == ".gguf":
        from servescope.loader.source import load_model_source  # lazy: torch, gguf

        return load_model_source(str(p)).config  # reads (and dequantises) the weights too
    if model.lower() in list_presets():
        return load_preset(model)
    raise InvalidParameterError("model", f"{model!r} is not a model directory, a .gguf file or a preset "
                                         f"({', '.join(list_presets())})")


def run_explain(args) -> int:
    cfg = load_model_config(args)
    hw = hardware_spec(args.hardware)
    result = explain(cfg, hw, batch=args.batch, prompt_len=args.prompt_len, output_len=args.output_len,
                     weight_dtype=args.dtype, kv_dtype=args.kv_dtype, memory_bytes=args.memory)
    if args.speculative:
        if not 0.0 <= args.acceptance <= 1.0:
            raise InvalidParameterError("acceptance", f"must be between 0 and 1, got {args.acceptance}")
        result["speculative"] = explain_speculative(
            cfg, hw, args.speculative, args.spec_k, args.acceptance, args.prompt_len + args.output_len // 2,
            weight_dtype=args.dtype, kv_dtype=args.kv_dtype, draft_weight_dtype=args.draft_dtype)
    if max(args.tp, args.ep) * args.pp > 1:
        result["parallel"] = explain_parallel(cfg, hw, explain_link(hw, args.link), args.tp, args.pp,
                                              batch=args.batch, prompt_len=args.prompt_len,
                                              output_len=args.output_len, weight_dtype=args.dtype,
                                              kv_dtype=args.kv_dtype, micro_batches=max(0, args.micro_batches),
                                              ep=args.ep)
    if args.plot:
        result["plot"] = str(plot_explain(result, hw, args.plot))
    if args.measure:
        from servescope.labs.workload import measure_workload  # lazy: the engine, torch

        model = args.model if args.model else (f"random:{args.config}" if args.config else None)
        result["measure"] = measure_workload(model, args.batch, args.prompt_len, args.output_len,
                                             weight_dtype=args.dtype, kv_dtype=args.kv_dtype, threads=args.threads)
    if args.json:
        sys.stdout.write(json.dumps(result, indent=2, default=str) + "\n")
        return 0
    con = console()
    con.print(render_explain_table(result))
    if "parallel" in result:
        con.print(parallel_table(result["parallel"]))
        if result["parallel"]["pp"] > 1:
            con.print(kv_stage_table(result["parallel"]))
        con.print(result["parallel"]["verdict"])
    if args.plot:
        con.print(f"roofline written to {result['plot']}")
    if args.measure:
        con.print(measure_table(result["measure"]))
    if args.speculative:
        con.print(speculative_table(result["speculative"]))
    return 0


def speculative_table(s: dict):
    """Predicted speed-up of speculative decoding per batch size, and where it stops paying."""
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    cross = s["crossover_batch"]
    t = Table(title=f"speculative decoding ({s['method']}, k={s['k']}, acceptance {s['acceptance']:.2f}: "
                    f"{s['expected_tokens_per_step']:.2f} tokens per verification; "
                    + ("pays at every batch listed)" if cross is None else f"stops paying at batch {cross})"))
    for col in ("batch", "step without", "verify step", "proposer", "speed-up", "best k", "best speed-up"):
        t.add_column(col, justify="right")
    for r in s["rows"]:
        t.add_row(str(r["batch"]), f"{r['base_step_seconds'] * 1e3:.2f} ms", f"{r['verify_step_seconds'] * 1e3:.2f} ms",
                  f"{r['propose_seconds'] * 1e3:.2f} ms", f"{r['speedup']:.2f}x", str(r["best_k"]),
                  f"{r['best_speedup']:.2f}x")
    return t


def explain_link(hw, name):
    """The link for explain --tp/--pp: named, the GPU's default, or the local gloo link (measured once)."""
    if hw.kind == "gpu" or (name and name != LOCAL_GLOO):
        return get_link(name or DEFAULT_LINK.get(hw.name, "pcie4"))
    from servescope.measure.local_hardware import local_gloo_link  # lazy: the engine, torch (2 s of explain)

    return local_gloo_link(measure=True)


def parallel_table(p: dict):
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    ep = f" with EP={p['ep']}" if p.get("ep", 1) > 1 else ""
    t = Table(title=f"TP={p['tp']} x PP={p['pp']}{ep} over {p['link']['name']} "
                    f"({p['link']['bandwidth'] / 1e9:.3g} GB/s, {p['link']['latency_s'] * 1e6:.3g} us per hop): "
                    f"{p['weight_bytes_per_rank'] / 2**30:.3g} GiB weights and "
                    f"{p['kv_cache_bytes_per_token_per_rank'] / 1024:.3g} KiB KV per token per rank; "
                    f"{p['max_concurrent_sequences']} sequences fit (one device: "
                    f"{p['max_concurrent_sequences_one_device']})")
    a2a = ["all-to-all"] if ep else []  # (expert parallelism's dispatch and combine)
    for col in ("phase", "one device", "compute/rank", "all-reduce", "gather", *a2a, "p2p", "step", "speedup", "comm"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    keys = ("single_device_seconds", "compute_seconds", "all_reduce_seconds", "gather_seconds",
            *(["all_to_all_seconds"] if ep else []), "p2p_seconds", "step_seconds")
    for ph in p["phases"]:
        t.add_row(ph["name"], *(f"{ph[k] * 1e3:.3g} ms" for k in keys), f"{ph['speedup']:.2f}x",
                  f"{ph['comm_share']:.0%}")
    for ph in p["phases"]:
        pipe = ph.get("pipeline")
        if pipe:  # the schedule behind the step column
            t.add_row(f"  {ph['name']}: {pipe['micro_batches']} micro-batches",
                      f"fill {pipe['fill_seconds'] * 1e3:.3g} ms",
                      "busy " + "/".join(f"{b * 1e3:.3g}" for b in pipe["stage_busy_seconds"]) + " ms",
                      f"stall {pipe['stall_seconds'] * 1e3:.3g} ms", f"bubble {pipe['bubble_fraction']:.0%}",
                      f"hand-over {pipe['handover_seconds'] * 1e3:.3g} ms",
                      f"1 mb: {pipe['one_micro_batch_step_seconds'] * 1e3:.3g} ms",
                      f"{pipe['overlap_speedup']:.2f}x", "")
    return t


def kv_stage_table(p: dict):
    """Each pipeline stage's KV pools as its process allocates them (analysis/kv_stages.py): its layers per group,
    their bytes per token, the group's pool, and the stage that runs out first."""
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    size, stages = p["kv_block_size"], p["kv_stages"]
    t = Table(title=f"KV cache per stage: {p['kv_num_blocks']} blocks of {size} tokens sized from stage 0's layers; "
                    f"stage {p['kv_binding_stage']} runs out first")
    cols = ("stage", "layers", "groups: layers, KV per token, pool", "KV allocated / budget", "first group's limit")
    for col in cols:
        t.add_column(col, justify="left" if col.startswith("groups") else "right")
    for st in stages:
        groups = "; ".join(f"{'full' if not w else f'window {w}'}: {n}, {st['bytes_per_token'][w] / 1024:.3g} KiB, "
                           f"{st['pool_blocks'][w]} blocks ({st['pool_blocks'][w] * size} tokens)"
                           for w, n in st["group_layers"].items())
        limit = st["first_group_limit"]
        t.add_row(str(st["stage"]) + (" (binds)" if st["stage"] == p["kv_binding_stage"] else ""),
                  f"{st['first_layer']}-{st['first_layer'] + st['num_layers'] - 1}", groups,
                  f"{st['kv_bytes'] / 2**30:.3g} / {st['budget_bytes'] / 2**30:.3g} GiB",
                  "-" if limit is None else f"{limit} blocks")
    return t


def roofline_points(result: dict) -> list:
    """(label, intensity, predicted FLOP/s) of every op with FLOPs and bytes in every phase; ops of a
    phase at (nearly) the same point share one label ("D: qkv_proj, mlp, ...": decode's linear layers
    all have the same intensity, and separate labels would print on top of each other)."""
    groups: dict = {}
    for ph in result["phases"]:
        tag = "P" if ph["name"] == "prefill" else "D"
        for o in ph["ops"]:
            if o["flops"] > 0 and o["bytes"] > 0 and o["predicted_seconds"] > 0:
                x, y = o["arithmetic_intensity"], o["flops"] / o["predicted_seconds"]
                key = (tag, round(math.log10(x) * 20), round(math.log10(y) * 20))  # ~12% buckets
                g = groups.setdefault(key, {"names": [], "x": x, "y": y})
                g["names"].append(o["name"])
    return [(f"{tag}: {', '.join(g['names'])}", g["x"], g["y"]) for (tag, _, _), g in groups.items()]


def plot_explain(result: dict, hw, path) -> Path:
    """The hardware's roofline with each op of prefill (circles) and decode (squares) placed at its
    intensity and predicted FLOP/s, named in a legend."""
    from servescope.labs.common import plot_roofline_legend  # lazy: the labs import torch, matplotlib

    w = result["workload"]
    return plot_roofline_legend(hw, roofline_points(result), Path(path), w["act_dtype"],
                                f"{result['model']} on {hw.name}: batch {w['batch']}, prompt {w['prompt_len']}, "
                                f"{w['act_dtype']}")


def measure_table(m: dict):
    from rich.table import Table  # lazy: rich is 0.13 s of `--help` (cli/output.py)

    t = Table(title=f"measured on this machine vs predicted ({m['hardware']})")
    for col in ("phase", "steps", "measured", "predicted", "error"):
        t.add_column(col, justify="left" if col == "phase" else "right")
    for p in m["phases"]:
        t.add_row(p["name"], str(p["steps"]), f"{p['measured_seconds'] * 1e3:.2f} ms",
                  f"{p['predicted_seconds'] * 1e3:.2f} ms", f"{100 * p['error']:+.1f}%")
    return t


# --------------------------------------------------------------------------- labs

def run_lab_command(args) -> int:
    # lazy: the labs import the engine and torch, seconds of start-up even for `lab list`
    from servescope.labs import LABS, all_labs, run_lab
    from servescope.labs.common import LabOptions, LabSession

    con = console()
    labs = all_labs()
    if args.name == "list":
        width = max(len(n) for n in labs)
        for name, (_, desc) in labs.items():
            sys.stdout.write(f"{name:<{width}}  {desc}\n")
        return 0
    if args.name != "all" and args.name not in labs:
        return error(f"unknown lab {args.name!r}; labs: {', '.join(labs)}, all")
    names = list(LABS) if args.name == "all" else [args.name]
    base = Path(args.out) if args.out else Path("lab-out")
    session = None
    for name in names:
        out = base / name if (args.name == "all" or not args.out) else base
        opts = LabOptions(out=out, quick=args.quick, model=args.model, dtype=args.dtype,
                          quantization=args.quantization, threads=args.threads, hardware=args.hardware)
        session = session or LabSession(opts)
        with con.status(f"lab {name}: running..."):
            result = run_lab(name, opts, session)
        con.print(f"[bold]{name}[/bold] ({result.seconds:.0f} s): report {result.report}; plots: "
                  + ", ".join(str(p) for p in result.plots))
    return 0
