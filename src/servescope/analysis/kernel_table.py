"""The engine's kernels timed at one model's own shapes: what a step's linear layers, attention and small
ops take on this machine, by rows and context (pure Python; measure/shape_kernels.py measures it).

A roofline on a 2048^3 `torch.mm` and a 512 MiB `torch.sum` prices a step from two peaks. The engine's
kernels reach neither at most of the shapes a serving step runs: a bfloat16 GEMM at 512 rows of a
2048-wide model, the tiled prefill attention over a cached prefix, a packed GEMV at 8 rows. A
KernelTable holds what those kernels took when the probe timed them on the model's own matrices (the
loaded engine's modules, in layer order, so the caches see what a step sees) at a grid of row counts,
and its attention and per-layer small ops on a grid of (rows, keys), with nothing from any workload:

- `linear`: {projection: [[rows M, seconds per layer's call], ...]} for qkv_proj, o_proj, gate_up_proj,
  down_proj (one layer's matrix), lm_head (the head). Between grid points time is interpolated
  linearly in M; beyond the last point it grows with the last segment's slope (a GEMM past a few
  hundred rows is compute-bound: linear in M).
- `attention`: linear models of one layer's attention call, least-squares fits to the timed grid:
  `paged` (decode rows, one query per sequence): seconds = a + b * rows + c * keys; `short` (in bfloat16
  the short prefill chunks, each row one query of the same paged kernel, which reads a sequence's keys
  once for all its rows: a third of a decode row's time per key here), the same form; in float32
  (`short_per_sequence`) the chunks below the tiled kernel's tokens, each an SDPA call of its own over its
  cached keys gathered (a copy of the whole context whatever the rows), per sequence a + b * tokens + c * keys
  + d * context: the tiled kernel's fit priced them at its intercept, several times their time; `long` (a
  prefill sequence of at least `long_min_tokens` tokens, or any prefill where the paged path does not take
  it): per sequence a + b * tokens + c * keys. keys: attended keys (causal), summed over the rows. A table
  without `short` prices short chunks with `paged`. `paged_max_context`: a step whose short chunks see more
  context (and no long one) runs them on `long` (0: no limit).
- `misc`: [[tokens T, seconds per layer]] of the layer's small ops (the two add+RMSNorms, rotary,
  SiLU*up, the KV store), interpolated like `linear`.
- `moe` (a MoE): [[tokens T, seconds per sparse layer]] of the model's own sparse MLP block (router,
  routed experts grouped by expert, shared expert: whatever runs them) on T rows of random activations,
  and `moe_distinct`: [[T, distinct experts per layer those calls read]] (random rows route nearly
  uniformly). A step whose routing was measured is priced at the block's time scaled by its distinct
  experts over the timed calls' (at batch 1 both are k). A sparse layer has no gate_up_proj / down_proj
  rows of its own: a model without dense layers holds [[1, 0.0]] there.
- `prefill_factor`: [[tokens T, f]]: a step with prefill tokens runs the model's own layer forward in
  Python (a decode-only step runs the C++ decode plan: `decode_plan`), and that forward of a T-token
  prefill took f times what the table's linear layers, attention and small ops add up to, the excess put
  on the linear layers (their GEMMs between the other ops' traffic, the forward's own Python): the linear
  ops of such a step are priced at f(T) times the table's.
- `decode_plan`: [[rows B, seconds of the plan, seconds of its kernels]]: a decode-only step of B <=
  `decode_rows` sequences runs the C++ decode plan, all layers' kernels back to back in one call, timed whole
  over B rows (measure/decode_plan.py), beside what the table's linear layers, attention and small ops add
  up to for the same layers. The decode factor f(B) = (plan - the host overhead per layer the cost model adds
  for every layer, which the plan's time holds) / kernels prices all the layers' ops of such a step at f(B)
  times the table's (at two threads the layers ran slower together than their kernels one at a time); taken
  with the spec's own overhead at each prediction, so a probe measured again keeps it right. Between points
  interpolated, beyond the first and the last held flat (a ratio, not a time); decode_rows 0 (no plan) or
  more rows (the model's forward runs them): 1.
- `sample`: [[rows, seconds]] of the engine's sampler picking greedy tokens from float32 logits over the
  vocabulary (the argmax every row pays), priced with the head (op group lm_head) at the step's logit rows.
  The probe's host overhead holds the sampler of a 512-token vocabulary; at 49152 its rows cost what a small
  model's attention does. [] (a table without it): nothing.

`bandwidth`: the read bandwidth a spot check measured while the table was timed (analysis/bandwidth.py; 0:
not taken). The cost model re-prices the table's times from it to the spec's bandwidth (their memory share
moves with it: a table timed in a fast minute of a shared VM would under-predict every slow one).

Each time is the kernel's own: the probe subtracts the Python call cost of the same call on a tiny
shape, which the host overhead per layer (measure/overhead.py) already counts.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field
from typing import Optional, Sequence

from servescope.config import ModelConfig

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")
# 3: the sampler's rows; attention timed over written caches; 4: the bandwidth it was timed at; 5: the decode plan
# timed whole, float32's short chunks fitted apart; 6: a row count slower than a larger one timed again
TABLE_VERSION = 6


@functools.lru_cache(maxsize=64)  # once per (config, dtypes): every step's prediction asks for it
def table_key(cfg: ModelConfig, weight_dtype: str, act_dtype: str, kv_dtype: str) -> str:
    """The shape and dtypes a KernelTable was measured at: a step of another model of the same shape
    runs the same kernels (a random-weight Llama-3.2-1B and the real one). The readable part names the
    dimensions; the digest covers everything else the layers run (attention kinds with their windows,
    soft-caps and sinks, norms, activations, experts), so that a MoE and a dense model of equal
    dimensions, or a soft-capped and a plain one, never share a table."""
    windows = sorted({s.attention.window for s in cfg.layer_specs()})
    layers = hashlib.sha1(repr((cfg.layer_specs(), cfg.moe)).encode()).hexdigest()[:10]
    return (f"L{cfg.num_hidden_layers}-d{cfg.hidden_size}-h{cfg.num_attention_heads}x{cfg.head_dim}"
            f"-kv{cfg.num_key_value_heads}-i{cfg.intermediate_size}-V{cfg.vocab_size}"
            f"-bias{int(bool(cfg.attention_bias))}-qkn{int(bool(cfg.qk_norm))}"
            f"-win{'.'.join(map(str, windows))}-layers{layers}"
            f"|w={weight_dtype}|a={act_dtype}|kv={kv_dtype}|v{TABLE_VERSION}")


def interpolate(points: Sequence, x: float) -> float:
    """Piecewise-linear in x through [[x, y], ...] (x ascending); the last segment's slope beyond the
    last point, the first point's y scaled by x below the first (never reached: rows start at 1)."""
    if x <= points[0][0]:
        return float(points[0][1]) * x / points[0][0]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return float(y0 + (y1 - y0) * (x - x0) / (x1 - x0))
    if len(points) == 1:  # one point (the default prefill factor [[1, 1.0]]): flat beyond it
        return float(points[0][1])
    (x0, y0), (x1, y1) = points[-2], points[-1]
    return float(y1 + max(y1 - y0, 0.0) / (x1 - x0) * (x - x1))


