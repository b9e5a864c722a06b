"""Real 1 prefill + 1 decode disaggregation (engine/disaggregated.py) beside its simulation (sim/disagg.py).

The embedded SmolLM2-135M (or --model llama-3.2-1b: the 1B shape, random weights, fewer prompts), one torch
thread per engine (two processes on the machine's cores), its steps priced on the full probe with its kernels
timed at its shapes (measure/local_hardware.measured_engine: the engine's StepRecords and the simulation read
the same spec). First the plain engine (this process's, later the decode engine) is warmed up and its measured /
predicted step table profiled on workloads of its own (labs/sim_validation.profile_steps; its bins printed);
then the disaggregated pair serves each workload
on the wall clock (sim/driver.drive, the lab's WallClock: the same arrivals as the simulation), and the
simulator runs 1P1D of the same instance spec with that step table, the KV priced on the measured KV send path
(measure/kv_send.py: the engine's gather, gloo send/recv and scatter). Prints measured, simulated and the
error of median TTFT, median TPOT, p90 TTFT and output throughput per workload, then each request's TTFT cut
into its parts (the real hand-over's timelines, engine/disaggregated.py, beside sim/disagg.py's), as medians
over the workload's requests in ms:

    dispatch    arrival -> sent to the prefill process (a running decode step ends first: the engine thread takes
                requests between steps)
    wait        -> the prefill engine's first step with it (real, split: taken = until the prefill process reads
                it: its running step ends first)
    prefill     that step -> its token (all its chunks)
    hand-over   its token -> the KV in the decode process (held = until the receive starts, on both sides: the
                decode process acts between its steps; real, split: export = the blocks gathered, header = the
                announcement's trip, bytes = the gloo receive)
    admit       the KV in -> the decode engine's first step with it (real, split: notice = until the engine
                thread takes it (a running decode step finishes first), adopt = the copy into its cache)
    first step  the decode engine's step -> the first token
The simulator prices the whole hand-over as one transfer (measure/kv_send.py: gather, header, bytes and the
scatter), so its hand-over holds what the real one shows under admit as adopt: compare hand-over + admit.
    ttft        the sum

--co-run times this engine's steps alone and beside the prefill process while it prefills (two engine processes
on the machine's cores: the step table is profiled on this engine alone), as medians per kind of step.

--send-path first times the hand-over alone: one request at a time (nothing else running) at several prompt
lengths, the parts above per length, the bytes and what the simulator prices the transfer at.

    python benchmarks/disagg_1p1d.py --json benchmarks/results/disagg_1p1d.json
    python benchmarks/disagg_1p1d.py --send-path --workloads   # the hand-over alone
    python benchmarks/disagg_1p1d.py --model llama-3.2-1b --json benchmarks/results/disagg_1p1d_1b.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import torch

from servescope.cli.output import write_json
from servescope.config import EngineConfig, SamplingParams
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.engine.disaggregated import DisaggregatedEngine
from servescope.engine.llm_engine import LLMEngine
from servescope.labs.sim_validation import WallClock, profile_steps
from servescope.measure.local_hardware import local_kv_link, measured_engine
from servescope.measure.detokenise import detokenise_cost
from servescope.sim.disagg import Disaggregated
from servescope.sim.driver import bench_result, drive
from servescope.sim.spec import HostCosts, instance_spec
from servescope.sim.step_table import StepTable, fit_step_table, step_bins
from servescope.sim.workload import synthetic_workload

BLOCKS, SEQS, BUDGET, MAX_LEN = 2048, 32, 512, 4096
# --model: (what the engine loads, the simulator's preset, profile repeats, workloads); each workload's
# (prompts, input lengths, output lengths, requests/s), sized to the model's speed on one thread
MODELS = {
    "smollm2-135m": (None, "smollm2-135m", 2, {
        "low rate": (24, (64, 256), (32, 96), 1.0),
        "long prompts": (12, (1024, 2048), (16, 48), 0.5),
        "saturation": (32, (64, 256), (48, 96), math.inf),
    }),
    "llama-3.2-1b": ("random:llama-3.2-1b", "llama-3.2-1b", 1, {
        "low rate": (8, (64, 256), (16, 32), 0.1),
        "long prompts": (4, (1024, 1536), (8, 16), 0.04),
        "saturation": (12, (64, 256), (16, 32), math.inf),
    }),
}
WORKLOADS = MODELS["smollm2-135m"][3]
SATURATION_PREFILLS = 16  # prompts of a profiled batch prefilled at once for one token, as the prefill process does
METRICS = ("median_ttft_ms", "median_tpot_ms", "p90_ttft_ms", "output_throughput")
SEND_LENGTHS = (64, 256, 1024, 2048)  # prompt tokens of --send-path (and of the profiled prompt tails)
SEND_REPEATS = 5
# part: (from stage, to stage) of a timeline; REAL_ONLY: the real hand-over's finer stages
PARTS = {"dispatch": ("arrival", "dispatched"), "wait": ("dispatched", "scheduled"),
         "prefill": ("scheduled", "prefilled"), "hand-over": ("prefilled", "landed"),
         "admit": ("landed", "decode_scheduled"), "first step": ("decode_scheduled", "first_token"),
         "ttft": ("arrival", "first_token")}
# the same wait on both sides under other stage names: (real stages, simulated stages)
BOTH = {"  held": (("prefilled", "announced"), ("prefilled", "receiving"))}
REAL_ONLY = {"  taken": ("dispatched", "received"), "  export": ("prefilled", "exported"),
             "  header": ("exported", "announced"), "  bytes": ("announced", "landed"),
             "  notice": ("landed", "adopting"), "  adopt": ("adopting", "adopted")}


def _med(values: list) -> float:
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    return 1e3 * values[len(values) // 2] if values else math.nan


def real_timelines(pair: DisaggregatedEngine, finished: list) -> list:
    """Each finished request's hand-over timeline with the decode engine's first step and first token."""
    out = []
    for f in finished:
        t = dict(pair.timelines.get(f.request_id, {}))
        if "landed" in t and f.metrics.token_times:
            t.update(decode_scheduled=f.metrics.first_scheduled_time, first_token=f.metrics.token_times[0])
            out.append(t)
    return out


def breakdown(real: list, sim: list) -> dict:
    """{part: (real median ms, simulated median ms or nan)}."""
    def part(ts, a, b):
        return _med([t[b] - t[a] for t in ts if t.get(a) is not None and t.get(b) is not None])
    rows = {name: (part(real, a, b), part(sim, a, b)) for name, (a, b) in PARTS.items()}
    for name, (a, b) in REAL_ONLY.items():
        rows[name] = (part(real, a, b), math.nan)
    for name, ((a, b), (c, d)) in BOTH.items():
        rows[name] = (part(real, a, b), part(sim, c, d))
    order = ["dispatch", "wait", "  taken", "prefill", "hand-over", "  held", "  export", "  header", "  bytes",
             "admit", "  notice", "  adopt", "first step", "ttft"]
    return {name: rows[name] for name in order}


def print_breakdown(title: str, rows: dict) -> None:
    print(f"{title}: median ms per part   measured  simulated")
    for name, (real, sim) in rows.items():
        print(f"  {name:<14}{real:>10.1f}{'' if math.isnan(sim) else f'{sim:>11.1f}'}")


def profile(engine: LLMEngine, vocab: int, repeats: int) -> tuple:
    """(the step table, the steps it was fitted on): the lab's profile (labs/sim_validation.profile_steps)
    plus the decode engine's own first steps: a prompt's last partial block over its cached full blocks (each
    SEND_LENGTHS prompt run twice: the second time a prefix hit, as a landed transfer is; the lab's profile
    has no such step, so a tail over 2k cached tokens was priced like a 16-token prompt's prefill), and the
    prefill process's: SATURATION_PREFILLS prompts at once, each for its one token (budget-sized steps of a
    few prompts, one carried over from the step before; the lab's steps at those contexts and sizes are
    prefill chunks beside decodes)."""
    first = len(engine.step_records)
    profile_steps(engine, vocab, repeats=repeats)
    for rep in range(2):
        for n in SEND_LENGTHS:
            reqs = synthetic_workload(1, n - 7, 4, vocab, math.inf, seed=4000 + 10 * rep + n)  # a 9-token tail
            for j in range(2):
                drive(WallClock(engine), reqs, prefix=f"tail-{rep}-{n}-{j}")
        reqs = synthetic_workload(SATURATION_PREFILLS, (64, 256), 1, vocab, math.inf, seed=4500 + rep)
        drive(WallClock(engine), reqs, prefix=f"prefills-{rep}")
    engine.kv_manager.reset_prefix_cache()
    records = list(engine.step_records)[first:]
    return fit_step_table(records, f"measured on {len(records)} engine steps (the lab's workloads, prompt tails, "
                                   "prefill batches)"), records


def print_bins(records: list) -> list:
    """The table's bins (sim/step_table.step_bins): each one's steps, their median measured / predicted and the
    ratio the table holds after the shrinkage towards its neighbours."""
    rows = step_bins(records)
    print("step table bins: kind, context, tokens (the bin's medians), steps, median measured / predicted -> "
          "the table's ratio")
    for r in rows:
        print(f"  {r['kind']:<8}{r['context']:>8.0f}{r['tokens']:>7.0f}{r['steps']:>5}{r['median']:>7.2f} -> "
              f"{r['ratio']:.2f}")
    return [{k: v for k, v in r.items() if k != "bin"} for r in rows]


def send_path(pair: DisaggregatedEngine, spec, link, vocab: int) -> dict:
    """The hand-over alone: SEND_REPEATS requests of each SEND_LENGTHS prompt, one at a time, each simulated
    alone too (the prefill and the first step on the step table, when one was profiled: the prefill process's
    steps with nothing beside them)."""
    out = {}
    for n in SEND_LENGTHS:
        reqs = synthetic_workload(SEND_REPEATS, n, 2, vocab, math.inf, seed=3000 + n)
        real, sim = [], []
        for j, r in enumerate(reqs):  # one in flight at a time: nothing else on either engine
            _, _, done = drive(WallClock(pair), [r], prefix=f"send-{n}-{j}")
            real += real_timelines(pair, done)
            sim_dep = Disaggregated(spec, 1, 1, kv_link=link, keep_steps=False)
            drive(sim_dep, [r])
            sim += sim_dep.timelines.values()
        rows = breakdown(real, sim)
        sent = real[0]["bytes"] if real else 0
        priced = 1e3 * sim_dep.transfer_time(sim_dep.sent_tokens(n))
        print_breakdown(f"send path, {n}-token prompt ({sent / 1e6:.2f} MB sent; the simulator prices "
                        f"the hand-over at {priced:.1f} ms)", rows)
        out[n] = {"bytes": sent, "priced_ms": priced, "parts_ms": {
            k.strip(): {"measured": r, "simulated": None if math.isnan(s) else s} for k, (r, s) in rows.items()}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", choices=list(MODELS), help="the model and its workloads")
    p.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--step-table", default=None, help="a table this script profiled before (skips the profile)")
    p.add_argument("--save-table", default=None, help="write the profiled table here")
    p.add_argument("--send-path", action="store_true", help="time the hand-over alone first (module docstring)")
    p.add_argument("--co-run", action="store_true", help="time this engine's steps beside the prefill process")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    model, preset, repeats, workloads = MODELS[a.model]
    config = EngineConfig(model=model, dtype="auto", num_threads=1, num_kv_blocks=BLOCKS, max_num_seqs=SEQS,
                          max_num_batched_tokens=BUDGET, max_model_len=MAX_LEN, hardware="local-cpu")
    torch.set_num_threads(1)  # the engines' threads, before the probe: its spec is keyed by them
    # the engine's kernels timed at the model's shapes (its KernelTable, cached after the first run): its
    # StepRecords and the simulation price steps on the same spec, the prefill of long prompts by its own kernels
    engine = measured_engine(config)
    hw = engine.hardware
    dtype = str(engine.dtype).replace("torch.", "")
    spec = instance_spec(preset, hw, dtype=dtype, cache=KVCacheConfig(num_kv_blocks=BLOCKS),
                         batching=BatchingConfig(max_num_seqs=SEQS, max_num_batched_tokens=BUDGET,
                                                 max_model_len=MAX_LEN),
                         host=HostCosts(*detokenise_cost(with_tokenizer=engine.tokenizer is not None)))
    vocab = spec.model.vocab_size
    out = {"model": a.model, "workloads": {}}
    if a.step_table or a.workloads:  # without either, --send-path's simulation prices steps on the cost model
        t0 = time.perf_counter()
        if a.step_table:
            table = StepTable.load(a.step_table)
        else:
            table, records = profile(engine, vocab, repeats)
            out["step_bins"] = print_bins(records)
        print(f"step table ready in {time.perf_counter() - t0:.0f} s", flush=True)
        if a.save_table:
            with open(a.save_table, "w") as f:
                json.dump(table.to_dict(), f)
        spec = spec.replace(step_table=table)
    link = local_kv_link(force=True)  # measured now, on this run's machine and load (then cached)
    print(f"KV link: {link.describe()}", flush=True)
    engine.kv_manager.reset_prefix_cache()
    pair = DisaggregatedEngine(engine)
    drive(WallClock(pair), synthetic_workload(8, (16, 600), 8, vocab, math.inf, seed=99), prefix="warm")
    out["machine"] = {"torch_threads_per_engine": torch.get_num_threads(), "kv_link": link.name,
                      "kv_link_bandwidth": link.bandwidth, "kv_link_latency_s": link.latency_s,
                      "kv_link_notes": link.notes, "load_average_at_start": os.getloadavg()}
    try:
        if a.co_run:
            out["co_run"] = co_run(pair, engine, vocab)
        if a.send_path:
            out["send_path"] = send_path(pair, spec, link, vocab)
        for i, name in enumerate(a.workloads):
            out["workloads"][name] = run_workload(pair, spec, link, name, workloads[name], i, vocab)
    finally:
        pair.shutdown()
    out["machine"]["load_average_at_end"] = os.getloadavg()
    print(f"load average (1, 5, 15 min) at the start {out['machine']['load_average_at_start']}, at the end "
          f"{out['machine']['load_average_at_end']} on {os.cpu_count()} cores", flush=True)
    if a.json:
        write_json(a.json, out)
    return 0


def _step_medians(engine: LLMEngine, reqs: list, prefix: str) -> dict:
    first = len(engine.step_records)
    drive(WallClock(engine), reqs, prefix=prefix)
    steps = list(engine.step_records)[first:]
    return {kind: _med([r.wall_seconds for r in steps if bool(r.num_prefill_tokens) == (kind == "prefill")])
            for kind in ("prefill", "decode")}


def co_run(pair: DisaggregatedEngine, engine: LLMEngine, vocab: int) -> dict:
    """Median step ms of one workload on this (the decode) engine alone, then again while the prefill process
    prefills long prompts: what two engine processes on the machine's cores cost each other."""
    work = lambda seed: synthetic_workload(4, 1024, 24, vocab, math.inf, seed=seed)  # noqa: E731
    alone = _step_medians(engine, work(5000), "alone")
    for j, r in enumerate(synthetic_workload(8, 2048, 1, vocab, math.inf, seed=5100)):  # seconds of prefill there
        pair.add_request(f"busy-{j}", list(r.prompt), SamplingParams(temperature=0.0, max_tokens=1))
    beside = _step_medians(engine, work(5001), "beside")
    busy = pair.num_unfinished - engine.num_unfinished  # the prompts not handed over yet at the end
    while pair.has_unfinished():
        pair.step()
    engine.kv_manager.reset_prefix_cache()
    print(f"co-run: median step ms alone / beside the prefill process ({busy} of its 8 prompts not handed over "
          "at the end): "
          + ", ".join(f"{k} {alone[k]:.1f} / {beside[k]:.1f} ({beside[k] / alone[k]:.2f}x)" for k in alone))
    return {"alone_ms": alone, "beside_ms": beside, "prefill_prompts_left": busy}


def run_workload(pair: DisaggregatedEngine, spec, link, name: str, workload: tuple, i: int, vocab: int) -> dict:
    n, inp, outp, rate = workload
    reqs = synthetic_workload(n, inp, outp, vocab, rate, seed=2000 + i)
    records, duration, done = drive(WallClock(pair), reqs, prefix=f"real-{i}")
    real = bench_result(records, duration).to_dict()
    sim_dep = Disaggregated(spec, 1, 1, kv_link=link, keep_steps=False)
    sim_records, sim_duration, _ = drive(sim_dep, reqs)
    sim = bench_result(sim_records, sim_duration).to_dict()
    row = {m: {"measured": real[m], "simulated": sim[m], "error": sim[m] / real[m] - 1} for m in METRICS}
    print(name, json.dumps(row, indent=1), flush=True)
    parts = breakdown(real_timelines(pair, done), list(sim_dep.timelines.values()))
    print_breakdown(name, parts)
    row["parts_ms"] = {k.strip(): {"measured": r, "simulated": None if math.isnan(s) else s}
                       for k, (r, s) in parts.items()}
    return row


if __name__ == "__main__":
    raise SystemExit(main())
