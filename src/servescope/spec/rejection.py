"""Verification of drafts by rejection sampling, on the target's logits at every draft position.

Shapes: R rows = sum over requests of (1 + k_i): for request i, rows [base_i, base_i + k_i) score its
drafts d_0..d_{k_i - 1} and row base_i + k_i is the bonus position (after every draft); V vocabulary.

Row j of a request is processed with the history the request would have if d_0..d_{j-1} were accepted
(penalties, min_tokens), by the engine's own Sampler (`Sampler.distributions`), so that p is exactly
what plain decoding would sample from at that position.

  greedy rows  t_j = argmax p_j; drafts are accepted while d_j == t_j; then t_j is emitted (the
               correction, or the bonus token t_k when all were accepted): identical to plain greedy.
  sampled rows accept d_j with probability min(1, p_j(d_j) / q_j(d_j)); at the first rejection emit a
               sample of max(p_j - q_j, 0) (normalised); when all are accepted emit a sample of p_k.
               The emitted tokens then follow p exactly (Leviathan et al. 2023, Chen et al. 2023).
               q is the draft model's distribution, or one-hot at d_j for a deterministic proposer
               (n-gram): accept with probability p_j(d_j), else sample p_j with d_j removed.
One device -> host copy for the decisions (plus one for logprobs when a request asks for them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from servescope.sampling.sampler import Sampler, SamplingState


@dataclass(frozen=True)
class Verified:
    """One request's outcome: the tokens to append (accepted drafts, then the target's own token)."""

    token_ids: list[int]
    num_drafts: int
    num_accepted: int
    logprobs: list  # per token, TokenLogprobs or None


def reads_history(state: SamplingState) -> bool:
    """Whether the sampler's processing of this request's logits depends on its output so far
    (penalties, a min_tokens mask still in force): then each draft position needs its own state."""
    p = state.params
    return (p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0
            or len(state.output_token_ids) < p.min_tokens)


def position_states(state: SamplingState, drafts: list[int]) -> list[SamplingState]:
    """The state at each of the 1 + k positions: as if the drafts before it were accepted. (The same
    state at every position when nothing the sampler does reads the output history.)"""
    if not reads_history(state):
        return [state] * (len(drafts) + 1)
    out = [state]
    for j in range(1, len(drafts) + 1):
        out.append(SamplingState(state.params, state.prompt_token_ids,
                                 list(state.output_token_ids) + list(drafts[:j]), state.generator))
    return out


@dataclass(frozen=True)
class Verification:
    results: list  # [Verified], one per request
    mask_seconds: float  # grammar masks of the rows that have one (Sampler.distributions)


def verify(sampler: Sampler, logits: torch.Tensor, states: list[SamplingState], drafts: list[list[int]],
           draft_probs: Optional[list] = None) -> Verification:
    """logits [R, V]: each request's 1 + k_i rows in order; states: one per request; drafts: k_i tokens
    per request (may be empty; a request with a grammar never has drafts and is sampled under its
    mask); draft_probs: per request None (deterministic proposer) or q [k_i, V]."""
    draft_probs = draft_probs or [None] * len(states)
    rows_states, bases = [], []
    for st, d in zip(states, drafts):
        bases.append(len(rows_states))
        rows_states += position_states(st, d)
    if logits.shape[0] != len(rows_states):
        raise ValueError(f"{logits.shape[0]} logit rows for {len(rows_states)} positions")
    probs, greedy_ids, greedy, mask_seconds = sampler.distributions(logits, rows_states)
    draft_rows = [b + j for b, d in zip(bases, drafts) for j in range(len(d))]
    flat_drafts = [t for d in drafts for t in d]
    device = logits.device
    d_rows = torch.tensor(draft_rows, dtype=torch.long, device=device)
    d_toks = torch.tensor(flat_drafts, dtype=torch.long, device=device)
    if probs is None:  # every row greedy
        chosen, accept = greedy_ids, greedy_ids[d_rows] == d_toks
    else:
        chosen, accept = _sampled_decisions(sampler, probs, greedy_ids, greedy, rows_states, bases, drafts,
                                            draft_probs, draft_rows, d_toks)
    host = torch.cat([chosen.long(), accept.long()]).tolist()  # the one host copy of the decisions
    chosen_h, accept_h = host[:len(rows_states)], host[len(rows_states):]
    return Verification(_assemble(sampler, logits, rows_states, bases, drafts, chosen_h, accept_h), mask_seconds)


def _sampled_decisions(sampler, probs, greedy_ids, greedy, rows_states, bases, drafts, draft_probs,
                       draft_rows, d_toks) -> tuple:
    """(token each row emits if it is the first rejection or the bonus [R], acceptance of each draft [D])."""
    device = probs.device
    q = torch.zeros_like(probs)  # [R, V]: the draft distribution at draft rows, 0 at bonus rows
    one_hot = [b + j for b, d, dp in zip(bases, drafts, draft_probs) if dp is None for j in range(len(d))]
    if one_hot:
        rows = torch.tensor(one_hot, dtype=torch.long, device=device)
        toks = torch.tensor([t for d, dp in zip(drafts, draft_probs) if dp is None for t in d],
                            dtype=torch.long, device=device)
        q[rows, toks] = 1.0
    model_rows = [b + j for b, d, dp in zip(bases, drafts, draft_probs) if dp is not None for j in range(len(d))]
    if model_rows:
        q[torch.tensor(model_rows, dtype=torch.long, device=device)] = torch.cat(
            [dp[:len(d), : q.shape[1]] for d, dp in zip(drafts, draft_probs) if dp is not None and len(d)]).to(q.dtype)
    residual = (probs - q).clamp_(min=0.0)  # bonus rows: q = 0, so residual = p
    noise = sampler.exponential_noise(residual, rows_states, greedy)
    sampled = residual.div_(noise).argmax(dim=-1)  # [R] exponential race: a sample of residual / sum
    chosen = sampled if greedy_ids is None else torch.where(
        torch.tensor(greedy, dtype=torch.bool, device=device), greedy_ids, sampled)
    u = _uniforms(rows_states, bases, drafts, device)  # [D]
    d_rows = torch.tensor(draft_rows, dtype=torch.long, device=device)
    p_d, q_d = probs[d_rows, d_toks], q[d_rows, d_toks]
    accept = u * q_d < p_d  # P = min(1, p/q); q_d > 0 wherever d was proposed from q
    if greedy_ids is not None:
        g_rows = torch.tensor([greedy[r] for r in draft_rows], dtype=torch.bool, device=device)
        accept = torch.where(g_rows, greedy_ids[d_rows] == d_toks, accept)
    return chosen, accept


def _uniforms(rows_states, bases, drafts, device) -> torch.Tensor:
    """U(0, 1) per draft; a seeded request draws from its own generator (one draw per draft)."""
    total = sum(len(d) for d in drafts)
    u = torch.rand(total, device=device)  # the unseeded requests' share (default generator), one call
    at = 0
    for b, d in zip(bases, drafts):
        gen = rows_states[b].generator
        if gen is not None and d:
            u[at:at + len(d)] = torch.rand(len(d), generator=gen, device=gen.device).to(device)
        at += len(d)
    return u


def _assemble(sampler, logits, rows_states, bases, drafts, chosen, accept) -> list[Verified]:
    out_rows, out_toks, per_req = [], [], []
    a = 0
    for b, d in zip(bases, drafts):
        n_acc = 0
        while n_acc < len(d) and accept[a + n_acc]:
            n_acc += 1
        toks = list(d[:n_acc]) + [chosen[b + n_acc]]
        a += len(d)
        out_rows += range(b, b + len(toks))
        out_toks += toks
        per_req.append((toks, len(d), n_acc))
    lps = [None] * len(out_toks)
    if any(rows_states[r].params.logprobs is not None for r in out_rows):
        idx = torch.tensor(out_rows, dtype=torch.long, device=logits.device)
        lps = sampler.logprobs_of(logits.index_select(0, idx), out_toks, [rows_states[r] for r in out_rows]).logprobs
    result, i = [], 0
    for toks, k, n_acc in per_req:
        result.append(Verified(toks, k, n_acc, list(lps[i:i + len(toks)])))
        i += len(toks)
    return result
