"""Lab `cluster`: Llama-3-70B on H100s, simulated (servescope.sim): where each layout saturates.

1. Colocated vs disaggregated at the same devices: 2 colocated TP-8 replicas against 1 prefill + 1
   decode TP-8 instance (16 H100s), goodput under the SLOs as the request rate grows.
2. Data-parallel scaling per router: 1, 2, 4, 8 TP-8 replicas (8..64 H100s) behind round-robin,
   least-tokens and prefix-aware routing, on a multi-turn workload (sessions whose turns extend each
   other, so a replica that served a session holds its prefix): the highest rate each meets the SLOs at
   (bisection on the rate), i.e. where it saturates.
The simulator's error against the engine on this machine (lab `simulate`, docs/VALIDATION.md) is
printed beside: these are predictions of a model validated at 135M and 1B on one CPU, not measurements.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from servescope.config.engine import BatchingConfig, ParallelConfig
from servescope.labs.common import LabOptions, LabResult, LabSession, md_table, new_figure, save_figure, write_report
from servescope.sim.cluster import ROUTERS, Deployment
from servescope.sim.disagg import Disaggregated
from servescope.sim.run import simulate
from servescope.sim.search import attainment
from servescope.sim.spec import describe, instance_spec
from servescope.sim.workload import SimRequest, synthetic_workload

MODEL, HARDWARE, TP = "llama-3-70b", "H100", 8
SLOS = {"ttft": 2000.0, "tpot": 100.0}
TARGET = 0.9
DURATION_S = 30.0  # seconds of arrivals per point
QUICK_DURATION_S = 15.0  # --quick: half the requests per point, the same rates, layouts and routers
VALIDATION = Path("lab-out/simulate/results.json")


def _spec():
    return instance_spec(MODEL, HARDWARE, parallel=ParallelConfig(tensor_parallel_size=TP),
                         batching=BatchingConfig(max_num_seqs=128, max_num_batched_tokens=4096))


def _synthetic(rate: float, vocab: int, seed: int, duration: float) -> list:
    return synthetic_workload(max(int(rate * duration), 20), (1024, 3072), (128, 512), vocab, rate, seed=seed)


def _sessions(rate: float, vocab: int, seed: int, duration: float) -> list:
    """Multi-turn chats: each session's turn t sends its whole history (previous turns' prompts and
    answers stand in as one growing token stream) plus a new question; turns of a session arrive in order."""
    rng = random.Random(seed)
    n = max(int(rate * duration), 20)
    num_sessions = max(n // 4, 1)
    streams = [[rng.randrange(vocab) for _ in range(6144)] for _ in range(num_sessions)]
    turns = [0] * num_sessions
    out, t = [], 0.0
    for _ in range(n):
        t += rng.expovariate(rate)
        s = rng.randrange(num_sessions)
        turns[s] += 1
        length = min(1024 + 1024 * turns[s], 6000)
        out.append(SimRequest(t, tuple(streams[s][:length]), rng.randint(128, 384), str(s)))
    return out


def _point(make_deployment, requests) -> dict:
    run = simulate(make_deployment(), requests, goodput=SLOS)
    r = run.result
    return {"rate": len(requests) / requests[-1].arrival if requests[-1].arrival else 0.0,
            "goodput": r.request_goodput, "attainment": attainment(run), "throughput": r.request_throughput,
            "p90_ttft_ms": r.ttft.percentiles_ms[90.0], "p90_tpot_ms": r.tpot.percentiles_ms[90.0],
            "sim_wall_s": run.wall_seconds}


def colocated_vs_disaggregated(spec, rates, duration: float) -> dict:
    vocab = spec.model.vocab_size
    layouts = {"2 x TP8 colocated": lambda: Deployment(spec, 2, "least-tokens", keep_steps=False),
               "1P + 1D x TP8": lambda: Disaggregated(spec, 1, 1, keep_steps=False)}
    return {name: [dict(_point(make, _synthetic(r, vocab, i, duration)), offered=r) for i, r in enumerate(rates)]
            for name, make in layouts.items()}


def saturation_rate(spec, replicas: int, router: str, lo: float, hi: float, steps: int, duration: float) -> float:
    """The highest offered rate (within [lo, hi], bisection) at which TARGET of the requests meet the SLOs."""
    vocab = spec.model.vocab_size
    ok = lambda rate: _point(lambda: Deployment(spec, replicas, router, keep_steps=False),  # noqa: E731
                             _sessions(rate, vocab, 7, duration))["attainment"] >= TARGET
    if not ok(lo):
        return 0.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def _validation_line() -> str:
    if not VALIDATION.is_file():
        return "(no validation results here: run `servescope lab simulate` first)"
    summary = json.loads(VALIDATION.read_text())["summary"]
    lines = []
    for mode in ("cost model", "step table"):
        errs = ", ".join(f"{k} {v:.1%}" for k, v in summary[mode]["max_abs_error"].items())
        lines.append(f"{mode}: largest errors {errs}; {summary[mode]['floors_met']} of {summary['floors_checked']} "
                     f"floors met")
    return f"simulator vs engine on this machine ({VALIDATION}): " + "; ".join(lines) + (
        ". The H100 runs use the cost model alone (no step table can be measured there from here).")


def _plot(cvd: dict, scaling: dict, out: Path) -> Path:
    fig, (a, b) = new_figure(ncols=2, size=(11, 4.2))
    for name, pts in cvd.items():
        a.plot([p["offered"] for p in pts], [p["goodput"] for p in pts], "o-", label=name)
    a.set_xlabel("offered rate (req/s)"), a.set_ylabel("goodput (req/s)"), a.legend(), a.grid(alpha=0.3)
    a.set_title(f"{MODEL}, 16 x {HARDWARE}: colocated vs disaggregated")
    for router, pts in scaling.items():
        a_x = sorted(pts)
        b.plot([8 * n for n in a_x], [pts[n] for n in a_x], "o-", label=router)
    b.set_xlabel("H100s (TP8 replicas)"), b.set_ylabel("saturation rate (req/s)"), b.legend(), b.grid(alpha=0.3)
    b.set_title("data-parallel scaling per router (multi-turn)")
    return save_figure(fig, out / "cluster.png")


def run(opts: LabOptions, session: LabSession) -> LabResult:
    spec = _spec()
    rates = [4.0, 12.0, 20.0] if opts.quick else [4.0, 8.0, 12.0, 16.0, 20.0, 24.0, 28.0]
    duration = QUICK_DURATION_S if opts.quick else DURATION_S
    cvd = colocated_vs_disaggregated(spec, rates, duration)
    replica_counts = [1, 2] if opts.quick else [1, 2, 4, 8]
    steps = 3 if opts.quick else 5
    # one replica: every router is the same
    single = saturation_rate(spec, 1, "least-tokens", 0.5, 12.0, steps, duration)
    scaling = {router: {n: single if n == 1 else saturation_rate(spec, n, router, 0.5 * n, 12.0 * n, steps, duration)
                        for n in replica_counts} for router in ROUTERS}
    plot = _plot(cvd, scaling, opts.out)
    rows = [[name, p["offered"], p["goodput"], f"{p['attainment']:.0%}", p["p90_ttft_ms"], p["p90_tpot_ms"]]
            for name, pts in cvd.items() for p in pts]
    srows = [[router] + [pts[n] for n in replica_counts] for router, pts in scaling.items()]
    sections = [
        ("Instance", describe(spec)),
        ("Colocated vs disaggregated (16 GPUs)", md_table(
            ["layout", "offered (req/s)", "goodput (req/s)", "within SLOs", "p90 TTFT (ms)", "p90 TPOT (ms)"], rows)),
        ("Saturation rate per router (req/s meeting the SLOs for 90% of requests)",
         md_table(["router"] + [f"{n} x TP8 ({8 * n} GPUs)" for n in replica_counts], srows)),
        ("Validation", _validation_line()),
    ]
    report = write_report(opts.out, f"Cluster: {MODEL} on {HARDWARE}s (simulated; SLOs {SLOS} ms)", sections, [plot],
                          results={"colocated_vs_disaggregated": cvd, "saturation": scaling, "slos": SLOS})
    return LabResult("cluster", opts.out, report, [plot], summary={"saturation": scaling})
