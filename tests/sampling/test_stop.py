"""Stop strings: across token boundaries, earliest wins, include or trim, holdback."""

from servescope.config import SamplingParams
from servescope.sampling import StopChecker, check_stop_strings, find_stop_string, max_stop_holdback


def stream(chunks, stops, include=False):
    """Feed text chunk by chunk; return (step, truncated text) at the first stop."""
    text = ""
    for step, chunk in enumerate(chunks):
        text += chunk
        idx = check_stop_strings(text, len(chunk), stops, include)
        if idx is not None:
            return step, text[:idx]
    return None, text


def test_stop_across_token_boundaries():
    assert stream(["Hello wo", "rld. ST", "O", "P now"], ("STOP",)) == (3, "Hello world. ")
    assert stream(["Hello wo", "rld. ST", "O", "P now"], ("STOP",), include=True) == (3, "Hello world. STOP")


def test_no_stop():
    assert stream(["a", "b", "c"], ("x",)) == (None, "abc")
    assert check_stop_strings("abc", 3, (), False) is None


def test_earliest_occurrence_wins_regardless_of_order():
    text = "one two three"
    assert check_stop_strings(text, len(text), ("three", "two"), False) == 4
    assert check_stop_strings(text, len(text), ("two", "three"), True) == 7
    # same start: the shorter stop wins
    assert find_stop_string("xxabcd", 4, ("abcd", "ab")) == (2, "ab")


def test_only_matches_overlapping_new_text():
    text = "STOP then more"
    assert check_stop_strings(text, 4, ("STOP",), False) is None  # old occurrence already handled
    assert check_stop_strings(text, 0, ("STOP",), False) is None
    # a stop ending at the first new character still overlaps it
    assert check_stop_strings("abcSTOPx", 2, ("STOP",), False) == 3
    assert check_stop_strings("abcSTOPx", 1, ("STOP",), False) is None


def test_include_stop_at_end_keeps_everything():
    assert check_stop_strings("done.", 1, (".",), True) == 5


def test_holdback():
    assert max_stop_holdback(()) == 0
    assert max_stop_holdback(("a",)) == 0
    assert max_stop_holdback(("ab", "\n\nUser:")) == 6


def test_stop_checker_from_params():
    c = StopChecker.from_params(SamplingParams(stop=["</s>", "##"], include_stop_str_in_output=True))
    assert c.holdback == 3
    assert c.check("x ## y", 6) == 4
    assert c.find("x ## y", 6) == (2, "##")
