"""N-gram prompt lookup (vLLM's `ngram` method, after Saxena's prompt-lookup decoding).

For a sequence t[0..L), find the longest suffix of n tokens (prompt_lookup_max >= n >= prompt_lookup_min)
that also occurs earlier, at its latest earlier occurrence, and propose the k tokens that followed it.
Copy-heavy outputs (quoting, editing, code refactors) repeat long runs of the prompt, so the lookup
guesses whole runs; open-ended text rarely matches and then nothing is proposed. Pure Python on ids.
"""

from __future__ import annotations

from typing import Sequence


class NgramProposer:
    """Proposes from the sequence itself; deterministic, so its draft distribution is one-hot."""

    name = "ngram"
    deterministic = True  # q(d) = 1 for the proposed token: rejection sampling needs no draft probs

    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to k tokens (possibly none) that followed the longest matching suffix."""
        n_tok = len(token_ids)
        if k <= 0 or n_tok < self.min_n + 1:
            return []
        last = token_ids[-1]
        best_len, best_end = 0, -1
        # candidates j: an earlier position holding the last token; the match grows backwards from it
        for j in range(n_tok - 2, self.min_n - 2, -1):
            if token_ids[j] != last:
                continue
            length = 1
            limit = min(self.max_n, j + 1)
            while length < limit and token_ids[j - length] == token_ids[n_tok - 1 - length]:
                length += 1
            if length > best_len:  # strictly longer: among equals the latest occurrence wins
                best_len, best_end = length, j
                if length == self.max_n:
                    break
        if best_len < self.min_n:
            return []
        return list(token_ids[best_end + 1:best_end + 1 + k])

    needs_lookahead = False  # writes no KV

    def propose_batch(self, items: list) -> list:
        """items: (request, k, block ids, sampling state) -> [(drafts, None)] (no draft probabilities)."""
        return [(self.propose(req.all_token_ids, k), None) for req, k, _, _ in items]

    def retain(self, request_ids) -> None:
        """Nothing to forget: the lookup keeps no per-request state."""
