"""The simulator's memo of step predictions (sim/step_time.py): one-token rows as their count and mean
context rounded to the spec's quantum, longer rows exactly; quantum 0 is the exact prediction."""

import random

import pytest

from servescope.config.engine import BatchingConfig, KVCacheConfig, ParallelConfig
from servescope.errors import InvalidParameterError
from servescope.sim.cluster import Deployment
from servescope.sim.driver import drive
from servescope.sim.spec import instance_spec
from servescope.sim.step_time import StepTimer
from servescope.sim.workload import SimRequest


def _spec(quantum, **kw):
    return instance_spec("llama-3-70b", "H100", parallel=ParallelConfig(tensor_parallel_size=8),
                         batching=BatchingConfig(max_num_seqs=32, max_num_batched_tokens=1024),
                         **kw).replace(context_quantum=quantum)


def test_the_memo_predicts_one_token_rows_at_their_rounded_mean_and_longer_rows_exactly():
    timer = StepTimer(_spec(16))
    seqs = ((1, 100), (1, 130), (1, 7), (300, 40))  # mean of the one-token rows 79 -> 80
    pred = timer.predict(seqs, 4)
    assert pred == timer.predictor.predict([(1, 80)] * 3 + [(300, 40)], 4)
    # another batch of the same shape shares the entry; the exact prediction is off by a few ppm only
    assert timer.predict(((1, 81), (1, 81), (1, 78), (300, 40)), 4) is pred
    exact = timer.predictor.predict(list(seqs), 4).seconds
    assert pred.seconds == pytest.approx(exact, rel=1e-3) and pred.seconds != exact


def test_quantum_zero_is_the_exact_prediction():
    timer = StepTimer(_spec(0))
    seqs = ((1, 100), (1, 130), (300, 40))
    assert timer.predict(seqs, 3) == timer.predictor.predict(list(seqs), 3)
    assert timer.predict(((1, 101), (1, 130), (300, 40)), 3) != timer.predict(seqs, 3)


def test_a_negative_quantum_is_refused():
    with pytest.raises(InvalidParameterError, match="context_quantum"):
        _spec(-1)


def _run(quantum, reqs):
    spec = _spec(quantum, cache=KVCacheConfig(num_kv_blocks=2048))
    dep = Deployment(spec, 2, "least-tokens", keep_steps=False)
    records, duration, finished = drive(dep, reqs)
    return dep, records, finished


def test_a_quantised_run_schedules_the_same_tokens_within_a_small_time_error():
    rng = random.Random(0)
    reqs = [SimRequest(i * 0.01, tuple(rng.randrange(1000) for _ in range(rng.randrange(50, 600))),
                       rng.randrange(20, 120)) for i in range(60)]
    exact, fast = _run(0, reqs), _run(16, reqs)
    assert [r.output_len for r in exact[1]] == [r.output_len for r in fast[1]]
    assert all(f.error is None for f in fast[2])
    for a, b in zip(exact[1], fast[1]):  # every latency within 1% of the unmemoised run's
        assert b.latency == pytest.approx(a.latency, rel=1e-2) and b.ttft == pytest.approx(a.ttft, rel=1e-2)
    # the replicas share one timer, whose memo holds far fewer shapes than the exact run's
    assert len({id(e.timer) for e in fast[0].engines}) == 1
    assert len(fast[0].engines[0].timer._cache) < 0.6 * len(exact[0].engines[0].timer._cache)