@dataclass(frozen=True)
class AttentionFit:
    """seconds = fixed + per_row * rows + per_key * keys + per_context * context (one layer's call; context: the
    tokens cached before the call's sequence, which a path that gathers them copies whatever its rows)."""

    fixed: float
    per_row: float
    per_key: float
    per_context: float = 0.0

    def seconds(self, rows: int, keys: int, context: int = 0) -> float:
        return max(self.fixed + self.per_row * rows + self.per_key * keys + self.per_context * context, 0.0)


@dataclass(frozen=True)
class KernelTable:
    key: str
    linear: dict  # projection -> [[rows, seconds], ...]
    paged: AttentionFit
    long: AttentionFit
    long_min_tokens: int  # prefill sequences of this many tokens or more take the `long` path
    paged_max_context: int  # a step whose short chunks see more context than this runs them on `long` (0: none)
    misc: list  # [[tokens, seconds per layer], ...]
    source: str = ""
    grid: dict = field(default_factory=dict)  # the attention points timed (for the record)
    prefill_factor: list = field(default_factory=lambda: [[1, 1.0]])  # [[tokens, f]]
    moe: list = field(default_factory=list)  # [[tokens, seconds per sparse layer's block]]; [] without experts
    moe_distinct: list = field(default_factory=list)  # [[tokens, distinct experts per layer the timed calls read]]
    sample: list = field(default_factory=list)  # [[logit rows, seconds of the sampler's greedy pick]]; [] without
    short: Optional[AttentionFit] = None  # short prefill chunks on the paged kernel (None: priced with `paged`)
    short_per_sequence: bool = False  # each short chunk a call of its own (float32's SDPA), not one for them all
    bandwidth: float = 0.0  # bytes/s read while the table was timed (0: unknown, its times priced as they are)
    decode_plan: list = field(default_factory=list)  # [[decode rows, plan seconds, its kernels' seconds]]
    decode_rows: int = 0  # the most rows a decode-only step runs on the plan (0: no plan)

    def linear_factor(self, tokens: int, has_prefill: bool) -> float:
        if not has_prefill:
            return 1.0
        pts = self.prefill_factor
        return interpolate(pts, tokens) if tokens >= pts[0][0] else float(pts[0][1])

    def layers_factor(self, seqs: Sequence[tuple], layers_host_s: float = 0.0) -> float:
        """What a step's layers cost over the table's sum of their kernels: the decode factor f(B) of a
        decode-only step of B sequences the C++ decode plan runs, 1 for any other step. layers_host_s: the host
        overhead the cost model adds for the step's layers (L x the spec's per layer), which the plan's time
        holds."""
        rows = len(seqs)
        if not self.decode_plan or not rows or rows > self.decode_rows or any(n != 1 for n, _ in seqs):
            return 1.0
        pts = [[r, decode_factor(plan, kernels, layers_host_s)] for r, plan, kernels in self.decode_plan]
        return interpolate(pts, min(max(rows, pts[0][0]), pts[-1][0]))  # held flat beyond the points

    def linear_seconds(self, name: str, rows: int) -> float:
        return interpolate(self.linear[name], rows) if rows > 0 else 0.0

    def misc_seconds(self, tokens: int) -> float:
        return interpolate(self.misc, tokens)

    def sample_seconds(self, rows: int) -> float:
        return interpolate(self.sample, rows) if self.sample and rows > 0 else 0.0

    def moe_seconds(self, tokens: int, distinct: Optional[float] = None, expert_read_s: float = 0.0) -> float:
        """One sparse layer's MLP block at `tokens` rows; with the step's measured distinct experts per layer,
        the share of the time that reads the experts' weights scaled by them over the distinct experts the timed
        calls read at that many rows. expert_read_s: one expert's weights at the memory bandwidth (0: the whole
        time scales). A decode block is its weight reads; a prefill block multiplies the same rows whatever
        experts they go to, and fewer distinct experts save only their reads."""
        if not self.moe or tokens <= 0:
            return 0.0
        t = interpolate(self.moe, tokens)
        if distinct is not None and self.moe_distinct:
            timed = interpolate(self.moe_distinct, tokens)
            if timed > 0:
                read = min(t, timed * expert_read_s) if expert_read_s > 0 else t
                t += read * (float(distinct) / timed - 1.0)
        return t

    def attention_seconds(self, seqs: Sequence[tuple], keys_of) -> float:
        """One layer's attention over seqs [(new, context before)]; keys_of((n, c)) -> attended keys of
        one sequence in this layer. The rows the paged kernel takes are one call; each long sequence
        one call of its own, and each short one where short_per_sequence."""
        paged_rows = paged_keys = 0
        total = 0.0
        short = [s for s in seqs if 1 < s[0] < self.long_min_tokens]
        has_long = any(s[0] >= self.long_min_tokens for s in seqs)
        short_to_long = (bool(short) and not has_long and self.paged_max_context > 0
                         and max(n + c for n, c in seqs) > self.paged_max_context)
        short_rows = short_keys = 0
        for n, c in seqs:
            if n == 1 or (n < self.long_min_tokens and not short_to_long):
                if n == 1 or self.short is None:
                    paged_rows += n
                    paged_keys += keys_of((n, c))
                elif self.short_per_sequence:
                    total += self.short.seconds(n, keys_of((n, c)), c)
                else:
                    short_rows += n
                    short_keys += keys_of((n, c))
            else:
                total += self.long.seconds(n, keys_of((n, c)))
        if paged_rows:
            total += self.paged.seconds(paged_rows, paged_keys)
        if short_rows:
            total += self.short.seconds(short_rows, short_keys)
        return total

    def to_dict(self) -> dict:
        return {"key": self.key, "linear": self.linear, "paged": vars(self.paged), "long": vars(self.long),
                "long_min_tokens": self.long_min_tokens, "paged_max_context": self.paged_max_context,
                "misc": self.misc, "source": self.source, "grid": self.grid,
                "prefill_factor": self.prefill_factor, "moe": self.moe, "moe_distinct": self.moe_distinct,
                "sample": self.sample, "short": None if self.short is None else vars(self.short),
                "short_per_sequence": self.short_per_sequence,
                "bandwidth": self.bandwidth, "decode_plan": self.decode_plan, "decode_rows": self.decode_rows}

    @classmethod
    def from_dict(cls, d: dict) -> "KernelTable":
        missing = [p for p in PROJECTIONS if p not in d["linear"]]
        if missing:
            raise ValueError(f"kernel table {d.get('key')!r} lacks {', '.join(missing)}")
        optional = [(n, d[n]) for n in ("moe", "moe_distinct", "sample", "decode_plan") if d.get(n)]
        for name, pts in list(d["linear"].items()) + [("misc", d["misc"])] + optional:
            xs = [p[0] for p in pts]
            if not pts or xs != sorted(xs) or len(set(xs)) != len(xs) or any(min(p[1:]) < 0 for p in pts):
                raise ValueError(f"kernel table {d.get('key')!r}: {name} must be [[x, seconds >= 0, ...], ...], "
                                 "x ascending")
        return cls(key=d["key"], linear={k: [list(p) for p in v] for k, v in d["linear"].items()},
                   paged=AttentionFit(**d["paged"]), long=AttentionFit(**d["long"]),
                   long_min_tokens=int(d["long_min_tokens"]), paged_max_context=int(d["paged_max_context"]),
                   misc=[list(p) for p in d["misc"]], source=d.get("source", ""), grid=d.get("grid", {}),
                   prefill_factor=[list(p) for p in d.get("prefill_factor", [[1, 1.0]])],
                   moe=[list(p) for p in d.get("moe", [])], moe_distinct=[list(p) for p in d.get("moe_distinct", [])],
                   sample=[list(p) for p in d.get("sample", [])],
                   short=AttentionFit(**d["short"]) if d.get("short") else None,
                   short_per_sequence=bool(d.get("short_per_sequence")),
                   bandwidth=float(d.get("bandwidth") or 0.0),
                   decode_plan=[list(p) for p in d.get("decode_plan", [])],
                   decode_rows=int(d.get("decode_rows") or 0))


