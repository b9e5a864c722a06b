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


def fit_step_table(records, source: str = "") -> StepTable:
    """The table of StepRecords that carry a prediction (in the order the engine ran them)."""
    records = list(records)
    bins: dict = {k: {} for k in KINDS}
    for i, r in enumerate(records):
        if not r.predicted_seconds or r.wall_seconds <= 0 or not r.context_lens:
            continue
        kind = "prefill" if r.num_prefill_tokens else "decode"
        context = max((sum(r.context_lens) - r.num_tokens) / len(r.context_lens), 1.0)  # before the step
        key = (int(math.log2(context)), int(math.log2(max(r.num_tokens, 1))))
        bins[kind].setdefault(key, []).append((context, r.num_tokens, step_period(records, i) / r.predicted_seconds))
    out = {}
    for kind in KINDS:
        by_ctx: dict = {}
        for (cb, _), pts in sorted(bins[kind].items()):
            by_ctx.setdefault(cb, []).append(pts)
        out[kind] = tuple((statistics.median(c for g in groups for c, _, _ in g),
                           tuple((statistics.median(t for _, t, _ in g), statistics.median(x for _, _, x in g))
                                 for g in groups))
                          for _, groups in sorted(by_ctx.items()))
        if not out[kind]:
            raise InvalidParameterError("step_table", "fitting a step table needs decode steps and prefill steps")
    return StepTable(out["decode"], out["prefill"], source)
