"""The simulator's record keeping changes no number: token times held as float64 arrays, the ITLs cut from
them with numpy, bench serve's ITL pooled without a list of floats, and the cycle collector off during a run
give exactly what the plain Python rules give."""

import gc
import operator
import random
from array import array

import pytest

from servescope.bench.metrics import LatencyStats, compute_metrics
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.sim.cluster import Deployment
from servescope.sim.driver import chunk_gaps
from servescope.sim.run import simulate
from servescope.sim.spec import SpecDecodeSpec, instance_spec
from servescope.sim.workload import SimRequest


def _python_gaps(times: list) -> list:
    """The ITL rule in plain Python (sim/driver.record_of's before numpy): chunks of equal times, gaps between."""
    chunks = times[:1] + [b for a, b in zip(times, times[1:]) if b != a]
    return list(map(operator.sub, chunks[1:], chunks[:-1]))


def _times(rng: random.Random, n: int) -> list:
    """Token times as a simulator makes them: sums of step times, several tokens at one time (drafts)."""
    t, out = rng.uniform(0, 1e4), []
    for _ in range(n):
        t += rng.choice([0.0, 0.0, rng.uniform(1e-4, 0.05), rng.uniform(1e-9, 1e-6), 1e-12])
        out.append(t)
    return out


@pytest.mark.parametrize("seed", range(20))
def test_chunk_gaps_equal_the_python_rule_bit_for_bit(seed):
    rng = random.Random(seed)
    times = _times(rng, rng.randrange(1, 400))
    expected = _python_gaps(times)
    for held in (times, array("d", times)):
        got = chunk_gaps(held)
        assert type(got) is array and got.typecode == "d"
        assert got.tolist() == expected  # float ==: the same doubles, in order


def test_one_token_and_one_chunk_have_no_gaps():
    assert len(chunk_gaps(array("d", [3.5]))) == 0 == len(chunk_gaps([1.0, 1.0, 1.0]))


def _spec(**kw):
    return instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=64),
                         batching=BatchingConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024),
                         **kw)


def _workload(n: int, rate: float, seed: int) -> list:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(SimRequest(t, tuple(rng.randrange(1, 49152) for _ in range(rng.randrange(8, 200))),
                              rng.randrange(1, 80)))
    return out


@pytest.mark.parametrize("workers", [1, 2])
def test_the_pooled_itl_statistics_are_those_of_the_python_list(workers):
    """Drafts give chunks of several tokens; the report's ITL numbers equal numpy's on the pooled Python list."""
    spec = _spec(spec_decode=SpecDecodeSpec(k=3, acceptance=0.6))
    run = simulate(Deployment(spec, 3, "least-tokens", keep_steps=False), _workload(90, 300.0, 1), workers=workers)
    ok = [r for r in run.result.records if r.success]
    for r, f in zip(run.result.records, run.finished):
        assert list(r.itl) == _python_gaps(list(f.metrics.token_times))
    assert any(len(r.itl) < r.output_len - 1 for r in ok)  # some chunks carried several tokens
    pooled = [x for r in ok for x in r.itl]
    assert run.result.itl == LatencyStats.from_seconds(pooled, (90.0, 99.0))
    assert compute_metrics(run.result.records, run.result.duration_s).itl == LatencyStats.from_seconds(
        pooled, (90.0, 99.0))


def test_a_run_turns_the_cycle_collector_off_and_back_and_leaves_no_cyclic_garbage():
    """simulate() runs with gc disabled (its objects live to the end; collecting finds nothing): it must leave
    nothing only a collection would free, and restore the collector's state."""
    spec, reqs = _spec(), _workload(120, 200.0, 2)
    for enabled in (True, False):
        (gc.enable if enabled else gc.disable)()
        try:
            _run_and_collect(spec, reqs, enabled)
        finally:
            gc.enable()


def _run_and_collect(spec, reqs, enabled: bool) -> None:
    dep = Deployment(spec, 2, "prefix")
    gc.collect()
    run = simulate(dep, reqs)
    assert gc.isenabled() == enabled
    # dep and run still held: anything of ours a collection finds was in a cycle the run dropped. What it finds
    # is kept (DEBUG_SAVEALL) and only servescope's objects count: everything a dropped cycle reaches is unreachable
    # with it, so a cycle of the run's holds some, while another thread's garbage (a thread an earlier test of the
    # suite left running; 32 objects once in a whole suite) does not
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        ours = [o for o in gc.garbage if type(o).__module__.startswith("servescope")]
        kinds = sorted({type(o).__qualname__ for o in gc.garbage})
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not ours, f"{len(ours)} of the run's objects in dropped cycles (all collected: {kinds})"
    assert run.result.completed > 0
