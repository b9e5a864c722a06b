"""measure/overhead.py: the host overhead per step, per layer and per sequence, split from decode steps of a
tiny model at two depths and two batch sizes (the split on made-up times; the measurement's plumbing)."""

import math

import pytest

from servescope.measure import overhead


def _times(per_step: float, per_layer: float, per_seq: float, per_row_layer: float) -> dict:
    """Step times of a model that costs exactly these: per step, per layer, per sequence, per row and layer."""
    return {(d, b): per_step + d * per_layer + b * per_seq + b * d * per_row_layer
            for d in overhead.DEPTHS for b in (1, overhead.BATCH)}


def test_the_split_recovers_each_term_and_leaves_the_layers_rows_to_the_kernel_table():
    # the per-row-per-layer share (attention and norms over one more row) is what the kernel table prices at
    # the real model's shapes: it must not reach the per-sequence term
    per_step, per_layer, per_seq = overhead.split_host_overhead(_times(2e-4, 4e-5, 3e-5, 1e-6))
    # a batch-1 step's one row per layer stays in the per-layer term (its kernels' calls at the tiny shapes);
    # its one sequence is the per-sequence term's, not the per-step term's: a batch-1 step is priced as measured
    assert per_step == pytest.approx(2e-4)
    assert per_layer == pytest.approx(4e-5 + 1e-6)
    assert per_seq == pytest.approx(3e-5)


def test_the_split_never_goes_negative():
    # a noisy wide step faster than the narrow one: no negative cost reaches the spec
    times = _times(2e-4, 4e-5, 3e-5, 0.0)
    times[overhead.DEPTHS[0], overhead.BATCH] = times[overhead.DEPTHS[0], 1] * 0.9
    assert min(overhead.split_host_overhead(times)) >= 0.0


def test_a_wider_decode_step_is_timed_on_the_engine():
    t = overhead.decode_step_seconds(2, steps=4, prompt_len=16, batch=3)
    assert math.isfinite(t) and 0 < t < 1.0
