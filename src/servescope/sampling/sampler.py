"""Sampler: one next token per request from a batch of logits, vectorised over the batch.

Shapes: B rows (one per request), V vocabulary entries (`vocab_size`; extra padded
columns of the logits are ignored).

Processing order (vLLM's, where it has one):
  0. grammar masks (structured outputs): tokens a row's grammar forbids get -inf, for the whole
     batch at once (structured/matcher.py); logprobs are still reported from the raw logits
  1. raw logprobs: log_softmax of the unmodified logits, float32 (only if a row asks)
  2. penalties on the raw logits: repetition (prompt + output), frequency, presence (output)
  3. min_tokens: EOS and stop_token_ids get -inf while len(output) < min_tokens
  3b. logits controls (logit_controls.py): logit_bias, allowed_token_ids, bad_words, thinking budget
  4. greedy rows (temperature < 1e-5, vLLM's epsilon): argmax, ties to the lowest index
  5. other rows: divide by temperature, top-k, top-p, min-p, then sample
Sampling is an exponential race: argmax(probs / q) with q ~ Exp(1) i.i.d. picks token i with
probability probs[i]. A seeded row draws its q from its own generator, one draw of V values
per step, so its tokens depend only on its seed and its own history, never on the batch.
Unseeded rows share the device's default generator.

Host syncs: exactly one per call, the copy of the results to the host (token ids, and the
packed logprob data when a row asks for it). Per-row parameters travel host -> device as
small tensors (pinned, non-blocking on CUDA). Nothing branches on device values.

Fast path: when every row is greedy and nothing changes the logits (no penalty, no
min_tokens mask) and no row wants logprobs, the sampler is one argmax on the logits as given.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, NamedTuple, Optional

import torch

from servescope.config import SAMPLING_EPS, SamplingParams
from servescope.sampling.filters import apply_top_k_top_p_min_p
from servescope.sampling.logit_controls import apply_logit_controls
from servescope.sampling.penalties import apply_penalties, host_to_device, mask_tokens

logger = logging.getLogger(__name__)

__all__ = [
    "SamplingState",
    "make_generator",
    "TokenLogprobs",
    "SamplerOutput",
    "Sampler",
    "apply_top_k_top_p_min_p",
    "SAMPLING_EPS",
]


def make_generator(seed: Optional[int], device) -> Optional[torch.Generator]:
    """A generator on `device` seeded with `seed`, or None when the request has no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


@dataclass
class SamplingState:
    """One request's sampling state, owned by the engine and kept across steps.

    The engine appends each sampled token to `output_token_ids` itself; the sampler only reads
    it (for penalties and min_tokens). `generator` advances by one draw per non-greedy step.
    """

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)
    generator: Optional[torch.Generator] = None
    grammar: Optional[object] = None  # a structured.Matcher when the request has a grammar

    @classmethod
    def new(cls, params: SamplingParams, prompt_token_ids: list[int], device) -> "SamplingState":
        """A fresh state with its generator built from params.seed on `device`."""
        return cls(params, list(prompt_token_ids), [], make_generator(params.seed, device))


@dataclass(frozen=True)
class TokenLogprobs:
    """Logprobs for one sampled token, from the raw (unpenalised, unscaled) logits."""

    token_id: int
    logprob: float
    rank: int  # 1 + number of other tokens at least as likely (vLLM: ties count against)
    top: list[tuple[int, float]]  # up to params.logprobs (token id, logprob), descending


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]  # one per row
    logprobs: list[Optional[TokenLogprobs]]  # None where the request did not ask
    mask_seconds: float = 0.0  # filling and applying grammar masks


class Distributions(NamedTuple):
    """What each row of a batch samples from (Sampler.distributions)."""

    probs: Optional[torch.Tensor]  # [B, V] float32 after masks, penalties, temperature, filters; None: all greedy
    greedy_ids: Optional[torch.Tensor]  # [B] argmax of the processed logits; None when no row is greedy
    greedy: list  # [B] bool
    mask_seconds: float  # filling and applying grammar masks


