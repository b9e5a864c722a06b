"""Lab `simulate`: the simulator against the engine, on the same workloads, on this machine.

Each workload runs twice: for real, on the engine (LLMEngine in this process, requests added at their
arrival times on the wall clock between steps, as the server's engine thread takes them), and
simulated (servescope.sim: the same Scheduler and KVCacheManager on a virtual clock, steps priced by
the cost model on the local probe, its host overhead per step, layer and sequence included, plus the
detokeniser's work per token: measure/detokenise.py, and the engine's work between two steps, measured on the
lab's profile). The same driver (sim/driver.py) sends both the same prompts
at the same times; both are summarised by bench/metrics.py. Nothing in the simulation is fitted to
these runs.

Why the engine in-process and not `bench serve` against `serve`: on two shared cores the HTTP client,
the event loop and the engine thread take turns on the cores the engine's kernels use, so a served
run measures the engine plus a load generator beside it; the simulator models the engine (the
difference is measured separately in docs/VALIDATION.md).

Floors (issue 40): median TTFT, median TPOT and output throughput within 10%, p90 TTFT within 20%.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from dataclasses import dataclass

from servescope.config import EngineConfig, SamplingParams
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.engine.llm_engine import LLMEngine
from servescope.measure.local_hardware import with_kernel_table
from servescope.measure.detokenise import detokenise_cost
from servescope.errors import InvalidParameterError
from servescope.labs.common import LabOptions, LabResult, LabSession, md_table, rel_error, write_report
from servescope.sim.cluster import Deployment
from servescope.sim.driver import bench_result, drive
from servescope.sim.engine import Finished
from servescope.sim.spec import HostCosts, describe, instance_spec
from servescope.sim.step_table import StepTable, between_steps_seconds, fit_step_table, record_shape
from servescope.telemetry.step_record import step_period
from servescope.sim.workload import synthetic_workload

FLOORS = {"median_ttft_ms": 0.10, "median_tpot_ms": 0.10, "output_throughput": 0.10, "p90_ttft_ms": 0.20}
NUM_KV_BLOCKS = 2048
MAX_NUM_SEQS = 32
TOKEN_BUDGET = 512
PROFILE_REPEATS = 2
REAL_REPEATS = 2  # each workload measured twice: the spread says how far a floor can be trusted here
SENSITIVITY = 0.05  # the uniform step-time error whose effect on each metric the report shows (sensitivity())


@dataclass(frozen=True)
class Workload:
    name: str
    num_prompts: int
    input_len: object  # N or (lo, hi)
    output_len: object
    request_rate: float
    max_concurrency: object = None


# per model: (engine model name, simulator preset, workloads); sized to the model's speed on 2 cores. 135M's long
# prompts (~1.3 s of 512-token chunks each) arrive at 0.15 req/s, ~35% busy: at 0.5 req/s the engine was ~90% busy,
# where whether a request's last tokens meet the next prompt's chunks (~450 ms a step) or run alone (~15 ms) turns
# on a few ms: its median TPOT moved 3-6% per 1% of step time and two identical engine runs came out 38-50% apart
# (docs/VALIDATION.md). 1B's four (~10 s each) run nearly back to back, a knee the report's sensitivity shows; their
# steps are long enough to be priced within a few percent. Saturation is the queueing workload.
MODELS = {
    "smollm2-135m": (None, "smollm2-135m", (
        Workload("low rate", 24, (64, 256), (32, 96), 1.0),
        Workload("saturation", 48, (64, 256), (48, 96), math.inf),
        Workload("long prompts", 12, (1024, 2048), (16, 48), 0.15),
    )),
    "llama-3.2-1b": ("random:llama-3.2-1b", "llama-3.2-1b", (
        Workload("low rate", 8, (64, 256), (16, 48), 0.1),
        Workload("saturation", 16, (64, 256), (24, 48), math.inf),
        Workload("long prompts", 4, (1024, 1536), (8, 24), 0.05),
    )),
}
QUICK = {"smollm2-135m": MODELS["smollm2-135m"]}


class WallClock:
    """sim/driver.Served over a real LLMEngine: perf_counter time, requests added between steps."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine

    def now(self) -> float:
        return time.perf_counter()

    def wait_until(self, t: float) -> None:
        delay = t - time.perf_counter()
        if delay > 0:
            time.sleep(delay)

    def add(self, request_id, prompt, max_tokens, arrival_time):
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        self.engine.add_request(request_id, list(prompt), params, arrival_time=arrival_time)

    def step(self) -> list:
        return [Finished(o.request_id, o.metrics, o.error) for o in self.engine.step() if o.finished]

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished()


