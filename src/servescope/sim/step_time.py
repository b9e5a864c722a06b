"""The simulator's clock: how long a scheduled step takes, as the engine's StepRecords predict it.

The step's sequences are handed to the cost model exactly as engine/llm_engine.py hands them for its
own prediction (a verification as 1 + k one-token rows), through analysis/step_prediction.py, which
adds the collectives at TP x PP and the spec's host overhead per step, per layer and per sequence. On
top comes what the cost model does not price (`HostCosts`): the detokeniser's work per output token and the
engine's work between two steps, so that a step lasts its period (start to the next step's start), as a
TPOT counts it.
Or, with a measured step table (sim/step_table.py), the prediction times the measured / predicted ratio
of steps of its kind, context and size.

Predictions are memoised on the step's shape as the cost model sees it: the prefill rows exactly (each
(num_new, context) in order), the one-token rows (decodes, verification rows) as their count and their
mean context rounded to the spec's `context_quantum` tokens; a miss predicts the step with every
one-token row at that rounded mean. A steady decode batch's exact shape never repeats (every context
grows by one a step); its quantised one repeats for about `context_quantum` steps. What that costs: the
one-token rows' KV reads are those of the rounded mean (off by at most quantum / 2 tokens a row, as
often over as under), and a cost the cost model adds per row rather than per token of context would be
averaged over the batch's rows (with sliding windows, min(context, window) of the mean instead of the
mean of the mins). benchmarks/sim_cluster_hour.py --check-every measures the error against the
unmemoised prediction; docs/BENCHMARKS.md has it. context_quantum 0: exact shapes, no rounding.
"""

from __future__ import annotations

from typing import Sequence

from servescope.analysis.step_prediction import StepPrediction
from servescope.scheduler.output import SchedulerOutput
from servescope.sim.spec import InstanceSpec

# Entries the memo holds before it starts afresh. A steady decode batch's shapes are a few hundred (count x
# rounded mean context); a step with a prefill in it is nearly always a new shape (its prompt's exact rows), and
# each entry keeps a prediction with its ops (~3 KB): a larger memo only holds more of those, which a cluster
# hour allocates by the hundred megabytes and reads back from main memory.
CACHE_ENTRIES = 1 << 12


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
        self.quantum = spec.context_quantum
        self._cache: dict = {}

    def predict(self, seqs: tuple, num_logits: int) -> StepPrediction:
        """The prediction of the step's rows as memoised (quantised one-token rows: the module's docstring)."""
        return self._memo(seqs, num_logits)[0]

    def _memo(self, seqs: tuple, num_logits: int) -> tuple:
        """(prediction, its bound) of the step's rows, memoised on their shape. The bound is the prediction's
        own (CostBreakdown.bound), kept beside it because that property sums over the ops on every read
        (~4 us, once a step for SimEngine.bound_seconds: ~10 s of a simulated cluster hour)."""
        return self._lookup(*self.shape(seqs, num_logits), num_logits)

    def _lookup(self, key: tuple, rows: list, num_logits: int) -> tuple:
        hit = self._cache.get(key)
        if hit is None:
            if len(self._cache) >= CACHE_ENTRIES:
                self._cache.clear()
            pred = self.predictor.predict(rows, num_logits)
            hit = self._cache[key] = (pred, pred.cost.bound)
        return hit

    def shape(self, seqs: tuple, num_logits: int) -> tuple:
        """(memo key, the rows the prediction is made on) of a step's rows."""
        if not self.quantum:
            return (seqs, num_logits), list(seqs)
        ones, context, longer = 0, 0, []
        for n, c in seqs:
            if n == 1:
                ones += 1
                context += c
            else:
                longer.append((n, c))
        return self._quantised(ones, context, tuple(longer), num_logits)

    def _quantised(self, ones: int, context: int, longer: tuple, num_logits: int) -> tuple:
        """shape() of `ones` one-token rows whose contexts sum to `context`, then the `longer` rows."""
        mean = self._mean(context, ones) if ones else 0
        return (ones, mean, longer, num_logits), [(1, mean)] * ones + list(longer)

    def _mean(self, context: int, ones: int) -> int:
        q = self.quantum
        return round(context / q / ones) * q

    def decode_shape(self, num_seqs: int, context_sum: int):
        """What decode_seconds of num_seqs decodes whose contexts sum to context_sum depends on besides num_seqs:
        their rounded mean context; None when it depends on more (exact shapes, or a step table's context)."""
        return self._mean(context_sum, num_seqs) if self.quantum and self.table is None else None

    def step_seconds(self, out: SchedulerOutput) -> tuple[float, StepPrediction, str]:
        """(seconds, the cost model's prediction, its bound: compute or memory) of a non-empty step."""
        seqs, num_logits = step_seqs(out)
        scheduled = out.scheduled
        sampled_rows = sum(1 for s in scheduled if s.will_sample)
        context = sum(s.num_computed_tokens for s in scheduled) if self.table is not None else 0
        return self._seconds(self._memo(seqs, num_logits), len(scheduled), sampled_rows, out.num_prefill_tokens == 0,
                             out.total_num_scheduled_tokens, context)

    def decode_seconds(self, contexts: Sequence[int], shift: int,
                       context_sum: int) -> tuple[float, StepPrediction, str]:
        """step_seconds of a step of one-token decodes (no drafts) whose contexts before it are c + shift for c
        in `contexts` (in the step's order; they sum to context_sum + shift * len), every one sampling:
        sim/fast_forward.py plans such steps without a SchedulerOutput."""
        n = len(contexts)
        total = context_sum + shift * n
        if self.quantum:
            hit = self._lookup(*self._quantised(n, total, (), n), n)
        else:
            hit = self._memo(tuple([(1, c + shift) for c in contexts]), n)
        return self._seconds(hit, n, n, True, n, total)

    def _seconds(self, hit: tuple, num_seqs: int, sampled_rows: int, decode_only: bool, num_tokens: int,
                 context_sum: int) -> tuple[float, StepPrediction, str]:
        """step_seconds from the memoised (prediction, bound) of the step's rows and its counts: sequences, those
        that sample, whether no prefill tokens are in it, its tokens, its sequences' contexts before it, summed."""
        pred, bound = hit
        if self.table is not None:
            ratio = self.table.ratio(decode_only, num_tokens, context_sum / num_seqs)
            return pred.seconds * ratio, pred, bound
        return pred.seconds + self.host.per_step_s + self.host.per_token_s * sampled_rows, pred, bound
