"""One engine step's predicted time at TP x PP, from the cost model and the collectives (pure functions).

What a StepRecord's `predicted_seconds` means, in one place: the roofline of one tensor-parallel rank's
shard (cost_model.step_cost on collectives.shard_config, the host overhead included), plus the step's
collectives on the link at TP > 1 (collectives.step_comm_cost), or at PP > 1 the stages' schedule over
the step's micro-batches (pipeline_schedule.pipelined_step), each after rank 0's broadcasts of the step plan
(collectives.plan_seconds); under expert parallelism the wait for the busiest rank's experts at every
sparse layer's combine (analysis/parallel_skew.py), counted with the collectives, inside which a rank
measures it. The engine annotates its steps with it (engine/step_cost.py)
and the simulator advances its clock by it (sim/step_time.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from servescope.analysis.collectives import LinkSpec, plan_bytes, plan_seconds, shard_config, step_comm_cost
from servescope.analysis.cost_model import StepCost, step_cost
from servescope.analysis.hardware import HardwareSpec
from servescope.analysis.parallel_skew import expert_wait_seconds
from servescope.analysis.pipeline_schedule import auto_micro_batches, pipelined_step
from servescope.config import ModelConfig


@dataclass(frozen=True)
class StepPrediction:
    seconds: float  # the whole step: compute, host overhead and collectives
    comm_seconds: Optional[float]  # the collectives' share, wait included (None: no link to price them on)
    cost: StepCost  # the rank's roofline (FLOPs, bytes, bound per op group)
    wait_seconds: float = 0.0  # expert parallelism: waiting for the busiest rank's experts (in seconds)
    all_to_all_seconds: float = 0.0  # expert parallelism: the dispatch and combine all-to-alls (in comm_seconds)
    plan_seconds: float = 0.0  # a parallel step: rank 0's broadcasts of the step plan (in comm_seconds)


@dataclass(frozen=True)
class StepPredictor:
    """Predicts steps of one model on one spec at TP x PP (with EP). dtypes: (weight, kv, activation, activation
    bytes), as the engine resolves them; micro_batches: pipeline_micro_batches (0: the engine's auto rule);
    link: between the ranks (None: compute only)."""

    cfg: ModelConfig
    hw: HardwareSpec
    dtypes: tuple
    tp: int = 1
    pp: int = 1
    micro_batches: int = 0
    link: Optional[LinkSpec] = None
    ep: int = 1  # expert-parallel ranks (a mixture's routed experts split over them)

    def __post_init__(self):
        object.__setattr__(self, "shard", shard_config(self.cfg, self.tp, self.ep))  # one rank's model, computed once

    def predict(self, seqs: list, num_logits: int, distinct_experts: Optional[float] = None) -> StepPrediction:
        """seqs: [(num_new_tokens, num_context_tokens_before)] of the step (a verification as 1 + k
        one-token rows, as the engine runs it); distinct_experts: a MoE's measured experts per sparse
        layer (None: expected under uniform routing)."""
        wdt, kdt, adt, act_bytes = self.dtypes
        cost = step_cost(self.shard, seqs, self.hw, wdt, kdt, adt, num_logits=num_logits,
                         distinct_experts=distinct_experts, expert_parallel=self.ep)
        wait = expert_wait_seconds(self.shard, seqs, self.hw, (wdt, kdt, adt), self.ep, num_logits, distinct_experts,
                                   self.link.desync if self.link is not None else 0.0)
        if self.pp > 1:  # (the wait: every stage's sparse layers over the step's tokens, one after another)
            m = auto_micro_batches(sum(n for n, _ in seqs if n > 1), self.pp, self.micro_batches)
            step = pipelined_step(self.cfg, seqs, self.hw, self.tp, self.pp, m, self.link, self.dtypes,
                                  num_logits=num_logits, ep=self.ep)
            plan = 0.0 if self.link is None else plan_seconds(
                plan_bytes(sum(n for n, _ in seqs), num_logits), max(self.tp, self.ep) * self.pp, self.link)
            comm = step.comm_seconds + plan + wait if self.link is not None else None
            return StepPrediction(step.step_seconds + plan + wait, comm, cost, wait, plan_seconds=plan)
        if self.link is not None and max(self.tp, self.ep) > 1:
            comm = step_comm_cost(self.cfg, sum(n for n, _ in seqs), num_logits, self.tp, self.pp, self.link,
                                  act_bytes, self.ep)
            return StepPrediction(cost.predicted_seconds + comm.seconds + wait, comm.seconds + wait, cost, wait,
                                  comm.all_to_all_seconds, comm.plan_seconds)
        return StepPrediction(cost.predicted_seconds + wait, None, cost, wait)
