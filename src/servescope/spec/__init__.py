"""Speculative decoding: proposers guess the next k tokens of a request, the target model scores all of
them in one step, and rejection sampling keeps exactly the target's distribution.

  ngram.py      prompt lookup (model-free): the tokens that followed the latest earlier occurrence of
                the sequence's suffix
  draft.py      a draft model sharing the target's vocabulary, with its own paged KV cache that uses
                the target's block tables (so rollback and preemption free both at once)
  rejection.py  verification: greedy (the longest prefix of drafts equal to the target's argmax) and
                sampled (Leviathan et al. / Chen et al.: accept a draft d with min(1, p(d) / q(d)),
                else sample max(p - q, 0)), the bonus token when every draft is accepted
  adaptive.py   per-request acceptance tracking and the choice of k (0: do not speculate)

The scheduler schedules a speculating request as a 1 + k token query (its last token, then the drafts);
the runner lays it out as 1 + k one-token rows so that decode kernels serve it; kvcache rolls back the
slots of rejected drafts. Proposers see requests and token ids only; the engine glues them in
(engine/spec_decode.py). An EAGLE-style head would be a third proposer: propose(requests, k) -> drafts.
"""
