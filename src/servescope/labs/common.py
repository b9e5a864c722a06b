"""What every lab shares: options, an engine factory that loads the model once, workload drivers
that return the engine's own StepRecords, and small report/plot helpers.

A lab measures with the engine itself (`LLMEngine.step_records`: wall time and the cost model's
prediction of each step), never with a separate timing harness, so a lab checks the same numbers
a user sees in `servescope generate` and in traces.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from servescope.analysis.bandwidth import bandwidth_origin
from servescope.analysis.roofline import attainable_flops
from servescope.config import EngineConfig, SamplingParams
from servescope.engine.llm_engine import LLMEngine
from servescope.measure.local_hardware import (hardware_for_config, hardware_for_device, measured_engine,
                                               with_kernel_table)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LabOptions:
    out: Path  # the directory the report, plots and results.json go to
    # small sizes (tests, smoke runs): seconds on a tiny model, yet large enough, and repeated enough,
    # that each lab's effect shows there (tests/labs assert it); on a real model the plots stay rough
    quick: bool = False
    model: Optional[str] = None  # None: the embedded SmolLM2-135M
    dtype: str = "float32"
    quantization: Optional[str] = None  # weight-only quantization of the model (EngineConfig's modes)
    threads: Optional[int] = None  # torch threads (None: torch's default)
    hardware: Optional[str] = None  # spec the engine predicts with (None: the local CPU probe)
    seed: int = 0


@dataclass
class LabResult:
    name: str
    out: Path
    report: Path
    plots: list = field(default_factory=list)
    summary: dict = field(default_factory=dict)  # the headline numbers (also in results.json)
    seconds: float = 0.0


# --------------------------------------------------------------------------- engines

class LabSession:
    """Builds engines for the labs, loading the model weights once per (model, dtype, device).

    Each engine has its own KV cache, scheduler and config (chunking on or off, no KV cache, ...),
    but they share one nn.Module (`LLMEngine.with_config`): the model holds no per-request state.
    """

    def __init__(self, opts: LabOptions):
        self.opts = opts
        self._loaded: dict = {}  # (model, dtype, device) -> (first engine, the flat settings it was built with)

    def engine(self, **config_overrides) -> LLMEngine:
        o = self.opts
        # no tokenizer: the labs feed and read token ids (loading SmolLM2's costs 5 s here); no prefix
        # cache: random prompts share nothing, and a hit would shorten a measured prefill
        settings = {"model": o.model, "dtype": o.dtype, "quantization": o.quantization, "num_threads": o.threads,
                    "hardware": o.hardware, "seed": o.seed, "enable_prefix_caching": False, "skip_tokenizer_init": True,
                    **config_overrides}
        cfg = EngineConfig(**settings)
        key = (cfg.model, cfg.dtype, cfg.device)
        if key not in self._loaded:
            engine = measured_engine(cfg)
            self._loaded[key] = (engine, settings)
            return engine
        first, first_settings = self._loaded[key]
        # with_config changes only the settings it is given; every one that the first engine's lab or
        # this one set is given, with this lab's value (or the default), so the new engine's config is
        # exactly `cfg`, whatever the first lab asked for (no_kv_cache, chunking off, ...)
        changed = {k: getattr(cfg, k) for k in {**first_settings, **settings}}
        return with_kernel_table(first.with_config(hardware_spec=hardware_for_config(cfg), **changed))


def blocks_for(tokens: int, block_size: int = 16, margin: int = 4) -> int:
    """KV blocks to hold `tokens` tokens in total (plus a few spare)."""
    return -(-int(tokens) // block_size) + margin


# --------------------------------------------------------------------------- workloads

def random_prompt(rng: random.Random, n: int, vocab_size: int) -> list:
    """n random token ids (no special ids at the bottom of the vocabulary); random so that no two
    prompts share a prefix and the prefix cache never shortens a measurement."""
    lo = min(100, vocab_size // 2)
    return [rng.randrange(lo, vocab_size) for _ in range(n)]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def run_to_completion(engine, prompts: Sequence[list], max_tokens, prefix: str = "r") -> tuple:
    """Queue every prompt, step until all finish. Returns (final RequestOutputs in order, the
    StepRecords of these steps). max_tokens: one for all, or one per prompt."""
    first_step = engine.step_records[-1].step + 1 if engine.step_records else 1
    ids = [f"{prefix}{i}-{time.perf_counter_ns()}" for i in range(len(prompts))]
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    for rid, p, limit in zip(ids, prompts, limits, strict=True):
        engine.add_request(rid, p, greedy(limit))
    final = {}
    while len(final) < len(ids):
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        if not engine.has_unfinished() and len(final) < len(ids):
            raise RuntimeError("the engine stopped with requests unfinished")
    recs = [r for r in engine.step_records if r.step >= first_step]
    return [final[i] for i in ids], recs


def warm_up(engine, rng: random.Random, prompt_len: int = 32, batch: int = 2, max_tokens: int = 4) -> None:
    """One small run so that first-call costs (allocator, thread pool, kernel choice) are paid."""
    vocab = engine.model_config.vocab_size
    run_to_completion(engine, [random_prompt(rng, prompt_len, vocab) for _ in range(batch)], max_tokens, "warm")


def decode_only_records(engine, rng: random.Random, batch: int, prompt_len: int, steps: int, prefix: str) -> list:
    """Run `batch` random prompts of prompt_len tokens for steps + 1 new tokens each; the StepRecords of the
    steps where all `batch` sequences decode."""
    vocab = engine.model_config.vocab_size
    prompts = [random_prompt(rng, prompt_len, vocab) for _ in range(batch)]
    _, recs = run_to_completion(engine, prompts, steps + 1, prefix)
    return [r for r in recs if r.phase == "decode" and r.num_decode_seqs == batch]


def decode_sweep(session, sizes: Sequence, rounds: int, seed: int, prompt_len: int, steps: int,
                 min_batched_tokens: int, prefix: str = "") -> tuple:
    """(engine, {batch: decode-only StepRecords}) of one engine sized for the largest batch, warmed up, the
    batch sizes measured interleaved `rounds` times (the decode-vs-batch labs)."""
    max_b = max(sizes)
    engine = session.engine(max_num_seqs=max_b, max_num_batched_tokens=max(max_b * prompt_len, min_batched_tokens),
                            num_kv_blocks=max_b * blocks_for(prompt_len + steps + 1, margin=1) + 8,
                            max_model_len=prompt_len + steps + 16)
    rng = random.Random(seed)
    warm_up(engine, rng, prompt_len=prompt_len)
    by_b = interleaved(sizes, rounds, lambda b, rnd: decode_only_records(engine, rng, b, prompt_len, steps,
                                                                         f"{prefix}b{b}r{rnd}-"))
    return engine, {b: sum(runs, []) for b, runs in by_b.items()}


def interleaved(points: Sequence, rounds: int, measure: Callable) -> dict:
    """{point: [measure(point, round) for each round]}, the points measured in turn `rounds` times
    (1, 2, ..., n, then again): a slow or fast phase of a shared machine lasts seconds, long enough
    to bias every run of one point if its runs came one after another."""
    out = {p: [] for p in points}
    for rnd in range(rounds):
        for p in points:
            out[p].append(measure(p, rnd))
    return out


def seqs_of(rec) -> Optional[list]:
    """[(num_new_tokens, context_before)] of a pure-decode step or a single-sequence prefill step,
    rebuilt from its record (a StepRecord keeps context lengths after the step); None otherwise."""
    if rec.phase == "decode":
        return [(1, c - 1) for c in rec.context_lens]
    if rec.phase == "prefill" and rec.num_prefill_seqs == 1 and len(rec.context_lens) == 1:
        n = rec.num_prefill_tokens
        return [(n, rec.context_lens[0] - n)]
    return None


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else math.nan


def percentile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return math.nan
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def rel_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured."""
    return (predicted - measured) / measured if measured else math.nan


