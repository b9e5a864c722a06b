"""The simulator's clock: how long a scheduled step takes, as the engine's StepRecords predict it.

The step's sequences are handed to the cost model exactly as engine/llm_engine.py hands them for its
own prediction (a verification as 1 + k one-token rows), through analysis/step_prediction.py, which
adds the collectives at TP x PP and the spec's host overhead per step and per layer. On top comes the
host work that grows with the batch (`HostCosts`: per scheduled sequence, per output token), which the
roofline does not see and which matters for small models on a CPU. Or, with a measured step table
(sim/step_table.py), the prediction times the measured / predicted ratio of steps of its kind, context
and size.

Predictions are cached on the step's exact shape: a steady decode batch repeats its shapes only when
contexts repeat, so the cache mostly serves the many identical small steps of light load.
"""

from __future__ import annotations

from typing import Optional

from servescope.analysis.step_prediction import StepPrediction
from servescope.scheduler.output import SchedulerOutput
from servescope.sim.spec import InstanceSpec

CACHE_ENTRIES = 1 << 16


def step_seqs(out: SchedulerOutput) -> tuple:
    """((num_new, context_before), ...) of the step, a verification as 1 + k one-token rows
    (engine/llm_engine.LLMEngine._record_step's rule), and the logit rows it computes."""
    seqs = []
    num_logits = 0
    for s in out.scheduled:
        if s.spec_token_ids:
            seqs.extend((1, s.num_computed_tokens + j) for j in range(1 + len(s.spec_token_ids)))
        else:
            seqs.append((s.num_new_tokens, s.num_computed_tokens))
        if s.will_sample:
            num_logits += 1 + len(s.spec_token_ids)
    return tuple(seqs), num_logits


class StepTimer:
    """Seconds of a scheduled step on one instance (prediction + batch-dependent host work)."""

    def __init__(self, spec: InstanceSpec):
        self.predictor = spec.predictor()
        self.host = spec.host
        self.table = spec.step_table
        self._cache: dict = {}

    def predict(self, seqs: tuple, num_logits: int) -> StepPrediction:
        key = (seqs, num_logits)
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            hit = self._cache[key] = self.predictor.predict(list(seqs), num_logits)
        return hit

    def step_seconds(self, out: SchedulerOutput) -> tuple[float, Optional[StepPrediction], int]:
        """(seconds, the cost model's prediction, logit rows) of a non-empty step."""
        seqs, num_logits = step_seqs(out)
        pred = self.predict(seqs, num_logits)
        if self.table is not None:
            context = sum(s.num_computed_tokens for s in out.scheduled) / len(out.scheduled)
            ratio = self.table.ratio(out.num_prefill_tokens == 0, out.total_num_scheduled_tokens, context)
            return pred.seconds * ratio, pred, num_logits
        sampled_rows = sum(1 for s in out.scheduled if s.will_sample)
        host = self.host.per_seq_s * len(out.scheduled) + self.host.per_token_s * sampled_rows
        return pred.seconds + host, pred, num_logits