def _engine(model, preset: str) -> LLMEngine:
    # no prefix cache, here and in the simulation: each workload runs twice on the same prompts, and the
    # second run must not find the first one's blocks (random prompts share nothing otherwise)
    return LLMEngine(EngineConfig(model=model, dtype="auto", num_kv_blocks=NUM_KV_BLOCKS, max_num_seqs=MAX_NUM_SEQS,
                                  max_num_batched_tokens=TOKEN_BUDGET, max_model_len=4096, hardware="local-cpu",
                                  enable_prefix_caching=False))


def _warm_up(engine: LLMEngine, vocab: int) -> None:
    """Every kernel path once (prefill chunks, decode batches) so that the first measured steps are not
    the first calls."""
    reqs = synthetic_workload(8, (16, 600), 8, vocab, math.inf, seed=99)
    drive(WallClock(engine), reqs, prefix="warm")


def profile_steps(engine: LLMEngine, vocab: int, seed: int = 1000, repeats: int = PROFILE_REPEATS) -> StepTable:
    """The measured / predicted table of this engine (sim/step_table.py), from workloads of its own: decode
    steps at batch 1..32 over ~128-token prompts and at batch 1..4 over ~1k and ~2k, prefill chunks of
    16..2048-token prompts."""
    first = len(engine.step_records)
    shapes = [(b, (96, 160), 16) for b in (1, 2, 4, 8, 16, 32)] + [(b, (n - 64, n + 64), 12) for n in (1024, 2048)
                                                                 for b in (1, 2, 4)]
    shapes += [(1, n, 2) for n in (16, 32, 64, 128, 256, 512, 1024, 2048)]
    for rep in range(repeats):  # medians over repeats: one sample per shape is at the mercy of noise
        for i, (batch, prompt, out) in enumerate(shapes):
            reqs = synthetic_workload(batch, prompt, out, vocab, math.inf, seed=seed + 100 * rep + i)
            drive(WallClock(engine), reqs, prefix=f"profile-{rep}-{i}")
    records = list(engine.step_records)[first:]
    return fit_step_table(records, f"measured on {len(records)} engine steps of the lab's own workloads")


def _measure(engine: LLMEngine, w: Workload, vocab: int, seed: int, label: str):
    """(bench serve's result, the requests, the engine's StepRecords of the run)."""
    reqs = synthetic_workload(w.num_prompts, w.input_len, w.output_len, vocab, w.request_rate, seed=seed)
    first = len(engine.step_records)
    records, duration, _ = drive(WallClock(engine), reqs, w.max_concurrency, prefix=f"real-{label}")
    return bench_result(records, duration), reqs, list(engine.step_records)[first:]


def _simulate(spec, w: Workload, reqs):
    """(bench serve's result, the simulated StepRecords)."""
    dep = Deployment(spec)
    records, duration, _ = drive(dep, reqs, w.max_concurrency)
    return bench_result(records, duration), dep.engines[0].steps


