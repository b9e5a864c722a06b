"""Fitting a measured gloo link (pure functions): the all-reduce ring's four rates to the probe's all-reduce
times, and the collectives a parallel step issues besides it (the all-to-all, the all-gather: a call's cost +
bytes / a rate each; the step plan's broadcasts: one figure) to the times parallel/link_probe.py measured as a
step issues them. The model they are the terms of: analysis/collectives.py."""

from __future__ import annotations

import dataclasses
import math
import statistics

from servescope.analysis.collectives import GLOO_MAX_SEGMENT_BYTES, LOCAL_GLOO, LinkSpec, ring_terms
from servescope.errors import InvalidParameterError

STEP_COLLECTIVES = ("all_to_all", "all_gather", "plan")  # what measure_step_collectives returns, by kind


def fit_link(measured: dict, ranks: int, name: str = LOCAL_GLOO, source: str = "",
             max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES, buffer_bytes: int = 0) -> LinkSpec:
    """The gloo ring's (call_s, step_s, buffered_bandwidth, bandwidth) that best fit measured all-reduce
    times {bytes: seconds} over `ranks` with the socket buffer `buffer_bytes` (0: one rate for every
    byte), in relative error (least squares weighted by 1/t^2, so that 8 KiB counts as much as 64 MiB);
    a term the data would make negative is dropped (zero) and the others refitted."""
    pts = sorted((float(b), float(t)) for b, t in measured.items() if t > 0)
    if len(pts) < 2:
        raise InvalidParameterError("link", "fitting a link needs all-reduce times at two sizes or more")
    rows = [[x / t for x in ring_terms(b, ranks, max_segment_bytes, buffer_bytes)] for b, t in pts]  # relative
    free = [0, 1, 2, 3] if buffer_bytes else [0, 1, 3]  # call_s, step_s, 1 / buffered_bandwidth, 1 / bandwidth
    while True:
        coef = _least_squares([[r[j] for j in free] for r in rows], [1.0] * len(rows))
        if coef is None:  # dependent columns (e.g. every size below 2N MiB: as many steps each)
            free.remove(next(j for j in (2, 1, 0) if j in free))
            continue
        full = dict(zip(free, coef))
        if full[3] <= 0:
            raise InvalidParameterError("link", f"all-reduce times do not grow with size: {pts}")
        if all(c >= 0 for c in coef):
            break
        free.remove(min((j for j in free if j != 3), key=full.get))  # the most negative other term
    call_s, step_s, inv_buffered = full.get(0, 0.0), full.get(1, 0.0), full.get(2, 0.0)
    return LinkSpec(name, 1.0 / full[3], call_s + step_s, source or f"fitted to {len(pts)} measured all-reduce sizes",
                    call_s=call_s, step_s=step_s, max_segment_bytes=max_segment_bytes, buffer_bytes=buffer_bytes,
                    buffered_bandwidth=1.0 / inv_buffered if inv_buffered > 0 else 0.0)


def fit_call_and_rate(measured: dict, what: str) -> tuple:
    """(call seconds, bytes per second) of call + bytes / rate fitted to measured times {bytes: seconds}, in
    relative error as fit_link (the call's cost dropped where the data would make it negative)."""
    pts = sorted((float(b), float(t)) for b, t in measured.items() if t > 0)
    if len({b for b, _ in pts}) < 2:
        raise InvalidParameterError("link", f"fitting the {what} needs its times at two sizes or more")
    coef = _least_squares([[1.0 / t, b / t] for b, t in pts], [1.0] * len(pts))
    if coef is None or coef[0] < 0:
        coef = [0.0, sum(b / t for b, t in pts) / sum((b / t) ** 2 for b, t in pts)]  # bytes alone
    if coef[1] <= 0:
        raise InvalidParameterError("link", f"{what} times do not grow with size: {pts}")
    return coef[0], 1.0 / coef[1]


def fit_step_collectives(measured: dict, link: LinkSpec) -> LinkSpec:
    """`link` with the collectives a step issues fitted to their times at two ranks, {kind: {bytes: seconds}}
    for the kinds of STEP_COLLECTIVES: the all-to-all's {bytes sent to the other rank: s} and the all-gather's
    {bytes per rank: s}, each a call + bytes / rate; the plan's {payload bytes: s} of its two broadcasts, their
    median less the payload at the all-to-all's rate (plan_s); "desync" where measured: {work bytes: the ranks'
    spread on it} (relative_spread), their median (desync; 0 where absent)."""
    missing = [k for k in STEP_COLLECTIVES if not measured.get(k)]
    if missing:
        raise InvalidParameterError("link", f"the step's collectives lack measured times of: {', '.join(missing)}")
    a2a_call, a2a_bw = fit_call_and_rate(measured["all_to_all"], "all-to-all")
    ag_call, ag_bw = fit_call_and_rate(measured["all_gather"], "all-gather")
    plan = statistics.median(t - b / a2a_bw for b, t in measured["plan"].items())
    desync = statistics.median(measured.get("desync", {}).values() or [0.0])
    return dataclasses.replace(link, a2a_call_s=a2a_call, a2a_bandwidth=a2a_bw, ag_call_s=ag_call,
                               ag_bandwidth=ag_bw, plan_s=max(0.0, plan), desync=desync)


def relative_spread(rounds: list) -> float:
    """The sd of one rank's time about its round's mean over the mean time, from rounds [[each rank's seconds]] of
    the same work started together: LinkSpec.desync. Each round's unbiased variance is a chi-square of N - 1
    degrees over N - 1 times it; their median over that distribution's median (exact at N = 2, Wilson-Hilferty
    above), so that a round in which another process took a rank's core does not set it. 0 for one rank."""
    rows = [[float(t) for t in r] for r in rounds if len(r) > 1]
    if not rows:
        return 0.0
    if min(min(r) for r in rows) <= 0 or len({len(r) for r in rows}) > 1:
        raise InvalidParameterError("link", f"equal work timed at {rows}: as many ranks each round, times > 0")
    k = len(rows[0]) - 1
    z = statistics.NormalDist().inv_cdf(0.75)
    median_ratio = z * z if k == 1 else (1 - 2 / (9 * k)) ** 3  # median of chi-square(k) / k
    var = statistics.median(statistics.variance(r) for r in rows) / median_ratio
    return math.sqrt(var) / statistics.mean(t for r in rows for t in r)


def _least_squares(rows: list, y: list):
    """x minimising sum (row . x - y)^2, or None where the columns are (nearly) dependent: the normal
    equations of the columns scaled to unit norm (seconds and bytes differ by ten orders), solved by
    Gaussian elimination."""
    n = len(rows[0])
    norm = [math.sqrt(sum(r[j] ** 2 for r in rows)) or 1.0 for j in range(n)]
    z = [[r[j] / norm[j] for j in range(n)] for r in rows]
    a = [[sum(r[i] * r[j] for r in z) for j in range(n)] + [sum(r[i] * v for r, v in zip(z, y))] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda i: abs(a[i][c]))
        if abs(a[p][c]) < 1e-9:
            return None
        a[c], a[p] = a[p], a[c]
        for i in range(n):
            if i != c:
                f = a[i][c] / a[c][c]
                a[i] = [u - f * v for u, v in zip(a[i], a[c])]
    return [a[j][n] / a[j][j] / norm[j] for j in range(n)]
