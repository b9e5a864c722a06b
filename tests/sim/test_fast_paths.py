"""The simulator's fast paths change no result: replicas in several processes (sim/parallel.py) and the
inline token delivery (SimEngine._deliver_all) give the plain sequential run's records, bit for bit."""

import os
import random

import pytest

from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.sim.cluster import Deployment
from servescope.sim.disagg import Disaggregated
from servescope.sim.driver import drive
from servescope.sim.engine import SimEngine
from servescope.sim.parallel import drive_replicas
from servescope.sim.run import simulate
from servescope.sim.spec import SpecDecodeSpec, instance_spec
from servescope.sim.workload import SimRequest


def _spec(**kw):
    return instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=64),
                         batching=BatchingConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024),
                         **kw)


def _workload(n: int, rate: float, seed: int = 0) -> list:
    """Poisson arrivals; a third of the prompts continue one of a few shared prefixes (prefix hits, and the
    prefix router's choice), one prompt too long for the context (refused when added)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1, 49152) for _ in range(rng.randrange(64, 400))) for _ in range(4)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tail = tuple(rng.randrange(1, 49152) for _ in range(rng.randrange(8, 300)))
        prompt = (prefixes[i % 4] + tail) if i % 3 == 0 else tail
        if i == n // 2:
            prompt = tuple(range(1, 1100))
        out.append(SimRequest(t, prompt, rng.randrange(4, 60)))
    return out


def _same(a: tuple, b: tuple) -> None:
    (ra, da, fa), (rb, db, fb) = a, b
    assert ra == rb and da == db
    for x, y in zip(fa, fb):
        assert (x.request_id, x.error) == (y.request_id, y.error)
        assert x.metrics.token_times == y.metrics.token_times
        assert x.metrics.finished_time == y.metrics.finished_time
        assert (x.metrics.num_cached_tokens, x.metrics.num_preemptions) == (y.metrics.num_cached_tokens,
                                                                           y.metrics.num_preemptions)


@pytest.mark.parametrize("router", ["round-robin", "least-tokens", "prefix"])
@pytest.mark.parametrize("workers", [2, 3])
def test_replicas_in_processes_give_the_sequential_runs_records(router, workers):
    spec = _spec()
    reqs = _workload(120, 4000.0)  # a burst: queues, prefix hits, preemptions
    one, many = Deployment(spec, 4, router), Deployment(spec, 4, router)
    sequential = drive(one, reqs)
    _same(sequential, drive_replicas(many, reqs, workers))
    assert not sequential[0][60].success  # the refused prompt is in the comparison
    assert any(f.metrics.num_cached_tokens > 0 for f in sequential[2])  # and prefix hits
    assert any(f.metrics.num_preemptions for f in sequential[2])  # and preemptions (64 blocks of KV)
    # the replicas came back: the same steps, the same statistics, the same homes
    assert [e.num_steps for e in many.engines] == [e.num_steps for e in one.engines]
    assert many.stats(1.0) == one.stats(1.0)
    assert all(many.served_by(i) == one.served_by(i) for i in range(4))
    assert many.now() == one.now()


def test_speculative_replicas_and_unsorted_arrivals_in_processes():
    spec = _spec(spec_decode=SpecDecodeSpec(k=3, acceptance=0.6))
    reqs = _workload(60, 80.0, seed=1)
    reqs[10], reqs[20] = reqs[20], reqs[10]  # out of order: routed after request 10
    _same(drive(Deployment(spec, 3, "least-tokens"), reqs), drive_replicas(Deployment(spec, 3, "least-tokens"),
                                                                             reqs, 2))


def test_simulate_takes_workers_and_keeps_the_report():
    spec = _spec()
    reqs = _workload(80, 30.0, seed=2)
    a = simulate(Deployment(spec, 2, "least-tokens", keep_steps=False), reqs)
    b = simulate(Deployment(spec, 2, "least-tokens", keep_steps=False), reqs, workers=2)
    assert a.result.to_dict() == b.result.to_dict()
    assert a.stats == b.stats
    # disaggregated instances and a concurrency limit stay in one process, with the same results
    one = simulate(Disaggregated(spec, 1, 1), reqs)
    assert simulate(Disaggregated(spec, 1, 1), reqs, workers=2).result.to_dict() == one.result.to_dict()
    limited = simulate(Deployment(spec, 2, "least-tokens"), reqs, max_concurrency=4)
    assert simulate(Deployment(spec, 2, "least-tokens"), reqs, max_concurrency=4,
                    workers=2).result.to_dict() == limited.result.to_dict()


def test_a_failing_worker_raises_in_the_parent():
    spec = _spec()
    dep = Deployment(spec, 2, "round-robin")

    def broken():
        raise ValueError("boom")

    dep.engines[1].step = broken  # the child's replica fails on its first step
    with pytest.raises(RuntimeError, match="boom"):
        drive_replicas(dep, _workload(10, 50.0), 2)
    dep = Deployment(spec, 2, "round-robin")
    dep.engines[1].step = lambda: os._exit(3)  # the child dies without a word
    with pytest.raises(RuntimeError, match="exited without an answer"):
        drive_replicas(dep, _workload(10, 50.0), 2)


def _plain_deliver_all(self, due, now, done):
    """SimEngine._deliver_all without its inline case: every entry through _deliver."""
    for entry in due:
        finished = self._deliver(entry, now)
        if finished is not None:
            done.append(finished)


@pytest.mark.parametrize("k", [0, 3])
def test_the_inline_delivery_gives_the_plain_ones_records(k, monkeypatch):
    # least-tokens routes on the outstanding tokens that delivery keeps: a difference there moves requests
    spec = _spec(spec_decode=SpecDecodeSpec(k=k, acceptance=0.7))
    reqs = _workload(120, 4000.0, seed=3)
    fast = drive(Deployment(spec, 3, "least-tokens"), reqs)
    monkeypatch.setattr(SimEngine, "_deliver_all", _plain_deliver_all)
    plain_dep = Deployment(spec, 3, "least-tokens")
    _same(fast, drive(plain_dep, reqs))
    assert all(e.outstanding_tokens == 0 for e in plain_dep.engines)


def test_requests_prepared_ahead_are_used_and_change_no_record(monkeypatch):
    """The group that the router will likely send the next request to prepares it while it waits (the prompt's
    block hashes, the output stream: SimEngine.prepare); the guess is often right, and right or wrong the
    records are the sequential run's."""
    from servescope.sim import parallel
    used: list = []
    add, prepare = parallel._Group.add, parallel._Group.prepare

    def counting(self, j, replica):
        used.append(self.prepared[0] == j)
        add(self, j, replica)

    monkeypatch.setattr(parallel._Group, "add", counting)
    monkeypatch.setattr(parallel._Group, "prepare", lambda self, ready: prepare(self, lambda: False))  # always
    spec, reqs = _spec(), _workload(120, 400.0)
    for guess in ("router's", "random"):
        if guess == "random":
            rng = random.Random(0)
            monkeypatch.setattr(Deployment, "likely_next", lambda self, loads: rng.randrange(len(loads)))
        used.clear()
        _same(drive(Deployment(spec, 4, "least-tokens"), reqs),
              drive_replicas(Deployment(spec, 4, "least-tokens"), reqs, 2))
        assert any(used) and not all(used)  # (this process's adds: prepared ones and others)


def test_a_prepared_request_is_the_one_added_plainly():
    """SimEngine.prepare's hashes and stream are the ones add_request computes: the same blocks, hashes and
    token times either way, with prefix hits among the requests."""
    spec = instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=1024),
                         batching=BatchingConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024))
    reqs = _workload(60, 400.0, seed=4)
    runs = []
    for ahead in (False, True):
        e = SimEngine(spec, keep_steps=False, fast_forward=False)
        done = []
        for i, r in enumerate(reqs):
            while e.has_unfinished() and e.clock < r.arrival:
                done += e.step()
            e.wait_until(r.arrival)
            prepared = e.prepare(f"r{i}", r.prompt, r.output_len) if ahead else None
            refused = e.add_request(f"r{i}", r.prompt, r.output_len, r.arrival, prepared)
            done += [refused] if refused else []
        while e.has_unfinished():
            done += e.step()
        km = e.kv_manager
        runs.append(([(f.request_id, list(f.metrics.token_times), f.metrics.num_cached_tokens) for f in done],
                     dict(km.prefix_cache._block_of), km.allocator.free_block_ids()))
    assert runs[0] == runs[1]
    assert any(cached for _, _, cached in runs[0][0])