def lab_hardware(opts: LabOptions, engine):
    """The spec `engine` predicts with (the one its StepRecords use). Call it after building the
    engine: the local probe is keyed by torch's thread count, which the engine sets."""
    return hardware_for_device(engine.device, opts.hardware)


def act_dtype_name(opts: LabOptions) -> str:
    return "float32" if opts.dtype in ("float32", "auto") else opts.dtype


# --------------------------------------------------------------------------- output

def md_table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    def cell(v) -> str:
        if isinstance(v, float):
            if math.isnan(v):
                return "-"
            return f"{v:.4g}"
        return str(v)

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_report(out: Path, title: str, sections: Sequence[tuple], plots: Sequence[Path] = (),
                 results: Optional[dict] = None, footer: str = "") -> Path:
    """report.md: a title, then (heading, markdown body) sections, the plots inline; results.json
    beside it holds the raw numbers. Both are written whole (temp file + rename)."""
    out.mkdir(parents=True, exist_ok=True)
    parts = [f"# {title}", ""]
    for heading, body in sections:
        parts += [f"## {heading}", "", body.strip(), ""]
    if plots:
        parts += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    if footer:
        parts += [footer.strip(), ""]
    path = out / "report.md"
    _atomic_write(path, "\n".join(parts))
    if results is not None:
        _atomic_write(out / "results.json", json.dumps(_finite(results), indent=2, default=_json_default,
                                                       allow_nan=False))
    return path


