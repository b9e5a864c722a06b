"""The kernel table's projections, head and sampler timed at one loaded model's own shapes (measure/shape_kernels.py
times the rest and holds the timing settings; measure/kernel_cache.py assembles the table).

- the projections (CpuLinear, QuantLinear, ... whatever the engine's transforms put there; a sparse layer's MLP is its
  block, timed whole by moe_kernels.py) at ROWS rows in layer order, so the weights come from where a step finds
  them: all layers at a few rows (a decode step streams them), enough for PASS_BUDGET_S at many (compute-bound);
  per-call times share out the calls' back-to-back time. The head at HEAD_ROWS, each call after a one-row pass over
  every layer. In both, a row count that took longer than a larger one is timed again after the sweep (_sweep);
- the sampler's pick of greedy tokens from the head's float32 logits over the vocabulary at HEAD_ROWS rows
  (measure_sampling: a tiny model's vocabulary makes it nothing in the probe's host overhead).
The same call on a tiny shape (its dispatch: the probe's host overhead per layer has it) is subtracted.
"""

from __future__ import annotations

import logging
import math
import statistics
import time

import torch

from servescope.analysis.busy import CpuMeter
from servescope.config import SamplingParams
from servescope.measure import shape_kernels
from servescope.measure.shape_kernels import _median_of, _timed
from servescope.model.moe import SparseMoeBlock
from servescope.sampling.sampler import Sampler, SamplingState

logger = logging.getLogger(__name__)

# oneDNN's GEMM steps up at some row counts (a 2048-wide bfloat16 one here: +30% from 64 to 65 rows, +45%
# from 257 to 320): points on both sides of the steps seen, since a mixed step may have any count
ROWS = (1, 2, 3, 4, 6, 8, 9, 12, 16, 24, 32, 48, 64, 65, 80, 96, 128, 129, 160, 192, 256, 257, 320, 384, 448,
        512, 768, 1024, 2048)  # the last three: a whole prompt in one step (chunked prefill off)
HEAD_ROWS = (1, 2, 4, 8, 9, 16, 32, 64)
RETIME_TOLERANCE = 0.05  # a point this much slower than a larger row count is timed again (measure_linear_tables)
RETIME_ROUNDS = 2
TINY_VOCAB = 512  # the probe's host-overhead model's vocabulary (measure/overhead.py): its sampler's call


def _layer_projections(layer) -> list:
    attn = [("qkv_proj", layer.self_attn.qkv_proj), ("o_proj", layer.self_attn.o_proj)]
    if isinstance(layer.mlp, SparseMoeBlock):  # its block is timed whole (measure_moe_table)
        return attn
    return attn + [("gate_up_proj", layer.mlp.gate_up_proj), ("down_proj", layer.mlp.down_proj)]


def _inputs(cfg, rows: int, dtype) -> dict:
    gen = torch.Generator().manual_seed(rows)
    d, q, i = cfg.hidden_size, cfg.q_size, cfg.intermediate_size
    x = {w: (torch.randn(rows, w, generator=gen) * 0.5).to(dtype) for w in {d, q, i}}
    return {"qkv_proj": x[d], "o_proj": x[q], "gate_up_proj": x[d], "down_proj": x[i], "lm_head": x[d]}


def _pass(layers, xs: dict) -> list:
    """[(projection, seconds)] of one call per layer, each timed on its own, in layer order."""
    out = []
    for layer in layers:
        for name, mod in _layer_projections(layer):
            x = xs[name]
            out.append((name, _timed(lambda: mod(x))))
    return out


def _back_to_back(layers, xs: dict) -> float:
    """Seconds of one call per layer and projection, in layer order, with no timer between the calls."""
    calls = [(mod, xs[name]) for layer in layers for name, mod in _layer_projections(layer)]
    t0 = time.perf_counter()
    for mod, x in calls:
        mod(x)
    return time.perf_counter() - t0


def _per_call(runs: list) -> dict:
    """{projection: [seconds of each of its calls]}: each call's median over the runs (a time slice lost to
    another process on a shared machine hits one run of a call, not the median)."""
    out: dict = {}
    for j, (name, _) in enumerate(runs[0]):
        out.setdefault(name, []).append(statistics.median(r[j][1] for r in runs))
    return out


def call_overhead(dtype) -> float:
    """Seconds of one linear module's call on a 16 x 16 weight at one row: the dispatch a tiny call costs."""
    # lazy: CpuLinear packs panels with the extension, which measure_linear_tables has loaded by now
    from servescope.model.linears.cpu import CpuLinear

    lin = CpuLinear(torch.nn.Linear(16, 16, bias=False).to(dtype).requires_grad_(False))
    x = torch.randn(1, 16).to(dtype)
    for _ in range(20):
        lin(x)
    return statistics.median(_timed(lambda: lin(x)) for _ in range(200))