class Sampler:
    """Samples the next token of every row of a batch of logits.

    `eos_token_ids`: the model's end-of-sequence ids, masked (with each request's
    stop_token_ids) while a request has fewer than min_tokens outputs. A request with
    ignore_eos keeps EOS sampleable, as in vLLM (EOS is then not a stop token for it).
    """

    def __init__(self, vocab_size: int, eos_token_ids: Iterable[int] = ()):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)

    def __call__(self, logits: torch.Tensor, states: list[SamplingState]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits must be [B, V] with B = {len(states)} states, got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than vocab_size {self.vocab_size}")
        logits = logits[:, : self.vocab_size]  # [B, V]: drop padded vocabulary columns
        greedy = [s.params.greedy for s in states]
        token_ids, mask_seconds = self._sample(logits, states, greedy)  # [B] long, on device

        logprob_rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not logprob_rows:
            return SamplerOutput(token_ids.tolist(), [None] * len(states), mask_seconds)
        out = self._with_logprobs(logits, token_ids, states, logprob_rows)
        return SamplerOutput(out.token_ids, out.logprobs, mask_seconds)

    # -- sampling -------------------------------------------------------------------------

    def _sample(self, logits: torch.Tensor, states: list[SamplingState], greedy: list[bool]) -> tuple:
        """(token ids [B], seconds spent on grammar masks)."""
        token_ids, _, mask_seconds = self._draw(logits, states, greedy, keep_probs=False)
        return token_ids, mask_seconds

    def _draw(self, logits: torch.Tensor, states: list[SamplingState], greedy: list[bool],
              keep_probs: bool = True) -> tuple:
        """(token ids [B], the distributions sampled [B, V] (None when all rows are greedy, or not
        keep_probs: then the race divides them in place, no second [B, V] buffer), seconds spent on
        grammar masks)."""
        x, greedy_ids, mask_seconds = self._processed(logits, states, greedy)
        if x is None:
            return greedy_ids, None, mask_seconds
        probs = x.softmax(dim=-1)  # [B, V]
        noise = self._exponential_noise(probs, states, greedy)
        sampled = (probs / noise if keep_probs else probs.div_(noise)).argmax(dim=-1)  # [B]
        if any(greedy):
            sampled = torch.where(host_to_device(greedy, torch.bool, logits.device), greedy_ids, sampled)
        assert sampled.shape == (len(states),)
        return sampled, probs if keep_probs else None, mask_seconds

    def draw(self, logits: torch.Tensor, states: list[SamplingState]) -> tuple:
        """(token ids [B] on the device, the processed distributions [B, V] they were sampled from or
        None when every row is greedy): what __call__ samples, without logprobs or host copies. A draft
        model proposes with it (spec/draft.py) and keeps the distributions for rejection sampling."""
        logits = logits[:, : self.vocab_size]  # [B, V]
        token_ids, probs, _ = self._draw(logits, states, [s.params.greedy for s in states])
        return token_ids, probs

    def distributions(self, logits: torch.Tensor, states: list[SamplingState]) -> Distributions:
        """What each row samples from, without sampling (grammar masks included): see Distributions.
        Speculative verification (spec/) scores drafts with it."""
        logits = logits[:, : self.vocab_size]  # [B, V]
        greedy = [s.params.greedy for s in states]
        x, greedy_ids, mask_seconds = self._processed(logits, states, greedy)
        return Distributions(None if x is None else x.softmax(dim=-1), greedy_ids, greedy, mask_seconds)

    def _processed(self, logits: torch.Tensor, states: list[SamplingState], greedy: list[bool]) -> tuple:
        """(logits [B, V] after grammar masks, penalties, min_tokens, temperature and filters, or None
        when every row is greedy; the greedy choice [B], None when no row is greedy; seconds spent on
        grammar masks). One float32 copy of the logits at most; the caller's logits are not changed."""
        device = logits.device
        params = [s.params for s in states]
        rep_rows = [p.repetition_penalty != 1.0 for p in params]
        out_rows = [r or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 for r, p in zip(rep_rows, params)]
        mask_r, mask_t = self._min_tokens_mask(states)
        grammar = any(s.grammar is not None for s in states)
        controls = any(p.has_logit_controls for p in params)

        if all(greedy) and not any(out_rows) and not mask_r and not grammar and not controls:
            return None, logits.argmax(dim=-1), 0.0  # fast path, on the logits as given (any dtype)

        x = logits.to(dtype=torch.float32, memory_format=torch.contiguous_format, copy=True)  # [B, V]
        mask_seconds = 0.0
        if grammar:
            from servescope.structured import apply_grammar_masks  # optional dependency (xgrammar)

            mask_seconds = apply_grammar_masks(x, [s.grammar for s in states])
        if any(out_rows):
            apply_penalties(
                x,
                [s.prompt_token_ids if r else () for s, r in zip(states, rep_rows)],
                [s.output_token_ids if o else () for s, o in zip(states, out_rows)],
                host_to_device([p.repetition_penalty for p in params], torch.float32, device),
                host_to_device([p.presence_penalty for p in params], torch.float32, device),
                host_to_device([p.frequency_penalty for p in params], torch.float32, device),
            )
        mask_tokens(x, mask_r, mask_t)
        if controls:
            apply_logit_controls(x, states)

        greedy_ids = x.argmax(dim=-1) if any(greedy) else None  # [B]
        if all(greedy):
            return None, greedy_ids, mask_seconds

        # greedy rows get temperature 1 so that they stay finite; their sample is discarded
        temps = [1.0 if g else p.temperature for g, p in zip(greedy, params)]
        x.div_(host_to_device(temps, torch.float32, device).unsqueeze(1))
        k = [p.top_k if 0 < p.top_k < self.vocab_size else 0 for p in params]
        top_p = [p.top_p for p in params]
        min_p = [p.min_p for p in params]
        use_k, use_p, use_min_p = any(k), any(v < 1.0 for v in top_p), any(v > 0.0 for v in min_p)
        if use_k or use_p or use_min_p:
            x = apply_top_k_top_p_min_p(
                x,
                host_to_device(k, torch.long, device) if use_k else None,
                host_to_device(top_p, torch.float32, device) if use_p else None,
                host_to_device(min_p, torch.float32, device) if use_min_p else None,
            )
        return x, greedy_ids, mask_seconds

    def _exponential_noise(self, probs: torch.Tensor, states: list[SamplingState], greedy: list[bool]) -> torch.Tensor:
        """Exp(1) noise [B, V]; a seeded non-greedy row draws its row from its own generator."""
        q = torch.empty_like(probs)
        seeded = [i for i, (s, g) in enumerate(zip(states, greedy)) if not g and s.generator is not None]
        if len(seeded) < len(states):
            # unseeded rows (and greedy rows, whose sample is discarded) use the default generator;
            # a greedy row never advances its own generator
            q.exponential_()
        for i in seeded:
            q[i].exponential_(generator=states[i].generator)  # one V-sized draw, as a lone row would
        # Exp(1) may round to 0; a zero would make 0/0 = nan (argmax picks nan) or p/0 = inf
        return q.clamp_(min=torch.finfo(q.dtype).tiny)

    def exponential_noise(self, probs: torch.Tensor, states: list[SamplingState], greedy: list[bool]) -> torch.Tensor:
        """Exp(1) noise [B, V] as the sampler draws it (argmax(probs / noise) samples probs)."""
        return self._exponential_noise(probs, states, greedy)

    def _min_tokens_mask(self, states: list[SamplingState]) -> tuple[list[int], list[int]]:
        """(row, token) pairs to mask: stop ids of rows with fewer than min_tokens outputs."""
        rows: list[int] = []
        toks: list[int] = []
        for i, s in enumerate(states):
            p = s.params
            if len(s.output_token_ids) >= p.min_tokens:
                continue
            stop_ids = set(p.stop_token_ids)
            if not p.ignore_eos:
                stop_ids.update(self.eos_token_ids)
            for t in sorted(stop_ids):
                if 0 <= t < self.vocab_size:
                    rows.append(i)
                    toks.append(t)
        return rows, toks

    # -- logprobs -------------------------------------------------------------------------

    def logprobs_of(self, logits: torch.Tensor, token_ids: list[int], states: list[SamplingState]) -> SamplerOutput:
        """Logprobs of given tokens (rows whose state asks for them): the tokens speculative
        verification chose, one row of the target's logits each."""
        logits = logits[:, : self.vocab_size]
        rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
        if not rows:
            return SamplerOutput(list(token_ids), [None] * len(states))
        ids = torch.tensor(token_ids, dtype=torch.long, device=logits.device)
        return self._with_logprobs(logits, ids, states, rows)

    def _with_logprobs(
        self, logits: torch.Tensor, token_ids: torch.Tensor, states: list[SamplingState], lp_rows: list[int]
    ) -> SamplerOutput:
        rows = len(states)
        device = logits.device
        if len(lp_rows) < rows:
            index = host_to_device(lp_rows, torch.long, device)
            raw, chosen = logits.index_select(0, index), token_ids.index_select(0, index)  # [R, V], [R]
        else:
            raw, chosen = logits, token_ids
        lp = torch.log_softmax(raw.to(torch.float32), dim=-1)  # [R, V] raw logprobs
        chosen_lp = lp.gather(1, chosen.unsqueeze(1))  # [R, 1]
        rank = (lp >= chosen_lp).sum(dim=-1)  # [R]
        n_top = min(max(states[i].params.logprobs for i in lp_rows), self.vocab_size)
        parts = [token_ids.double(), chosen_lp.squeeze(1).double(), rank.double()]
        if n_top:
            top_lp, top_ids = lp.topk(n_top, dim=-1)  # [R, n_top] each, descending
            parts += [top_ids.double().flatten(), top_lp.double().flatten()]
        # one device -> host copy for everything; float64 holds token ids and float32 values exactly
        host = torch.cat(parts).tolist()

        r = len(lp_rows)
        ids = [int(t) for t in host[:rows]]
        chosen_lps = host[rows : rows + r]
        ranks = host[rows + r : rows + 2 * r]
        top_ids_h = host[rows + 2 * r : rows + 2 * r + r * n_top]
        top_lps_h = host[rows + 2 * r + r * n_top :]
        out: list[Optional[TokenLogprobs]] = [None] * rows
        for j, i in enumerate(lp_rows):
            n = min(states[i].params.logprobs, n_top)
            base = j * n_top
            top = [(int(top_ids_h[base + c]), top_lps_h[base + c]) for c in range(n)]
            out[i] = TokenLogprobs(ids[i], chosen_lps[j], int(ranks[j]), top)
        return SamplerOutput(ids, out)