def _finite(o):
    """A copy with every non-finite float as None (JSON has no NaN or Infinity)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if isinstance(o, float) and not math.isfinite(o):
        return None
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def new_figure(ncols: int = 1, nrows: int = 1, size: tuple = (6.0, 4.2)):
    """A matplotlib Figure on the Agg canvas (never touches pyplot's global backend) and its axes."""
    # imported here, not at the top: matplotlib takes 0.4 to 1.9 s to import on the 2-core dev VM, and
    # the labs' plain helpers (workload drivers, tables) serve CLI paths that draw nothing
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), dpi=100)
    FigureCanvasAgg(fig)
    axes = [fig.add_subplot(nrows, ncols, i + 1) for i in range(ncols * nrows)]
    return fig, axes


def save_figure(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(str(path))
    return path


def plot_roofline_legend(hw, points: Sequence[tuple], path: Path, dtype: str, title: str) -> Path:
    """The roofline of `hw` with (label, intensity FLOP/B, FLOP/s) points named in a legend rather
    than annotated (points crowd near the ridge and labels would print over each other).
    A label starting with "D" gets a square marker (decode), anything else a circle."""
    ridge = hw.ridge_point(dtype)
    xs_pts = [p[1] for p in points if p[1] > 0]
    lo, hi = min([ridge / 300] + [x / 3 for x in xs_pts]), max([ridge * 30] + [x * 3 for x in xs_pts])
    xs = [lo * (hi / lo) ** (k / 199) for k in range(200)]
    fig, (ax,) = new_figure(1, size=(9.0, 5.5))
    ax.loglog(xs, [attainable_flops(hw, x, dtype) for x in xs], color="black", linewidth=2,
              label=f"roofline: {hw.flops(dtype) / 1e9:,.0f} GFLOP/s, {hw.memory_bandwidth / 1e9:,.1f} GB/s")
    ax.axvline(ridge, color="gray", linestyle=":", linewidth=1, label=f"ridge {ridge:.1f} FLOP/B")
    for label, x, y in points:
        if x > 0 and y > 0 and math.isfinite(x):
            ax.plot([x], [y], marker="s" if str(label).lower().startswith("d") else "o", linestyle="none",
                    markersize=8, alpha=0.8, label=str(label))
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(title)
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    return save_figure(fig, Path(path))


def context_line(opts: LabOptions, engine, hw) -> str:
    """One line naming what ran where, for every report."""
    try:
        load = (f" Load average at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs "
                "(timings are noisy when it exceeds the thread count).")
    except OSError:
        load = ""
    quant = f", {opts.quantization}" if opts.quantization else ""
    origin = bandwidth_origin(hw)
    return (f"Model `{engine.model_config.name or engine.source_path}` ({opts.dtype}{quant}, "
            f"{engine.weight_bytes / 2**20:.0f} MiB of weights, {engine.model_config.num_hidden_layers} layers), "
            f"torch {torch.__version__} with {torch.get_num_threads()} threads; predictions: roofline of "
            f"`{hw.name}` ({hw.flops(act_dtype_name(opts)) / 1e9:.0f} GFLOP/s {act_dtype_name(opts)}, "
            f"{hw.memory_bandwidth / 1e9:.1f} GB/s{', probed' if hw.kind == 'cpu' else ''}"
            + (f"; {origin}" if origin else "") + ")."
            + load + (" **Quick mode: tiny sizes, the effect may not show.**" if opts.quick else ""))


Runner = Callable[[LabOptions, LabSession], LabResult]