def sensitivity(spec, w: Workload, reqs, e: float = SENSITIVITY) -> dict:
    """How far a step-time error moves each metric: {metric: elasticity} of the simulation on `spec`'s step table,
    (metric with every step 1 + e times as long - with 1 - e) / (2 e x metric), and "busy": the simulated
    instance's step seconds over the run's duration. An elasticity of 1: the metric is off by as much as the steps
    are (TTFT, TPOT of an engine that keeps up); ~0: the offered load sets it (throughput below saturation); well
    above 1: the workload sits at a knee (a request's last tokens either meet another prompt's chunks or run alone),
    where a floor of 10% asks the step times for a few percent and the engine's own repeats drift apart."""
    if spec.step_table is None:
        raise InvalidParameterError("spec", "sensitivity() scales a step table; this spec has none")
    runs = {}
    for f in (1.0 - e, 1.0, 1.0 + e):
        dep = Deployment(spec.replace(step_table=spec.step_table.scaled(f)))
        records, duration, _ = drive(dep, reqs, w.max_concurrency)
        busy = sum(r.wall_seconds for r in dep.engines[0].steps) / duration
        runs[f] = bench_result(records, duration).to_dict(), busy
    base = runs[1.0][0]
    out = {k: (runs[1.0 + e][0][k] - runs[1.0 - e][0][k]) / (2 * e * base[k]) if base[k] else 0.0 for k in FLOORS}
    return out | {"busy": runs[1.0][1]}


def table_drift(records: list, table: StepTable) -> dict:
    """How far a run's steps were from the step table, per kind: {"decode": x, "prefill": y}, each the summed
    periods of the run's StepRecords of that kind (decode-only, or with prefill tokens) that carry a prediction
    over the table's summed price of them (the prediction times the table's ratio at the step's kind, tokens and
    context, as the simulator's clock takes it); None where the run had no such step. 1: the run's steps took what
    the profile's took, in total, as a TPOT or a TTFT sums them; 1.2: a fifth longer, whether the machine moved
    between the profile and the run or the workload's steps differ from the profile's. A metric's miss with both
    at 1 is the scheduling's (which steps ran), not the step times'."""
    periods, prices = {"decode": 0.0, "prefill": 0.0}, {"decode": 0.0, "prefill": 0.0}
    for i, r in enumerate(records):
        if not r.predicted_seconds or r.wall_seconds <= 0 or not r.context_lens:
            continue
        kind, context = record_shape(r)
        periods[kind] += step_period(records, i)
        prices[kind] += r.predicted_seconds * table.ratio(kind == "decode", r.num_tokens, context)
    return {k: periods[k] / prices[k] if prices[k] > 0 else None for k in periods}


def step_kinds(real_steps: list, sim_steps: list) -> list:
    """Which steps a workload ran, by kind (decode-only or with prefill tokens) and sequences in the step (bins: 1,
    2, 3-4, 5-8, ...; "seqs" the bin's upper end): per kind the engine's steps, their median period (start to the
    next step's start, as a TPOT counts it) and its median over the step's prediction, and the simulator's steps
    and their median seconds. Where a simulated metric misses, this says whether the steps are priced wrong (the
    ratio) or the simulation ran other steps (the counts)."""
    kinds: dict = {}
    for i, r in enumerate(real_steps):
        if r.predicted_seconds:
            period = step_period(real_steps, i)
            kinds.setdefault(_kind(r), ([], []))[0].append((period, period / r.predicted_seconds))
    for r in sim_steps:
        kinds.setdefault(_kind(r), ([], []))[1].append(r.wall_seconds)
    out = []
    for (kind, seqs), (real, sim) in sorted(kinds.items()):
        out.append({"kind": kind, "seqs": seqs, "engine steps": len(real),
                    "engine period ms": statistics.median(p for p, _ in real) * 1e3 if real else None,
                    "measured / predicted": statistics.median(q for _, q in real) if real else None,
                    "simulated steps": len(sim), "simulated ms": statistics.median(sim) * 1e3 if sim else None})
    return out


def _kind(r) -> tuple:
    """(decode or prefill, the step's sequences as a power-of-two bin: 1, 2, 3-4, 5-8, ... by its upper end)."""
    seqs = r.num_prefill_seqs + r.num_decode_seqs
    return "prefill" if r.num_prefill_tokens else "decode", 1 << max(seqs - 1, 0).bit_length()


