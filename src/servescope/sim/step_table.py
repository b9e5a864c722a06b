"""A measured step-time table: how the engine's measured steps compare with the cost model's prediction.

The cost model predicts a step from FLOPs, bytes and measured kernel rates; on a given machine its
error depends on the kind of step, its size and its context (a decode step of 4 sequences at 2k cached
tokens each reads KV from memory that the probe's decode-attention kernel read from cache). A table
measured on the engine (labs/sim_validation.profile_steps, on workloads of its own) holds the median of
measured / predicted per kind (decode-only, or with prefill tokens), per power-of-two bin of the mean
context per sequence and per power-of-two bin of the step's tokens. The simulator multiplies each
prediction by the ratio at its kind, context and size: log-log interpolation along the tokens within a
context bin, then along the context between the nearest bins measured at that size (the nearest bin
outside them), as Vidur profiles operators before it simulates.

A bin's ratio is not trusted alone: its median log ratio, over n steps, is weighed n : PRIOR_STEPS against
its neighbours' (their medians weighed by their steps x exp(-d^2 / 2), d the distance in bins, so the bins
next to it count and those far away hardly do). A bin of one or two steps (a burst of load, a step unlike
the rest) moves the table by at most n / (n + PRIOR_STEPS) of its deviation from its neighbours; a bin of
many steps keeps close to its own median. This is the empirical-Bayes estimate of a bin's ratio when
neighbouring bins' ratios are alike, PRIOR_STEPS standing for the within-bin variance of the log ratio over
the variance of the bins' true log ratios around their neighbours'. Estimated on a profile of the 1P1D
benchmark (benchmarks/disagg_1p1d.py prints the bins, their steps, their medians and the table's ratios)
that quotient ran from 0.3 to unbounded with the estimator (standard deviation or median deviation), led by
the very tails it should guard against, so it is fixed: with 4, a bin of one shape's steps (each profiled
shape runs twice) keeps a third of its own weight, and the bins of the lab's swept shapes (12 to 47 steps)
three quarters or more. Without it, a prefill bin of two steps at 1.83x its prediction priced the 1P1D
prefill process's steps (several prompts at small contexts) far too slow: saturation's TTFT +32%.

"Measured" is the step's period: from its start to the next step's start when the engine stepped
again at once, so the work between two steps (the outputs handed back, the requests added) counts, as
it does in the engine's TPOT; a table therefore replaces HostCosts.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from servescope.errors import InvalidParameterError
from servescope.telemetry.step_record import step_period

KINDS = ("decode", "prefill")
PRIOR_STEPS = 4.0  # the neighbours' weight against a bin's own steps (module docstring)


def _interp(x: float, pts) -> float:
    """Log-log interpolation of ((x, y), ...) ascending at x; the end values outside."""
    if x <= pts[0][0]:
        return pts[0][1]
    if x >= pts[-1][0]:
        return pts[-1][1]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            f = math.log(x / x0) / math.log(x1 / x0) if x1 > x0 else 0.0
            return math.exp(math.log(y0) + f * (math.log(y1) - math.log(y0)))
    raise AssertionError("unreachable")


@dataclass(frozen=True)
class StepTable:
    """{kind: ((context, ((tokens, ratio), ...)), ...)}: contexts and tokens ascending, ratios > 0."""

    decode: tuple
    prefill: tuple
    source: str = ""

    def __post_init__(self):
        for kind in KINDS:
            rows = getattr(self, kind)
            ok = bool(rows) and [c for c, _ in rows] == sorted(c for c, _ in rows)
            for c, pts in rows:
                ok = ok and c >= 1 and bool(pts) and [t for t, _ in pts] == sorted(t for t, _ in pts) \
                    and all(t >= 1 and r > 0 for t, r in pts)
            if not ok:
                raise InvalidParameterError("step_table", f"{kind}: needs ((context >= 1, ((tokens >= 1, ratio > 0), "
                                                          f"...)), ...), both ascending")

    def ratio(self, decode_only: bool, tokens: int, context: float = 1.0) -> float:
        """Along the context between the rows whose token range holds `tokens` (a row measured at other
        sizes says little about this one); the rows nearest in tokens when none does."""
        rows = self.decode if decode_only else self.prefill
        near = [(c, pts) for c, pts in rows if pts[0][0] <= tokens <= pts[-1][0]]
        if not near:
            dist = lambda pts: min(abs(math.log(tokens / pts[0][0])), abs(math.log(tokens / pts[-1][0])))  # noqa: E731
            best = min(dist(pts) for _, pts in rows)
            near = [(c, pts) for c, pts in rows if dist(pts) == best]
        return _interp(max(context, 1.0), [(c, _interp(tokens, pts)) for c, pts in near])

    def scaled(self, factor: float) -> "StepTable":
        """The same table with every ratio times `factor` (every step `factor` times as long): what a uniform
        error in the step times does to a simulation (labs/sim_validation.py's sensitivity)."""
        if not factor > 0:
            raise InvalidParameterError("factor", f"must be > 0, got {factor}")
        rows = {k: tuple((c, tuple((t, r * factor) for t, r in pts)) for c, pts in getattr(self, k)) for k in KINDS}
        return StepTable(rows["decode"], rows["prefill"], f"{self.source} (x{factor:g})".lstrip())

    def to_dict(self) -> dict:
        table = {k: [[c, [list(p) for p in pts]] for c, pts in getattr(self, k)] for k in KINDS}
        return table | {"source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "StepTable":
        try:
            rows = {k: tuple((float(c), tuple((float(t), float(r)) for t, r in pts)) for c, pts in d[k]) for k in KINDS}
            return cls(rows["decode"], rows["prefill"], d.get("source", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidParameterError("step_table", f"not a step table: {e!r}") from None

    @classmethod
    def load(cls, path: str | Path) -> "StepTable":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise InvalidParameterError("step_table", f"cannot read {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise InvalidParameterError("step_table", f"{path} is not JSON: {e}") from None


def record_shape(r) -> tuple:
    """(kind: "decode" for a decode-only step, else "prefill"; the mean context per sequence before the step, at
    least 1) of a StepRecord with context_lens: what the table's ratio is looked up at."""
    return ("prefill" if r.num_prefill_tokens else "decode",
            max((sum(r.context_lens) - r.num_tokens) / len(r.context_lens), 1.0))


def _bins(records) -> dict:
    """{kind: {(context bin, tokens bin): [(context, tokens, measured / predicted), ...]}} of the records that
    carry a prediction."""
    records = list(records)
    bins: dict = {k: {} for k in KINDS}
    for i, r in enumerate(records):
        if not r.predicted_seconds or r.wall_seconds <= 0 or not r.context_lens:
            continue
        kind, context = record_shape(r)
        key = (int(math.log2(context)), int(math.log2(max(r.num_tokens, 1))))
        bins[kind].setdefault(key, []).append((context, r.num_tokens, step_period(records, i) / r.predicted_seconds))
    return bins


def _shrunk(bins: dict, prior_steps: float) -> dict:
    """{bin: ratio}: each bin's median log ratio, of n steps, weighed n : prior_steps against its neighbours'
    (their median log ratios weighed by their steps x exp(-d^2 / 2), d the distance in bins)."""
    medians = {k: statistics.median(x for _, _, x in v) for k, v in bins.items()}
    if not prior_steps or len(bins) < 2:
        return medians
    logs = {k: math.log(m) for k, m in medians.items()}
    out = {}
    for k, v in bins.items():
        w = {j: len(bins[j]) * math.exp(-((j[0] - k[0]) ** 2 + (j[1] - k[1]) ** 2) / 2) for j in bins if j != k}
        total = sum(w.values())
        prior = sum(w[j] * logs[j] for j in w) / total if total > 0 else logs[k]
        out[k] = math.exp((len(v) * logs[k] + prior_steps * prior) / (len(v) + prior_steps))
    return out


def step_bins(records, prior_steps: float = PRIOR_STEPS) -> list:
    """What the table of `records` holds, bin by bin: [{kind, context, tokens, steps, median, ratio}, ...]
    (context, tokens: the medians of the bin's steps; median: of their measured / predicted; ratio: the
    table's, after the shrinkage)."""
    if not prior_steps >= 0:
        raise InvalidParameterError("prior_steps", f"must be >= 0, got {prior_steps}")
    rows = []
    for kind, bins in _bins(records).items():
        fitted = _shrunk(bins, prior_steps)
        for k, pts in sorted(bins.items()):
            rows.append({"kind": kind, "context": statistics.median(c for c, _, _ in pts),
                         "tokens": statistics.median(t for _, t, _ in pts), "steps": len(pts),
                         "median": statistics.median(x for _, _, x in pts), "ratio": fitted[k], "bin": k})
    return rows


def fit_step_table(records, source: str = "", prior_steps: float = PRIOR_STEPS) -> StepTable:
    """The table of StepRecords that carry a prediction (in the order the engine ran them). prior_steps = 0
    keeps each bin's own median, however few its steps."""
    if not prior_steps >= 0:
        raise InvalidParameterError("prior_steps", f"must be >= 0, got {prior_steps}")
    bins = _bins(records)
    out = {}
    for kind in KINDS:
        fitted = _shrunk(bins[kind], prior_steps)
        by_ctx: dict = {}
        for key, pts in sorted(bins[kind].items()):
            by_ctx.setdefault(key[0], []).append((pts, fitted[key]))
        out[kind] = tuple((statistics.median(c for pts, _ in groups for c, _, _ in pts),
                           tuple((statistics.median(t for _, t, _ in pts), ratio) for pts, ratio in groups))
                          for _, groups in sorted(by_ctx.items()))
        if not out[kind]:
            raise InvalidParameterError("step_table", "fitting a step table needs decode steps and prefill steps")
    return StepTable(out["decode"], out["prefill"], source)


def between_steps_seconds(records) -> float:
    """The engine's host work between two steps (sim/spec.HostCosts.per_step_s): the median, over the StepRecords
    (in the order the engine ran them) followed at once by another step (step_period's rule), of the time from a
    step's end as its record times it to the next step's start. 0 when no step was followed at once."""
    gaps = [step_period(records, i) - r.wall_seconds for i, r in enumerate(records[:-1])]
    gaps = [g for g in gaps if g > 0]
    return statistics.median(gaps) if gaps else 0.0
