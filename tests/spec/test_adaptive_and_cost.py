"""The speed-up model (analysis/speculative.py), the acceptance tracker and the k chooser: speculation
pays while decode is memory-bound, stops at the compute crossover, and follows each request's acceptance."""

import pytest

from servescope.analysis.hardware import get_hardware
from servescope.analysis.presets import load_preset
from servescope.analysis.speculative import best_k, expected_tokens_per_step, explain_speculative, predicted_speedup
from servescope.spec.adaptive import AcceptanceTracker, KChooser


def test_expected_tokens_and_speedup():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert expected_tokens_per_step(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    assert predicted_speedup(0.5, 2, t_base=1.0, t_verify=1.0) == pytest.approx(1.75)
    assert predicted_speedup(0.5, 2, t_base=1.0, t_verify=1.0, t_propose=0.75) == pytest.approx(1.0)


def test_best_k_is_zero_when_extra_rows_cost_their_full_price():
    flat = lambda rows: 1.0  # noqa: E731  memory-bound: rows are free
    linear = lambda rows: 1.0 * rows  # noqa: E731  compute-bound: every row costs
    assert best_k(0.8, 6, flat, batch=1)[0] == 6
    assert best_k(0.8, 6, linear, batch=8) == (0, 1.0)
    assert best_k(0.0, 6, flat, batch=1) == (0, 1.0)  # nothing is ever accepted


def test_explain_crossover_on_a_gpu_spec():
    cfg, hw = load_preset("llama-3-8b"), get_hardware("H100-SXM")
    r = explain_speculative(cfg, hw, "ngram", 4, 0.8, 1024)
    speedups = [row["speedup"] for row in r["rows"]]
    assert speedups[0] > 1.5 and speedups[-1] < 1.0 and r["crossover_batch"] is not None
    assert all(a >= b for a, b in zip(speedups, speedups[1:]))  # falls as the batch grows
    assert all(row["best_speedup"] >= 1.0 for row in r["rows"])
    draft = explain_speculative(cfg, hw, "draft", 4, 0.8, 1024)
    assert all(d["speedup"] < n["speedup"] for d, n in zip(draft["rows"], r["rows"]))  # the draft costs time
    with pytest.raises(ValueError):
        explain_speculative(cfg, hw, "ngram", 0, 0.8, 1024)


def test_tracker_follows_acceptance_and_chooser_turns_off():
    t = AcceptanceTracker()
    for _ in range(30):
        t.update("copy", 4, 4)
        t.update("open", 4, 0)
    assert t.rate("copy") > 0.9 and t.rate("open") < 0.1
    ch = KChooser(4, adaptive=True, step_seconds=lambda rows, ctx: 1.0 + 0.05 * rows)
    ch.tracker = t
    assert ch.choose(["copy", "open"], 1, 100) == [4, 0]
    compute_bound = KChooser(4, adaptive=True, step_seconds=lambda rows, ctx: float(rows))
    compute_bound.tracker = t
    assert compute_bound.choose(["copy"], 32, 100) == [0]
    assert KChooser(3, adaptive=False).choose(["a", "b"], 64, 10) == [3, 3]