def _compare(reals: list, sims: dict) -> dict:
    """{metric: {measured (mean of the repeats), spread (max - min over mean), <mode>: simulated (mean over
    the same workloads), <mode> error}} for each simulation mode."""
    out = {}
    for k in FLOORS:
        vals = [r.to_dict()[k] for r in reals]
        m = sum(vals) / len(vals)
        out[k] = {"measured": m, "runs": vals, "spread": (max(vals) - min(vals)) / m if m else 0.0}
        for mode, results in sims.items():
            v = sum(x.to_dict()[k] for x in results) / len(results)
            out[k][mode] = v
            out[k][f"{mode} error"] = rel_error(v, m)
    return out


def _model_rows(name: str, model, preset: str, workloads, seed: int) -> tuple:
    # the engine's kernels timed at its model's shapes (cached after the first run): the simulator prices
    # its steps on the same spec, so the cost model is the engine's own, shapes and all
    engine = with_kernel_table(_engine(model, preset))
    hw = engine.hardware
    dtype = str(engine.dtype).replace("torch.", "")
    spec = instance_spec(preset, hw, dtype=dtype, cache=KVCacheConfig(num_kv_blocks=NUM_KV_BLOCKS,
                                                                      enable_prefix_caching=False),
                         batching=BatchingConfig(max_num_seqs=MAX_NUM_SEQS, max_num_batched_tokens=TOKEN_BUDGET,
                                                 max_model_len=4096),
                         host=HostCosts(*detokenise_cost(with_tokenizer=engine.tokenizer is not None)))
    _warm_up(engine, spec.model.vocab_size)
    first = len(engine.step_records)
    table = profile_steps(engine, spec.model.vocab_size)
    # the engine's work between two steps, on the profile's back-to-back steps (not these runs)
    between = between_steps_seconds(list(engine.step_records)[first:])
    spec = spec.replace(host=dataclasses.replace(spec.host, per_step_s=between, source=f"{spec.host.source}; "
                                                 "between steps: the median over the profile's steps"))
    specs = {"cost model": spec, "step table": spec.replace(step_table=table)}
    out = []
    for i, w in enumerate(workloads):
        reals, sims, kinds, drift = [], {mode: [] for mode in specs}, None, []
        for rep in range(REAL_REPEATS):  # the same prompts and times: the spread is the machine's
            real, reqs, real_steps = _measure(engine, w, spec.model.vocab_size, seed + i, f"{seed + i}-{rep}")
            reals.append(real)
            drift.append(table_drift(real_steps, table))
            for mode, sp in specs.items():
                result, sim_steps = _simulate(sp, w, reqs)
                sims[mode].append(result)
                if kinds is None:  # the first run's steps against the cost model's
                    kinds = step_kinds(real_steps, sim_steps)
        out.append({"model": name, "workload": w.name, "rate": w.request_rate, "prompts": w.num_prompts,
                    "input_len": w.input_len, "output_len": w.output_len, "metrics": _compare(reals, sims),
                    "sensitivity": sensitivity(specs["step table"], w, reqs), "steps_over_table": drift,
                    "steps": kinds,
                    "step_table": table.to_dict()})
    engine.shutdown()
    return out, describe(spec)


def _table(rows: list, mode: str) -> str:
    headers = ["model", "workload", "rate (req/s)"]
    for k in FLOORS:
        headers += [f"{k} measured (spread)", "simulated", "error"]
    body = []
    for r in rows:
        line = [r["model"], r["workload"], r["rate"]]
        for k, floor in FLOORS.items():
            m = r["metrics"][k]
            err = m[f"{mode} error"]
            line += [f"{m['measured']:.4g} ({m['spread']:.0%})", m[mode],
                     f"{err:+.1%} {'ok' if abs(err) <= floor else 'MISS'}"]
        body.append(line)
    return md_table(headers, body)


