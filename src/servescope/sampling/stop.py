"""Stop strings: find where the output must end once detokenized text has grown.

A stop string may span several tokens, so the engine checks the whole output text after
each step, looking only at occurrences that overlap the newly added characters (older
text was checked at earlier steps). When several stops match, the one that starts first
wins (the shortest output); at equal starts the shorter stop wins.

Streaming: a caller that streams text must hold back the last `max_stop_holdback(stops)`
characters, which might be the beginning of a stop string not yet complete.
"""

from __future__ import annotations

from typing import Optional, Sequence


def find_stop_string(text: str, new_text_len: int, stops: Sequence[str]) -> Optional[tuple[int, str]]:
    """(start index, stop string) of the earliest stop occurrence overlapping the last
    `new_text_len` characters of `text`, or None."""
    new_text_len = min(new_text_len, len(text))
    if new_text_len <= 0:
        return None
    new_start = len(text) - new_text_len
    best: Optional[tuple[int, str]] = None
    for stop in stops:
        if not stop:
            continue
        # an occurrence overlaps the new text iff it ends after new_start
        idx = text.find(stop, max(0, new_start - len(stop) + 1))
        if idx == -1:
            continue
        if best is None or idx < best[0] or (idx == best[0] and len(stop) < len(best[1])):
            best = (idx, stop)
    return best


def check_stop_strings(text: str, new_text_len: int, stops: Sequence[str], include_stop: bool) -> Optional[int]:
    """The truncation index once a stop string appeared in the new text: the output is
    text[:idx] (the stop included when `include_stop`). None when no stop matched."""
    found = find_stop_string(text, new_text_len, stops)
    if found is None:
        return None
    idx, stop = found
    return idx + len(stop) if include_stop else idx


def max_stop_holdback(stops: Sequence[str]) -> int:
    """How many trailing characters a streaming caller must hold back: max(len) - 1 (0 if none)."""
    return max((len(s) for s in stops), default=1) - 1


class StopChecker:
    """The stop strings of one request, with its include_stop_str_in_output setting."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False):
        self.stops = tuple(s for s in stops if s)
        self.include_stop = include_stop
        self.holdback = max_stop_holdback(self.stops)

    @classmethod
    def from_params(cls, params) -> "StopChecker":
        """From a SamplingParams (its `stop` and `include_stop_str_in_output`)."""
        return cls(params.stop, params.include_stop_str_in_output)

    def find(self, text: str, new_text_len: int) -> Optional[tuple[int, str]]:
        return find_stop_string(text, new_text_len, self.stops)

    def check(self, text: str, new_text_len: int) -> Optional[int]:
        return check_stop_strings(text, new_text_len, self.stops, self.include_stop)
