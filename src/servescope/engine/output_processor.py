"""OutputProcessor: what the engine does with sampled tokens, beyond the scheduler's bookkeeping.

Per sampled token of a sample (one scheduler Request of a user request of n samples):
  - its logprobs, when asked for, are accumulated (and their running sum);
  - its time is stamped into the sample's RequestMetrics;
  - it ends the sample on EOS (unless ignore_eos) or a stop token id; otherwise it is
    detokenised incrementally and the text checked for stop strings (from min_tokens outputs on),
    the output trimmed at the stop; then on max_tokens or the model's context length;
  - a finished sample's metrics are completed and the scheduler told (its blocks freed at once).
Per step it hands back one RequestOutput per user request that changed; while a sample runs its
text excludes the trailing characters that may still turn into a stop string.

It sees the scheduler's Request objects (whose output_token_ids the scheduler appends) but never
the model; tests drive it with a fake tokenizer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Optional

from servescope.config import SamplingParams
from servescope.engine.outputs import CompletionOutput, RequestOutput
from servescope.sampling.sampler import SamplingState, TokenLogprobs
from servescope.sampling.stop import find_stop_string, max_stop_holdback
from servescope.scheduler.output import SchedulerOutput
from servescope.scheduler.request import Request, RequestStatus
from servescope.telemetry.request_metrics import RequestMetrics
from servescope.tokenizer import IncrementalDetokenizer

FINISH_STATUS = {"stop": RequestStatus.FINISHED_STOPPED, "length": RequestStatus.FINISHED_LENGTH,
                 "abort": RequestStatus.FINISHED_ABORTED, "error": RequestStatus.FINISHED_ERROR}


class SampledToken(NamedTuple):
    token_id: int
    logprobs: Optional[TokenLogprobs]  # None unless the request asked for logprobs


@dataclass
class Sample:
    """Output-side state of one sample (one scheduler Request) of a user request."""

    index: int
    request: Request
    state: SamplingState  # the sampler's state, kept across steps
    detok: Optional[IncrementalDetokenizer]  # None without a tokenizer
    metrics: RequestMetrics
    text: str = ""
    finish_reason: Optional[str] = None
    stop_reason: object = None
    logprobs: Optional[list] = None  # list[TokenLogprobs] when asked for
    cumulative_logprob: float = 0.0


@dataclass
class RequestGroup:
    """A user request: n samples sharing one prompt (their full prompt blocks are shared through the
    prefix cache, by reference count)."""

    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list
    params: SamplingParams
    samples: list = field(default_factory=list)
    error: Optional[str] = None
    # [None] + one TokenLogprobs per scored prompt token when params.prompt_logprobs is set
    # (computed by the first sample only; after a preemption its recompute does not add them again)
    prompt_logprobs: Optional[list] = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    """tokenizer: detokenises outputs (None: no text). eos_token_ids: the model's end ids.
    max_model_len: a sample ends ("length") when prompt + output reach it. finish_request(request
    id, status): frees a finished sample's blocks (Scheduler.finish_request)."""

    def __init__(self, tokenizer, eos_token_ids, max_model_len: int,
                 finish_request: Callable[[str, RequestStatus], None]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self._finish_request = finish_request
        self._groups: dict[str, RequestGroup] = {}
        self._samples: dict[str, tuple] = {}  # scheduler request id -> (group, sample)
        self._changed: dict[str, RequestGroup] = {}  # this step's, in the order they changed

    # ------------------------------------------------------------------ requests
    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    def add(self, request_id: str, prompt: Optional[str], prompt_token_ids: list, params: SamplingParams,
            samples: list, arrival_time: float) -> None:
        """Track a user request; samples: one (Request, SamplingState) per sample, in index order."""
        group = RequestGroup(request_id, prompt, prompt_token_ids, params,
                             prompt_logprobs=[None] if params.prompt_logprobs is not None else None)
        for i, (req, state) in enumerate(samples):
            sp = state.params
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids,
                                               skip_special_tokens=sp.skip_special_tokens)
            metrics = RequestMetrics(arrival_time=arrival_time, num_prompt_tokens=len(prompt_token_ids))
            sample = Sample(i, req, state, detok, metrics, logprobs=[] if sp.logprobs is not None else None)
            group.samples.append(sample)
            self._samples[req.request_id] = (group, sample)
        self._groups[request_id] = group

    def sampling_state(self, sample_id: str) -> SamplingState:
        return self._samples[sample_id][1].state

    def prompt_logprobs_done(self, sample_id: str) -> Optional[int]:
        """How many prompt positions already have their logprobs (the first has none), when this
        sample is the one of its request that computes them; None otherwise."""
        group, sample = self._samples[sample_id]
        if group.prompt_logprobs is None or sample.index != 0:
            return None
        return len(group.prompt_logprobs)

    def add_prompt_logprobs(self, sample_id: str, entries: list) -> None:
        """The next prompt positions' TokenLogprobs, in order (see prompt_logprobs_done)."""
        group = self._samples[sample_id][0]
        group.prompt_logprobs.extend(entries)

    def abort(self, request_id: str) -> bool:
        """Forget a user request; its unfinished samples end with "abort" (no output is made)."""
        group = self._groups.pop(request_id, None)
        if group is None:
            return False
        for s in group.samples:
            self._samples.pop(s.request.request_id, None)
            if s.finish_reason is None:
                s.finish_reason = "abort"
                self._finish_request(s.request.request_id, RequestStatus.FINISHED_ABORTED)
        return True

    # ------------------------------------------------------------------ one step
    def begin_step(self, out: SchedulerOutput, now: float) -> None:
        """Before the model runs: requests the scheduler refused end with its error; the scheduled
        ones get their first-scheduled time."""
        self._changed = {}
        for req in out.finished_requests:  # the scheduler refused these (they can never fit)
            gs = self._samples.get(req.request_id)
            if gs:
                group, sample = gs
                sample.finish_reason = "error"
                group.error = req.error
                sample.metrics.finished_time = now
                self._changed[group.request_id] = group
        for seq in out.scheduled:
            m = self._samples[seq.request.request_id][1].metrics
            if m.first_scheduled_time is None:
                m.first_scheduled_time = now

    def add_tokens(self, sampled: dict, now: float) -> None:
        """sampled: {sample id: SampledToken, or a list of them (a speculative step's accepted drafts and
        the target's token)}, already appended to the Requests by the scheduler. A sample that finishes
        at one of several tokens keeps the tokens up to it and drops the rest."""
        for rid, toks in sampled.items():
            group, sample = self._samples[rid]
            toks = [toks] if isinstance(toks, SampledToken) else toks
            base = sample.request.num_output_tokens - len(toks)  # outputs before this step's tokens
            for i, (tok, lp) in enumerate(toks):
                if sample.logprobs is not None and lp is not None:
                    sample.logprobs.append(lp)
                    sample.cumulative_logprob += lp.logprob
                sample.metrics.token_times.append(now)
                if sample.state.grammar is not None and not sample.state.grammar.accept(tok):
                    # the mask makes this impossible; end the sample rather than break its grammar
                    group.error = f"token {tok} violates the request's grammar"
                    self._finish(sample, "error")
                else:
                    self._check_token(sample, tok, base + i + 1)
                if sample.finish_reason is not None:
                    sample.request.truncate_output(base + i + 1)
                    break
            self._changed[group.request_id] = group

    def record_speculation(self, sample_id: str, num_drafts: int, num_accepted: int) -> None:
        """Count a verified step's drafts and accepted drafts in the sample's metrics."""
        m = self._samples[sample_id][1].metrics
        m.num_draft_tokens += num_drafts
        m.num_accepted_tokens += num_accepted

    def end_step(self) -> list:
        """A RequestOutput per user request that changed this step; finished ones are forgotten."""
        outputs = []
        for group in self._changed.values():
            outputs.append(make_output(group))
            if group.finished:
                self._groups.pop(group.request_id, None)
                for s in group.samples:
                    self._samples.pop(s.request.request_id, None)
        self._changed = {}
        return outputs

    # ------------------------------------------------------------------ stop conditions
    def _check_token(self, sample: Sample, tok: int, n_out: int) -> None:
        """n_out: the sample's output count with this token."""
        req, sp = sample.request, sample.state.params
        is_eos = tok in self.eos_token_ids and not sp.ignore_eos
        finish, stop_reason = None, None
        # the sampler masks EOS and stop_token_ids until min_tokens outputs exist
        if is_eos or tok in sp.stop_token_ids:
            finish, stop_reason = "stop", (tok if tok in sp.stop_token_ids else None)
        elif sample.detok is not None:
            delta = sample.detok.add(tok)
            if delta:
                sample.text += delta
                if sp.stop and n_out >= sp.min_tokens:
                    found = find_stop_string(sample.text, len(delta), sp.stop)
                    if found is not None:
                        idx, stop_reason = found
                        cut = idx + len(stop_reason) if sp.include_stop_str_in_output else idx
                        sample.text = sample.text[:cut]
                        finish = "stop"
        if finish is None and (n_out >= sp.max_tokens or req.num_prompt_tokens + n_out >= self.max_model_len):
            finish = "length"
        if finish is not None:
            self._finish(sample, finish, stop_reason)

    def _finish(self, sample: Sample, reason: str, stop_reason=None) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        sample.metrics.finished_time = time.perf_counter()
        sample.metrics.num_cached_tokens = max(sample.request.num_cached_tokens, 0)
        sample.metrics.num_preemptions = sample.request.num_preemptions
        self._finish_request(sample.request.request_id, FINISH_STATUS[reason])


def make_output(group: RequestGroup) -> RequestOutput:
    """The cumulative RequestOutput of a user request now (a running sample's text is held back by
    the longest stop string less one character, which may be the start of a stop)."""
    outs = []
    for s in group.samples:
        text = s.text
        if s.finish_reason is None and s.state.params.stop:
            hold = max_stop_holdback(s.state.params.stop)
            text = text[:max(0, len(text) - hold)]
        outs.append(CompletionOutput(
            index=s.index, text=text, token_ids=list(s.request.output_token_ids),
            finish_reason=s.finish_reason, stop_reason=s.stop_reason,
            logprobs=list(s.logprobs) if s.logprobs is not None else None,
            cumulative_logprob=s.cumulative_logprob if s.logprobs is not None else None,
            metrics=s.metrics))
    cached = max((s.request.num_cached_tokens for s in group.samples), default=0)
    plp = group.prompt_logprobs
    return RequestOutput(group.request_id, group.prompt, group.prompt_token_ids, outs,
                         finished=group.finished, error=group.error, num_cached_tokens=max(cached, 0),
                         prompt_logprobs=list(plp) if plp is not None else None)
