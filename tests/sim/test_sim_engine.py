"""The simulated engine: the engine's own scheduler and KV cache manager on a virtual clock whose steps
take exactly what the cost model predicts for them (datasheet specs: no host costs)."""

import math

import pytest

from servescope.analysis.step_prediction import StepPredictor
from servescope.errors import InvalidParameterError
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.kvcache.manager import KVCacheManager
from servescope.scheduler.scheduler import Scheduler
from servescope.sim.cluster import Deployment
from servescope.sim.driver import bench_result, drive
from servescope.sim.engine import SimEngine
from servescope.sim.spec import HostCosts, SpecDecodeSpec, instance_spec
from servescope.sim.workload import SimRequest, synthetic_workload


def _spec(**kw):
    cache = kw.pop("cache", KVCacheConfig(num_kv_blocks=256))
    batching = kw.pop("batching", BatchingConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=2048))
    quantum = kw.pop("context_quantum", None)
    spec = instance_spec("smollm2-135m", "H100", cache=cache, batching=batching, **kw)
    return spec if quantum is None else spec.replace(context_quantum=quantum)


def _run(spec, reqs, max_concurrency=None):
    dep = Deployment(spec)
    records, duration, finished = drive(dep, reqs, max_concurrency)
    return dep, records, duration, finished


def test_it_runs_the_engines_own_scheduler_and_kv_manager():
    engine = SimEngine(_spec())
    assert type(engine.scheduler) is Scheduler and type(engine.kv_manager) is KVCacheManager


def test_one_request_takes_the_predicted_steps():
    spec = _spec(context_quantum=0)  # every step predicted on its exact shape
    req = SimRequest(0.0, tuple(range(1, 601)), 5)
    dep, records, _, finished = _run(spec, [req])
    steps = dep.engines[0].steps
    pred = StepPredictor(spec.model, spec.hardware, spec.dtypes)
    # 600 prompt tokens in chunks of the 256-token budget, then one decode per further token
    assert [s.num_prefill_tokens for s in steps] == [256, 256, 88, 0, 0, 0, 0]
    expected = [pred.predict([(256, 0)], 0).seconds, pred.predict([(256, 256)], 0).seconds,
                pred.predict([(88, 512)], 1).seconds] + [pred.predict([(1, 600 + i)], 1).seconds for i in range(4)]
    assert [s.wall_seconds for s in steps] == pytest.approx(expected, rel=1e-12)
    assert all(s.predicted_seconds == s.wall_seconds for s in steps)  # no host costs on a datasheet spec
    m = finished[0].metrics
    assert records[0].output_len == 5 and records[0].ttft == pytest.approx(sum(expected[:3]))
    assert records[0].latency == pytest.approx(sum(expected)) and m.finished_time == pytest.approx(sum(expected))


def test_host_costs_are_added_per_sequence_and_token():
    base = _spec()
    per_seq = base.replace(hardware=base.hardware.replace(seq_overhead_s=1e-3))  # the spec's, as the engine's
    host = per_seq.replace(host=HostCosts(per_token_s=2e-4))
    reqs = synthetic_workload(4, 32, 3, base.model.vocab_size)  # one prefill step of 4, then decodes of 4
    d0, d1, d2 = _run(base, reqs)[0], _run(per_seq, reqs)[0], _run(host, reqs)[0]
    for a, b, c in zip(d0.engines[0].steps, d1.engines[0].steps, d2.engines[0].steps):
        # the per-sequence cost is in the prediction itself (once), the detokeniser's on top of it
        assert b.predicted_seconds == pytest.approx(a.predicted_seconds + 4 * 1e-3)
        assert b.wall_seconds == pytest.approx(b.predicted_seconds)
        assert c.wall_seconds == pytest.approx(b.wall_seconds + 4 * 2e-4)


def test_the_work_between_steps_is_added_once_per_step_whatever_its_size():
    base = _spec()
    between = base.replace(host=HostCosts(per_step_s=3e-3))
    reqs = synthetic_workload(4, 32, 3, base.model.vocab_size)  # one prefill step of 4, then decodes of 4
    d0, d1 = _run(base, reqs)[0], _run(between, reqs)[0]
    s0, s1 = d0.engines[0].steps, d1.engines[0].steps
    assert len(s0) == len(s1) >= 3
    for a, b in zip(s0, s1):  # the prediction is the engine's own step; the step lasts its period
        assert b.predicted_seconds == pytest.approx(a.predicted_seconds)
        assert b.wall_seconds == pytest.approx(a.wall_seconds + 3e-3)
    with pytest.raises(InvalidParameterError):
        HostCosts(per_step_s=-1e-3)


