import math

import numpy as np
import pytest

from servescope.bench.arrivals import arrival_gaps, arrival_times


@pytest.mark.parametrize("burstiness", [0.5, 1.0, 4.0])
def test_gamma_rate_and_cv(burstiness):
    rate = 8.0
    gaps = arrival_gaps(20000, rate, burstiness, seed=1)
    assert gaps.shape == (20000,) and (gaps >= 0).all()
    assert 1.0 / gaps.mean() == pytest.approx(rate, rel=0.04)
    cv = gaps.std() / gaps.mean()
    assert cv == pytest.approx(1.0 / math.sqrt(burstiness), rel=0.05)


def test_infinite_rate_sends_all_at_once():
    assert (arrival_gaps(5, math.inf) == 0).all()
    assert (arrival_times(5, float("inf")) == 0).all()


def test_seeded_and_times():
    a, b = arrival_gaps(100, 2.0, seed=3), arrival_gaps(100, 2.0, seed=3)
    assert np.array_equal(a, b)
    assert not np.array_equal(a, arrival_gaps(100, 2.0, seed=4))
    t = arrival_times(100, 2.0, seed=3)
    assert t[0] == 0.0 and np.allclose(np.diff(t), a[:-1])
    assert arrival_times(0, 1.0).shape == (0,)


@pytest.mark.parametrize("rate,burst", [(0, 1), (-1, 1), (float("nan"), 1), (1, 0), (1, math.inf)])
def test_rejects_bad_parameters(rate, burst):
    with pytest.raises(ValueError):
        arrival_gaps(10, rate, burst)