def _sensitivity_table(rows: list) -> str:
    headers = ["model", "workload", "rate (req/s)", "simulated busy", *FLOORS,
               "engine steps / table: decode / prefill (each run)"]
    body = [[r["model"], r["workload"], r["rate"], f"{r['sensitivity']['busy']:.0%}"]
            + [f"{r['sensitivity'][k]:.2f}" for k in FLOORS]
            + [", ".join(" / ".join(_num(d[k]) for k in ("decode", "prefill")) for d in r["steps_over_table"])]
            for r in rows]
    return md_table(headers, body)


def _steps_table(rows: list) -> str:
    headers = ["model", "workload", "kind", "sequences", "engine steps", "engine period (ms)", "measured / predicted",
               "simulated steps", "simulated (ms)"]
    body = [[r["model"], r["workload"], k["kind"], _seqs_bin(k["seqs"]), k["engine steps"], _num(k["engine period ms"]),
             _num(k["measured / predicted"]), k["simulated steps"], _num(k["simulated ms"])]
            for r in rows for k in r["steps"]]
    return md_table(headers, body)


def _seqs_bin(hi: int) -> str:
    return str(hi) if hi <= 2 else f"{hi // 2 + 1}-{hi}"


def _num(x) -> str:
    return "-" if x is None else f"{x:.3g}"


def _met(rows: list, mode: str) -> int:
    return sum(abs(r["metrics"][k][f"{mode} error"]) <= f for r in rows for k, f in FLOORS.items())


def run(opts: LabOptions, session: LabSession) -> LabResult:
    models = QUICK if opts.quick else MODELS
    if opts.model:  # one of them, by name or by what the engine loads
        models = {k: v for k, v in MODELS.items() if opts.model in (k, v[0], v[1])}
        if not models:
            raise InvalidParameterError("model", f"lab simulate validates {', '.join(MODELS)}; got {opts.model!r}")
    rows, specs = [], []
    for name, (model, preset, workloads) in models.items():
        got, spec_line = _model_rows(name, model, preset, workloads, opts.seed)
        rows += got
        specs.append(f"- {name}: {spec_line}")
        table_path = opts.out / f"step_table-{name}.json"  # `simulate --step-table` reads it
        opts.out.mkdir(parents=True, exist_ok=True)
        table_path.write_text(json.dumps(got[0]["step_table"], indent=1))
    total = len(rows) * len(FLOORS)
    summary = {"floors_checked": total}
    for mode in ("cost model", "step table"):
        summary[mode] = {"floors_met": _met(rows, mode),
                         "max_abs_error": {k: max(abs(r["metrics"][k][f"{mode} error"]) for r in rows) for k in FLOORS}}
    sections = [("Simulated with the cost model alone (probe + measured host costs)", _table(rows, "cost model")),
                ("Simulated with a measured step table (profiled on other workloads first)",
                 _table(rows, "step table")),
                (f"How far a step-time error moves each metric (the step table's simulation with every step "
                 f"{1 - SENSITIVITY:g}x and {1 + SENSITIVITY:g}x as long: the metric's change over the steps', 1 = "
                 "as far; well above 1, the workload sits at a knee where no simulation, nor the engine's own "
                 "second run, keeps within 10%), and how far each run's steps were from the step table (their periods "
                 "over the table's price of them, summed per kind: 1 = as profiled)", _sensitivity_table(rows)),
                ("Steps by kind (each workload's first run; simulated: the cost model alone)", _steps_table(rows)),
                ("Instances simulated", "\n".join(specs)),
                ("Floors", f"cost model: {summary['cost model']['floors_met']} of {total}, step table: "
                           f"{summary['step table']['floors_met']} of {total} within their floors (median TTFT, "
                           f"median TPOT, output throughput 10%; p90 TTFT 20%); error = (simulated - measured) / "
                           f"measured; measured = the mean of {REAL_REPEATS} runs of the workload, "
                           "spread = (max - min) / mean of those runs (the same prompts at the same times: "
                           "the machine's noise)")]
    report = write_report(opts.out, "Simulator vs engine on this machine", sections,
                          results={"rows": rows, "summary": summary, "instances": specs})
    return LabResult("simulate", opts.out, report, summary=summary)