def decode_factor(plan_s: float, kernels_s: float, layers_host_s: float) -> float:
    """The decode plan's time less the host overhead priced beside it for its layers, over its kernels', within
    [0.5, 2]: outside it a measurement went wrong (a time slice lost to another process in one of the timings on a
    shared machine), not a plan faster than its kernels by half or twice as slow."""
    if kernels_s <= 0:
        return 1.0
    return min(max((plan_s - layers_host_s) / kernels_s, 0.5), 2.0)


def fit_linear_model(points: Sequence[tuple], per_context: bool = False) -> AttentionFit:
    """Least squares of seconds = a + b * rows + c * keys over [(rows, keys, seconds)] (per_context: + d * context
    over [(rows, keys, context, seconds)]), each coefficient kept >= 0 (a coefficient the solve makes negative is
    dropped and the rest refitted): pure Python, three or four unknowns."""
    names = ("fixed", "per_row", "per_key", "per_context")
    cols = [tuple(p) if per_context else (p[0], p[1], 0, p[2]) for p in points]
    active = [0, 1, 2, 3] if per_context else [0, 1, 2]
    while True:
        coef = _solve(cols, active)
        neg = [j for j, v in zip(active, coef) if v < 0]
        if not neg:
            out = dict.fromkeys(names, 0.0)
            for j, v in zip(active, coef):
                out[names[j]] = v
            return AttentionFit(**out)
        active = [j for j in active if j not in neg]
        if not active:
            return AttentionFit(0.0, 0.0, 0.0)