def measure_linear_tables(model, cfg, dtype) -> tuple:
    """({projection: [[rows, seconds per call], ...]} of the model's own linear modules, the CPUs its
    threads got while they ran: the share of the machine the measurement had).

    The rows are timed in order within a few seconds each, so a slow spell of a shared machine (this VM ran a
    fixed GEMM at half its speed for seconds at a time) lands on a run of neighbouring row counts, and the medians
    within a point cannot see it: a 1B shape's 192-257 rows came out at twice the time of 320, and a 186-token
    prefill was priced 28% over what it took. A larger row count does more of the same work, so a point that takes
    longer than one above it (by RETIME_TOLERANCE) is timed again once the sweep is over, up to RETIME_ROUNDS
    times, and keeps the quicker of its timings: a spell's points come down, a kernel's real step up stays."""
    layers = list(model.model.layers)
    meter = CpuMeter()
    overhead = call_overhead(dtype)
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    with torch.inference_mode():
        points = _sweep(ROWS, lambda rows: _time_rows(layers, cfg, dtype, rows, overhead))
        cpus = meter.window().cpus_got
        table = {n: [[rows, points[rows][n]] for rows in ROWS if n in points[rows]] for n in names}
        table["lm_head"] = _head_table(model, layers, cfg, dtype, overhead)
    for name, pts in table.items():
        if not pts:  # no layer has this projection (every MLP sparse): nothing of it runs
            table[name] = [[1, 0.0]]
    return table, cpus


def _sweep(counts, time_at) -> dict:
    """{rows: {name: seconds}} of time_at(rows) at each row count in order, then each count whose total took more
    than 1 + RETIME_TOLERANCE times a larger count's timed again (RETIME_ROUNDS rounds at most), keeping per name the
    quicker of its timings."""
    points = {rows: time_at(rows) for rows in counts}
    for _ in range(RETIME_ROUNDS):
        suspects = undercut_rows({rows: sum(t.values()) for rows, t in points.items()}, RETIME_TOLERANCE)
        if not suspects:
            break
        for rows in suspects:
            again = time_at(rows)
            logger.info("kernel table: %d rows took %.3g ms, more than a larger row count; again: %.3g ms", rows,
                        sum(points[rows].values()) * 1e3, sum(again.values()) * 1e3)
            points[rows] = {name: min(t, again[name]) for name, t in points[rows].items()}
    return points


def undercut_rows(totals: dict, tolerance: float) -> list:
    """The row counts (ascending) whose time is more than 1 + tolerance times that of some larger row count:
    {rows: seconds} of a sweep."""
    out, best = [], math.inf
    for rows in sorted(totals, reverse=True):
        if totals[rows] > best * (1 + tolerance):
            out.append(rows)
        best = min(best, totals[rows])
    return sorted(out)


def _time_rows(layers, cfg, dtype, rows: int, overhead: float) -> dict:
    """{projection: seconds per call} at `rows` rows: every layer up to ALL_LAYER_ROWS rows, else enough layers
    for PASS_BUDGET_S; per call the median over the runs, the calls' share of the passes' back-to-back time."""
    k = shape_kernels  # its settings read at the call (tests set smaller grids there)
    xs = _inputs(cfg, rows, dtype)
    _pass(layers[:2], xs)  # warm-up: first calls at this row count
    if rows <= k.ALL_LAYER_ROWS:
        subset = layers
    else:
        per_layer = sum(t for _, t in _pass(layers[:1], xs))
        subset = layers[:max(2, min(len(layers), math.ceil(k.PASS_BUDGET_S / max(per_layer, 1e-9))))]
    runs = k.RUNS if rows <= k.ALL_LAYER_ROWS else min(k.RUNS, k.LARGE_RUNS)
    calls = _per_call([_pass(subset, xs) for _ in range(runs)])
    # the calls back to back, as a step makes them, took longer than each timed on its own
    # (about 10% at a 1B shape's one-row GEMVs here): the pass's time, shared out by the calls'
    whole = statistics.median(_back_to_back(subset, xs) for _ in range(runs))
    scale = whole / sum(sum(c) for c in calls.values())
    out = {}
    for name, times in calls.items():  # per call of that projection (a sparse layer has no MLP rows)
        t = sum(times) / len(times) * scale
        out[name] = max(t - overhead, 0.2 * t)
    return out


def _head_table(model, layers, cfg, dtype, overhead: float) -> list:
    """The head at HEAD_ROWS, each call right after a one-row pass over every layer (untimed); swept as the
    projections are (_sweep)."""
    head, one = model.lm_head, _inputs(cfg, 1, dtype)

    def time_at(rows: int) -> dict:
        x = _inputs(cfg, rows, dtype)["lm_head"]
        head(x)
        times = []
        for _ in range(shape_kernels.RUNS):
            _pass(layers, one)
            times.append(_timed(lambda: head(x)))
        t = statistics.median(times)
        return {"lm_head": max(t - overhead, 0.2 * t)}

    points = _sweep(HEAD_ROWS, time_at)
    return [[rows, points[rows]["lm_head"]] for rows in HEAD_ROWS]


# --------------------------------------------------------------------------- sampling

def _sample_seconds(vocab: int, rows: int) -> float:
    """Seconds of the engine's Sampler picking `rows` greedy tokens from float32 logits [rows, vocab]."""
    sampler = Sampler(vocab)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows))
    states = [SamplingState.new(SamplingParams(temperature=0.0), [1], "cpu") for _ in range(rows)]
    with torch.inference_mode():
        return _median_of(lambda: sampler(logits, states), 4 * shape_kernels.RUNS)


def measure_sampling(cfg) -> list:
    """[[rows, seconds]] at HEAD_ROWS of the sampler over the model's vocabulary (greedy rows: the argmax every
    row pays; a sampled row's softmax and draw are not in it), less its call at one row of the probe's tiny
    vocabulary, which the host overhead per step already holds. At a 49152-token vocabulary, 32 rows took
    longer than the 135M model's attention."""
    tiny = _sample_seconds(TINY_VOCAB, 1)
    out = []
    for rows in HEAD_ROWS:
        t = _sample_seconds(cfg.vocab_size, rows)
        out.append([rows, max(t - tiny, 0.2 * t)])
    return out
