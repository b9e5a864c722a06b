"""Pipeline micro-batches: where a step's tokens are cut, and how long the cut step takes on P stages
(pure functions, no torch).

A pipeline-parallel step cuts its T flat tokens into M micro-batches of consecutive tokens (a cut may
fall inside a prompt's chunk: its two pieces are then two chunks of one chunked prefill). Each stage
runs the micro-batches in order and hands each one's (h, residual) to the next stage as soon as it is
done, so stage s + 1 computes micro-batch i while stage s computes i + 1. One step's forward under
GPipe's schedule: stage s starts micro-batch i when it has finished i - 1 and stage s - 1's hand-over
of i has arrived,

    F[i][s] = max(F[i - 1][s], F[i][s - 1] + p2p[i]) + c[i][s]

and the step ends at F[M - 1][P - 1] (then the head's logits go back to rank 0). The split is not
free: every micro-batch reads its stage's weights again, so a memory-bound decode step cut in M
pieces reads M times the bytes; cutting pays where the pieces are compute-bound (larger batches,
prefill), which is what `step_seconds` weighs.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from servescope.analysis.collectives import (LinkSpec, all_reduce_seconds, expert_parallel_cost, gather_seconds,
                                             p2p_seconds, shard_config)
from servescope.analysis.cost_model import step_cost
from servescope.analysis.kv_stages import stage_configs
from servescope.config import ModelConfig


def cut_points(num_tokens: int, num_micro: int, forbidden: tuple = ()) -> list:
    """Token offsets in (0, T), ascending, at most num_micro - 1 of them, each the allowed offset
    nearest to k * T / M; `forbidden`: open intervals (a, b) no cut may fall in (a sequence that reads
    a block a later one writes in the same step must stay in a micro-batch with it)."""
    cuts: list = []
    if num_micro <= 1 or num_tokens < 2:
        return cuts

    def allowed(p: int) -> bool:
        return (cuts[-1] if cuts else 0) < p < num_tokens and not any(a < p < b for a, b in forbidden)

    for k in range(1, min(num_micro, num_tokens)):
        ideal = round(k * num_tokens / num_micro)
        near = next((p for d in range(num_tokens) for p in (ideal - d, ideal + d) if allowed(p)), None)
        if near is not None:
            cuts.append(near)
    return cuts


def split_seqs(seqs: list, cuts: list) -> list:
    """[(num_new_tokens, num_context_before)] of the step -> the same for each micro-batch (a sequence
    cut in two: its first piece, then the rest with the first piece's tokens as context)."""
    bounds = list(cuts) + [sum(n for n, _ in seqs)]
    pieces, cur, pos, b = [], [], 0, 0
    for n, ctx in seqs:
        done = 0
        while done < n:
            take = min(n - done, bounds[b] - pos)
            if take:
                cur.append((take, ctx + done))
                done, pos = done + take, pos + take
            if pos == bounds[b] and b < len(bounds) - 1:
                pieces.append(cur)
                cur, b = [], b + 1
    pieces.append(cur)
    return [p for p in pieces if p]


@dataclass(frozen=True)
class PipelineSchedule:
    """One step's forward over P stages in M micro-batches (seconds)."""

    stage_seconds: tuple  # [M][P]: micro-batch i's compute on stage s (with its TP all-reduces)
    handover_seconds: tuple  # [M]: micro-batch i's (h, residual) from one stage to the next
    total_seconds: float  # the last stage's end
    fill_seconds: float  # until the last stage starts micro-batch 0
    stall_seconds: float  # the last stage waiting between micro-batches
    p2p_seconds: float  # every hand-over (overlapped or on the critical path)

    @property
    def num_micro_batches(self) -> int:
        return len(self.stage_seconds)

    @property
    def busy_seconds(self) -> tuple:
        """Each stage's compute over the step."""
        return tuple(sum(row[s] for row in self.stage_seconds) for s in range(len(self.stage_seconds[0])))

    @property
    def bubble_fraction(self) -> float:
        """The share of stage-seconds idle in the step: 1 - sum(busy) / (P x total)."""
        busy = self.busy_seconds
        return 1.0 - sum(busy) / (len(busy) * self.total_seconds) if self.total_seconds else 0.0


def schedule(stage_seconds: list, handover_seconds: list) -> PipelineSchedule:
    """GPipe's forward schedule (the recurrence in the module docstring)."""
    m, p = len(stage_seconds), len(stage_seconds[0])
    finish = [[0.0] * p for _ in range(m)]
    start_last = []
    for i in range(m):
        for s in range(p):
            ready = finish[i][s - 1] + handover_seconds[i] if s else 0.0
            begin = max(finish[i - 1][s] if i else 0.0, ready)
            if s == p - 1:
                start_last.append(begin)
            finish[i][s] = begin + stage_seconds[i][s]
    busy_last = sum(row[-1] for row in stage_seconds)
    total = finish[-1][-1]
    return PipelineSchedule(tuple(tuple(r) for r in stage_seconds), tuple(handover_seconds), total, start_last[0],
                            total - start_last[0] - busy_last, (p - 1) * sum(handover_seconds))


def pipeline_step(cfg: ModelConfig, seqs: list, hw, pp: int, num_micro: int, link: Optional[LinkSpec],
                  tp: int = 1, dtypes: tuple = ("float32", "float32", "float32", 4),
                  share: float = 1.0, ep: int = 1) -> PipelineSchedule:
    """The schedule of one step over `pp` stages cut in up to `num_micro` micro-batches. cfg: the
    model one tensor-parallel rank holds (all layers; each stage keeps its share), dtypes (weight, kv,
    act, act bytes), share: how many ranks share the spec's machine (a CPU spec: every rank of the
    engine; 1 where each rank is a device). The head's logits are computed after the last micro-batch
    (on the last stage) and are not in the schedule; `head_seconds` gives them. ep: expert-parallel ranks
    inside each stage (a rank's share of the routed experts, and the stage's all-to-alls and all-gathers)."""
    wdt, kdt, adt, act_bytes = dtypes
    pieces = split_seqs(seqs, cut_points(sum(n for n, _ in seqs), num_micro))
    per_stage = stage_configs(cfg, pp)  # each stage's own layers: their attention kinds and MLPs
    rows, handover = [], []
    for piece in pieces:
        act = sum(n for n, _ in piece) * cfg.hidden_size * act_bytes  # one [t, Dm] activation
        row = []
        for s, stage_cfg in enumerate(per_stage):
            n_layers = stage_cfg.num_hidden_layers
            cost = step_cost(stage_cfg, piece, hw, wdt, kdt, adt, num_logits=0,
                             overhead_s=n_layers * hw.layer_overhead_s, expert_parallel=ep)
            # the head runs once, after the pipeline (head_seconds); only stage 0 embeds
            c = (cost.predicted_seconds - cost.op("lm_head").seconds - (s > 0) * cost.op("embedding").seconds) * share
            if link is not None and tp > 1:  # two all-reduces per layer, one after stage 0's embedding
                c += (2 * n_layers + (s == 0)) * all_reduce_seconds(act, tp, link)
            if link is not None and ep > 1:
                c += sum(expert_parallel_cost(stage_cfg, sum(n for n, _ in piece), ep, link, act_bytes)[:2])
            row.append(c)
        rows.append(row)
        handover.append(p2p_seconds(2 * act, link) if link is not None else 0.0)
    return schedule(rows, handover)


def head_seconds(cfg: ModelConfig, seqs: list, hw, num_logits: int, dtypes: tuple, share: float = 1.0) -> float:
    """The head's `num_logits` rows on the last stage (after the pipeline drains)."""
    wdt, kdt, adt, _ = dtypes
    one = dataclasses.replace(cfg, num_hidden_layers=1)
    return step_cost(one, seqs, hw, wdt, kdt, adt, num_logits=num_logits, overhead_s=0.0).op("lm_head").seconds * share


# auto: a step is cut only where it has prefill tokens enough for this many per micro-batch. A
# decode-only step stays whole: it is memory-bound, and cut, each piece reads the stage's weights
# again (measured, docs/BENCHMARKS.md "Pipeline micro-batches": decode steps took longer in 2
# micro-batches, and the cost model predicts the same direction)
AUTO_MIN_PREFILL_TOKENS_PER_MICRO_BATCH = 8


def auto_micro_batches(num_prefill_tokens: int, pp: int, asked: int = 0) -> int:
    """Micro-batches for a step with num_prefill_tokens (tokens not in a one-token decode) on pp
    stages: `asked` when set (> 0), else P for a step of at least P x 8 prefill tokens, else 1."""
    if pp <= 1:
        return 1
    if asked:
        return asked
    return pp if num_prefill_tokens >= AUTO_MIN_PREFILL_TOKENS_PER_MICRO_BATCH * pp else 1


@dataclass(frozen=True)
class PipelinedStep:
    """A pipeline-parallel step, predicted: the stages' schedule, then the head and the logits' way
    back to rank 0 (seconds)."""

    schedule: PipelineSchedule
    head_seconds: float  # the last stage's final norm and head (its shard, at TP > 1)
    logits_seconds: float  # gathering the vocabulary shards (TP > 1) and sending the logits to rank 0
    overhead_seconds: float  # the step's host cost on rank 0 (per step and per sequence)
    compute_only: tuple = ()  # [M][P]: schedule.stage_seconds without the stages' all-reduces

    @property
    def step_seconds(self) -> float:
        return self.overhead_seconds + self.schedule.total_seconds + self.head_seconds + self.logits_seconds

    @property
    def comm_seconds(self) -> float:
        """Every hand-over and collective of the step (overlapped ones included)."""
        s = self.schedule
        reduces = sum(sum(row) for row in s.stage_seconds) - sum(sum(row) for row in self.compute_only)
        return s.p2p_seconds + reduces + self.logits_seconds


def pipelined_step(cfg: ModelConfig, seqs: list, hw, tp: int, pp: int, num_micro: int, link: Optional[LinkSpec],
                   dtypes: tuple, share: float = 1.0, num_logits: Optional[int] = None, ep: int = 1) -> PipelinedStep:
    """The whole step at TP x PP (EP inside each stage) in up to num_micro micro-batches (cfg: the full model;
    one rank computes its tensor-parallel shard of its stage's layers)."""
    shard = shard_config(cfg, tp, ep)
    n_logits = len(seqs) if num_logits is None else num_logits
    sched = pipeline_step(shard, seqs, hw, pp, num_micro, link, tp, dtypes, share, ep)
    bare = pipeline_step(shard, seqs, hw, pp, num_micro, None, tp, dtypes, share, ep)
    logits = 0.0
    if link is not None and n_logits:
        logits = (gather_seconds(n_logits * shard.vocab_size * 4, tp, link)
                  + p2p_seconds(n_logits * cfg.vocab_size * 4, link))
    return PipelinedStep(sched, head_seconds(shard, seqs, hw, n_logits, dtypes, share) if n_logits else 0.0, logits,
                         hw.step_overhead_s + len(seqs) * hw.seq_overhead_s, bare.stage_seconds)
