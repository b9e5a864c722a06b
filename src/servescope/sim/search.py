"""`simulate --search`: the cheapest layout that meets the SLOs at a rate, and what binds.

Layouts: colocated (R replicas of a TP-way instance behind the router) and disaggregated (P prefill +
D decode TP-way instances), TP in 1, 2, 4, 8 where the model splits and fits. A layout meets the SLOs
when at least `attainment` of the requests meet every one of them (goodput / throughput, bench/metrics'
definition). Per TP: the fewest replicas by bisection (more replicas never hurt a least-tokens router's
goodput), and for P = 1, 2, ... the fewest D by bisection until a larger P cannot beat the best. The
answer is the layout with the fewest devices (ties: the higher attainment, then the lower p90 TTFT).

What binds is read from the layout one instance short of the answer, which misses the SLOs: the SLO
missed most, and the instances behind it -- the KV cache (peak usage, preemptions), the batch slots
(max_num_seqs nearly always full: requests queue for one), the token budget (prefill chunks queue),
else compute or memory bandwidth as the steps' bound says, or the KV link (transfer time against the
TTFT SLO).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from servescope.errors import InvalidParameterError
from servescope.sim.cluster import Deployment
from servescope.sim.disagg import Disaggregated
from servescope.sim.run import SimRun, simulate

TPS = (1, 2, 4, 8)
FULL = 0.75  # a limit used this much per step on average binds: requests queue for it


@dataclass(frozen=True)
class Layout:
    kind: str  # "colocated" | "disaggregated"
    tp: int
    instances: int = 1  # colocated replicas
    prefill: int = 0
    decode: int = 0

    @property
    def num_instances(self) -> int:
        return self.instances if self.kind == "colocated" else self.prefill + self.decode

    def describe(self) -> str:
        if self.kind == "colocated":
            return f"{self.instances} x TP{self.tp} colocated"
        return f"{self.prefill}P + {self.decode}D x TP{self.tp}"


@dataclass
class Trial:
    layout: Layout
    devices: int
    attainment: float
    run: SimRun = field(repr=False)

    def meets(self, target: float) -> bool:
        return self.attainment >= target


def attainment(run: SimRun) -> float:
    r = run.result
    n = r.completed + r.failed
    return (r.request_goodput or 0.0) * r.duration_s / n if n else 0.0


class Search:
    """spec_for(tp) -> InstanceSpec (raises InvalidParameterError where the model does not split or fit)."""

    def __init__(self, spec_for: Callable, requests: Sequence, slos: dict, target: float = 0.9,
                 max_devices: int = 64, router: str = "least-tokens", kv_link: Optional[str] = None,
                 max_concurrency: Optional[int] = None):
        if not slos:
            raise InvalidParameterError("goodput", "the search needs SLOs (ttft / tpot / e2el)")
        if not 0 < target <= 1:
            raise InvalidParameterError("slo_attainment", f"attainment must be in (0, 1], got {target}")
        self.spec_for, self.requests, self.slos, self.target = spec_for, requests, slos, target
        self.max_devices, self.router = max_devices, router
        self.kv_link, self.max_concurrency = kv_link, max_concurrency
        self.trials: dict = {}

    def trial(self, layout: Layout, spec) -> Trial:
        if layout not in self.trials:
            if layout.kind == "colocated":
                dep = Deployment(spec, layout.instances, self.router, keep_steps=False)
            else:
                dep = Disaggregated(spec, layout.prefill, layout.decode, self.kv_link, keep_steps=False)
            run = simulate(dep, self.requests, self.max_concurrency, self.slos)
            run.deployment, run.finished = None, []  # keep the result and the stats, not every engine's state
            self.trials[layout] = Trial(layout, dep.num_devices, attainment(run), run)
        return self.trials[layout]

    def _fewest(self, make: Callable, lo: int, hi: int, spec) -> Optional[Trial]:
        """The trial of the smallest n in [lo, hi] whose layout make(n) meets the target (bisection)."""
        if hi < lo or not self.trial(make(hi), spec).meets(self.target):
            return None
        while lo < hi:
            mid = (lo + hi) // 2
            if self.trial(make(mid), spec).meets(self.target):
                hi = mid
            else:
                lo = mid + 1
        return self.trial(make(lo), spec)

    def run(self) -> Optional[Trial]:
        best = None
        for tp in TPS:
            try:
                spec = self.spec_for(tp)
            except InvalidParameterError:
                continue
            per = spec.num_devices
            room = self.max_devices // per
            best = self._better(best, self._fewest(lambda n: Layout("colocated", tp, instances=n), 1, room, spec))
            for p in range(1, room):
                if best is not None and (p + 1) * per > best.devices:
                    break
                best = self._better(best, self._fewest(
                    lambda d: Layout("disaggregated", tp, prefill=p, decode=d), 1, room - p, spec))
        return best

    @staticmethod
    def _better(best: Optional[Trial], t: Optional[Trial]) -> Optional[Trial]:
        if t is not None and (best is None or _rank(t) < _rank(best)):
            return t
        return best

    def neighbour(self, best: Trial) -> Optional[Trial]:
        """The tried layout one instance short of `best` (which misses the SLOs), if any."""
        lay = best.layout
        for cand in (Layout(lay.kind, lay.tp, lay.instances - 1, lay.prefill, lay.decode),
                     Layout(lay.kind, lay.tp, lay.instances, lay.prefill, lay.decode - 1),
                     Layout(lay.kind, lay.tp, lay.instances, lay.prefill - 1, lay.decode)):
            if cand in self.trials and cand != lay:
                return self.trials[cand]
        return None


def _rank(t: Trial) -> tuple:
    """Fewer devices first; then the higher attainment; then the lower p90 TTFT."""
    return t.devices, -t.attainment, t.run.result.ttft.percentiles_ms.get(90.0, 0.0)


def slo_misses(trial: Trial, slos: dict) -> dict:
    """How many completed requests miss each SLO."""
    recs = [r for r in trial.run.result.records if r.success]
    value = {"ttft": lambda r: r.ttft, "tpot": lambda r: r.tpot or 0.0, "e2el": lambda r: r.latency}
    return {k: sum(value[k](r) * 1e3 > ms for r in recs) for k, ms in slos.items()}


def binding(trial: Trial, slos: dict) -> str:
    """One sentence: the SLO missed most on this layout and the resource behind it."""
    misses = slo_misses(trial, slos)
    worst = max(misses, key=misses.get)
    if not misses[worst]:
        return "nothing binds: every SLO is met"
    stats = trial.run.stats
    insts = stats["instances"]
    if trial.layout.kind == "disaggregated":
        insts = [i for i in insts if i["name"].startswith("prefill" if worst == "ttft" else "decode")]
        transfer = stats.get("mean_transfer_ms", 0.0)
        if worst == "ttft" and "ttft" in slos and transfer > 0.2 * slos["ttft"]:
            return f"the KV link: {transfer:.1f} ms per transfer against a TTFT SLO of {slos['ttft']:g} ms"
    mean = lambda key: sum(i[key] for i in insts) / len(insts)  # noqa: E731
    head = f"{worst.upper()} (missed by {misses[worst]} of {trial.run.result.completed} requests): "
    if mean("peak_kv_usage") >= 0.95 or sum(i["preemptions"] for i in insts):
        return head + (f"the KV cache (peak {mean('peak_kv_usage'):.0%} full, "
                       f"{sum(i['preemptions'] for i in insts)} preemptions)")
    kind = "compute" if mean("compute_bound_share") > 0.5 else "memory bandwidth"
    use = (f"{mean('compute_bound_share'):.0%} of step time compute-bound; token budget "
           f"{mean('token_budget_used'):.0%} used, {mean('seqs_used'):.0%} of max_num_seqs per step")
    if mean("seqs_used") >= FULL:
        return head + f"the batch slots: requests queue for one of max_num_seqs, steps bound by {kind} ({use})"
    if mean("token_budget_used") >= FULL:
        return head + f"the token budget: prefill chunks queue, steps bound by {kind} ({use})"
    return head + f"{kind} ({use})"
