"""Prompt logprobs in the step that prefills the prompt: which extra positions' logits the runner
returns, and handing their TokenLogprobs to the OutputProcessor.

A chunk covering prompt positions [c, c + n) of a P-token prompt yields the logits at positions
p < P - 1 (they score token p + 1). Positions already scored (a recompute after preemption) are not
asked again. Such requests bypass the prefix cache (scheduler), so their whole prompt is prefilled.
"""

from __future__ import annotations

from typing import NamedTuple

from servescope.sampling.prompt_logprobs import prompt_logprobs


class PromptSpan(NamedTuple):
    row: int  # index in the step's scheduled list
    lo: int  # offsets of the new tokens, in the chunk
    hi: int
    sample_id: str


def plan_prompt_spans(scheduled: list, outputs) -> list:
    """The PromptSpans of this step (empty when no scheduled request wants prompt logprobs)."""
    spans = []
    for row, seq in enumerate(scheduled):
        req = seq.request
        if req.sampling_params.prompt_logprobs is None:
            continue
        done = outputs.prompt_logprobs_done(req.request_id)
        if done is None:
            continue
        start = seq.num_computed_tokens
        first = max(start, done - 1)  # position done - 1 scores token `done`, the next one due
        last = min(start + seq.num_new_tokens, req.num_prompt_tokens - 1)
        if last > first:
            spans.append(PromptSpan(row, first - start, last - start, req.request_id))
    return spans


def record_prompt_logprobs(spans: list, scheduled: list, logits, outputs, vocab_size: int) -> None:
    """logits: [E, V], the spans' positions in order."""
    targets, tops = [], []
    for sp in spans:
        seq = scheduled[sp.row]
        ids = seq.request.prompt_token_ids
        base = seq.num_computed_tokens
        targets.extend(ids[base + j + 1] for j in range(sp.lo, sp.hi))
        tops.extend([seq.request.sampling_params.prompt_logprobs] * (sp.hi - sp.lo))
    entries = prompt_logprobs(logits, targets, tops, vocab_size)
    k = 0
    for sp in spans:
        n = sp.hi - sp.lo
        outputs.add_prompt_logprobs(sp.sample_id, entries[k:k + n])
        k += n
