"""A measured step-time table: how the engine's measured steps compare with the cost model's prediction.

The cost model predicts a step from FLOPs, bytes and measured kernel rates; on a given machine its
error depends on the kind of step and its size (a decode step of 4 sequences, a 512-token prefill
chunk). A table measured on the engine (labs/sim_validation.profile_steps: decode steps at batch
1..32, prefill chunks of 16..512 tokens, workloads of their own) holds the median of measured /
predicted per kind (decode-only, or with prefill tokens) and per power-of-two bin of the step's
tokens; the simulator multiplies each prediction by the ratio at its kind and size (log-log
interpolation between bins, the nearest bin outside them), as Vidur profiles operators before it
simulates. The measured steps include all the engine's host work, so a table replaces HostCosts.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from servescope.errors import InvalidParameterError

KINDS = ("decode", "prefill")


@dataclass(frozen=True)
class StepTable:
    decode: tuple  # ((tokens, measured / predicted), ...), tokens ascending
    prefill: tuple
    source: str = ""

    def __post_init__(self):
        for kind in KINDS:
            pts = getattr(self, kind)
            if not pts or any(t < 1 or r <= 0 for t, r in pts) or [t for t, _ in pts] != sorted(t for t, _ in pts):
                raise InvalidParameterError("step_table", f"{kind}: needs ((tokens >= 1, ratio > 0), ...) ascending")

    def ratio(self, decode_only: bool, tokens: int) -> float:
        pts = self.decode if decode_only else self.prefill
        if tokens <= pts[0][0]:
            return pts[0][1]
        if tokens >= pts[-1][0]:
            return pts[-1][1]
        for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
            if t0 <= tokens <= t1:
                f = math.log(tokens / t0) / math.log(t1 / t0)
                return math.exp(math.log(r0) + f * (math.log(r1) - math.log(r0)))
        raise AssertionError("unreachable")

    def to_dict(self) -> dict:
        return {"decode": [list(p) for p in self.decode], "prefill": [list(p) for p in self.prefill],
                "source": self.source}

    @classmethod
    def from_dict(cls, d: dict) -> "StepTable":
        try:
            return cls(tuple(tuple(p) for p in d["decode"]), tuple(tuple(p) for p in d["prefill"]), d.get("source", ""))
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidParameterError("step_table", f"not a step table: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> "StepTable":
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except OSError as e:
            raise InvalidParameterError("step_table", f"cannot read {path}: {e.strerror or e}") from None
        except ValueError as e:
            raise InvalidParameterError("step_table", f"{path} is not JSON: {e}") from None


def fit_step_table(records, source: str = "") -> StepTable:
    """The table of StepRecords that carry a prediction: per kind and power-of-two bin of tokens, the
    median measured / predicted and the median token count of the bin's steps."""
    bins: dict = {k: {} for k in KINDS}
    for r in records:
        if not r.predicted_seconds or r.wall_seconds <= 0:
            continue
        kind = "prefill" if r.num_prefill_tokens else "decode"
        b = int(math.log2(max(r.num_tokens, 1)))
        bins[kind].setdefault(b, []).append((r.num_tokens, r.wall_seconds / r.predicted_seconds))
    pts = {k: tuple((statistics.median(t for t, _ in v), statistics.median(x for _, x in v))
                    for _, v in sorted(bins[k].items())) for k in KINDS}
    if not pts["decode"] or not pts["prefill"]:
        raise InvalidParameterError("step_table", "fitting a step table needs decode steps and prefill steps")
    return StepTable(pts["decode"], pts["prefill"], source)