def _solve(points: Sequence[tuple], active: list) -> list:
    """Normal equations of the least-squares fit on the active columns (1, rows, keys, context) of
    [(rows, keys, context, seconds)]."""
    rows = [[(1.0, float(r), float(k), float(c))[j] for j in active] for r, k, c, _ in points]
    ys = [float(t) for *_, t in points]
    n = len(active)
    a = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in range(n)]
    # scale each column to its largest entry: rows and keys differ by orders of magnitude
    s = [max(max(abs(r[j]) for r in rows), 1e-30) for j in range(n)]
    a = [[a[i][j] / (s[i] * s[j]) for j in range(n)] for i in range(n)]
    b = [b[i] / s[i] for i in range(n)]
    x = _gauss(a, b)
    return [x[j] / s[j] for j in range(n)]


def _gauss(a: list, b: list) -> list:
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-12:
            return [0.0] * n  # singular: too few distinct points for this column set
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


_PARSED: dict = {}  # key -> (the dict parsed, its KernelTable): the cost model asks at every step


def lookup(tables: dict, key: str) -> Optional[KernelTable]:
    """The KernelTable stored under `key` in a spec's kernel_tables, or None."""
    d = tables.get(key) if tables else None
    if not d:
        return None
    hit = _PARSED.get(key)
    if hit is None or hit[0] is not d:
        hit = _PARSED[key] = (d, KernelTable.from_dict(d))
    return hit[1]