def test_later_arrivals_join_between_steps_and_keep_their_arrival_time():
    spec = _spec()
    reqs = [SimRequest(0.0, tuple(range(1, 200)), 30), SimRequest(1e-4, tuple(range(300, 400)), 4)]
    _, records, _, finished = _run(spec, reqs)
    assert finished[1].metrics.arrival_time == pytest.approx(1e-4)
    assert finished[1].metrics.first_scheduled_time > 1e-4  # waited for the running step to end
    assert records[1].start_time == pytest.approx(1e-4)


def test_shared_prefixes_hit_the_prefix_cache():
    spec = _spec()
    base = tuple(range(1, 513))
    reqs = [SimRequest(0.0, base + (7,) * 10, 2), SimRequest(1.0, base + (9,) * 20, 2)]
    _, records, _, finished = _run(spec, reqs)
    assert finished[0].metrics.num_cached_tokens == 0 and finished[1].metrics.num_cached_tokens == 512
    assert records[1].ttft < records[0].ttft
    off = _spec(cache=KVCacheConfig(num_kv_blocks=256, enable_prefix_caching=False))
    assert _run(off, reqs)[3][1].metrics.num_cached_tokens == 0


def test_a_small_cache_preempts_and_everyone_still_finishes():
    spec = _spec(cache=KVCacheConfig(num_kv_blocks=24),  # 384 tokens for 8 sequences of up to 96
                 batching=BatchingConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=384))
    reqs = synthetic_workload(8, 40, 56, spec.model.vocab_size)
    dep, records, _, finished = _run(spec, reqs)
    assert dep.engines[0].scheduler.num_preemptions > 0
    assert all(r.success and r.output_len == 56 for r in records)
    assert sum(f.metrics.num_preemptions for f in finished) == dep.engines[0].scheduler.num_preemptions
    dep.engines[0].kv_manager.check_invariants()
    assert dep.engines[0].kv_manager.num_used_blocks == 0


@pytest.mark.parametrize("acceptance,tokens_per_verification", [(1.0, 4), (0.0, 1)])
def test_speculative_decoding_accepts_drafts_at_the_given_rate(acceptance, tokens_per_verification):
    spec = _spec(spec_decode=SpecDecodeSpec(k=3, acceptance=acceptance))
    dep, records, _, _ = _run(spec, [SimRequest(0.0, tuple(range(1, 33)), 33)])
    steps = dep.engines[0].steps
    verifications = [s for s in steps if s.num_spec_seqs]
    assert verifications and all(s.num_draft_tokens == 3 for s in verifications)
    assert all(s.num_accepted_tokens == 3 * (acceptance == 1.0) for s in verifications)
    assert records[0].output_len == 33  # drafts past max_tokens are dropped
    assert len(steps) == 1 + math.ceil(32 / tokens_per_verification)


def test_a_request_that_cannot_fit_fails_like_the_engine_refuses_it():
    spec = _spec()
    reqs = [SimRequest(0.0, tuple(range(1, 2001)), 100), SimRequest(0.0, (1, 2, 3), 2)]
    _, records, _, _ = _run(spec, reqs)
    assert not records[0].success and "context" in records[0].error and records[1].success


def test_max_concurrency_holds_requests_until_a_slot_frees():
    spec = _spec()
    reqs = synthetic_workload(6, 64, 8, spec.model.vocab_size)  # all at once
    _, records, duration, _ = _run(spec, reqs, max_concurrency=2)
    result = bench_result(records, duration)
    assert result.max_concurrency_seen == 2 and result.completed == 6
    starts = sorted(r.start_time for r in records)
    assert starts[:2] == [0.0, 0.0] and starts[2] > 0  # sent when the first two finished


def test_the_simulation_is_deterministic():
    spec = _spec(spec_decode=SpecDecodeSpec(k=2, acceptance=0.6))
    reqs = synthetic_workload(12, (16, 300), (4, 40), spec.model.vocab_size, request_rate=50.0)
    a, b = _run(spec, reqs)[1], _run(spec, reqs)[1]
    assert [(r.ttft, r.latency, r.itl) for r in a] == [(r.ttft, r.latency, r.itl) for r in b]
