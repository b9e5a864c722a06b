"""Fast-forward (sim/fast_forward.py): stretches of steps that only decode, planned and applied in bulk, give
exactly what stepping one at a time gives -- every request's token times, every StepRecord, the instances'
counters, the KV caches' blocks -- on workloads with queues, prefix sharing, preemption, finishes, idle gaps,
every router and windowed layers (one table, or a hybrid's table per group); and it can be turned off."""

import random

import pytest

from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.sim import fast_forward, parallel
from servescope.sim.cluster import Deployment
from servescope.sim.driver import drive
from servescope.sim.parallel import drive_replicas
from servescope.sim.run import simulate
from servescope.sim.spec import SpecDecodeSpec, instance_spec
from servescope.sim.workload import SimRequest
from test_fast_paths import _same
from tiny_models import tiny_model_config


def _spec(blocks=64, caching=True, quantum=None, **kw):
    spec = instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=blocks,
                                                                    enable_prefix_caching=caching),
                         batching=BatchingConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024),
                         **kw)
    return spec if quantum is None else spec.replace(context_quantum=quantum)


def _windowed_spec(family: str, window: int, blocks: int, **shape):
    """A tiny model whose layers attend over windows: all of them (mistral: one table that slides), or a hybrid
    (gemma2 alternating, gemma3 two local to one global: a table per group, kvcache/hybrid.py)."""
    cfg = tiny_model_config(family, sliding_window=window, **shape)
    return instance_spec(cfg, "H100", kv_cache_dtype="float32", link="none",
                         cache=KVCacheConfig(num_kv_blocks=blocks),
                         batching=BatchingConfig(max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024))


def _workload(n: int, rate: float, seed: int = 0, shared: bool = True) -> list:
    """Poisson arrivals; with `shared` a third continue one of a few prefixes (prefix hits and the prefix
    router's choice); one prompt too long for the context (refused)."""
    rng = random.Random(seed)
    prefixes = [tuple(rng.randrange(1, 49152) for _ in range(rng.randrange(64, 300))) for _ in range(3)]
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        tail = tuple(rng.randrange(1, 49152) for _ in range(rng.randrange(8, 200)))
        prompt = (prefixes[i % 3] + tail) if shared and i % 3 == 0 else tail
        if i == n // 2:
            prompt = tuple(range(1, 1100))
        out.append(SimRequest(t, prompt, rng.randrange(4, 120)))
    return out


def _planned(monkeypatch) -> list:
    """Counts the steps applied by stretches: [steps, stretches]."""
    count = [0, 0]
    commit = fast_forward.DecodeRun.commit

    def counted(self):
        count[0] += self.steps
        count[1] += bool(self.steps)
        return commit(self)

    monkeypatch.setattr(fast_forward.DecodeRun, "commit", counted)
    return count


def _kv_state(dep) -> list:
    out = []
    for e in dep.engines:
        km = e.kv_manager
        km.check_invariants()
        groups = getattr(km, "groups", (km,))  # a hybrid's every group of layers
        out.append((km.block_map(), [g.allocator.free_block_ids() for g in groups],
                    [g.prefix_cache.evictable_blocks() for g in groups], km.prefix_cache_queries,
                    km.prefix_cache_hits, e.scheduler.num_preemptions, e.peak_kv_usage))
    return out


CASES = {  # name: (spec, replicas, router, workload)
    "burst, prefix sharing, preemption": (_spec(), 3, "prefix", _workload(150, 4000.0)),
    "moderate rate, least-tokens": (_spec(blocks=96), 4, "least-tokens", _workload(200, 60.0, seed=1)),
    "low rate with idle gaps, one replica": (_spec(blocks=256), 1, "round-robin", _workload(40, 2.0, seed=2)),
    "no prefix caching, round-robin": (_spec(caching=False), 2, "round-robin", _workload(150, 300.0, seed=3)),
    "exact step shapes (quantum 0)": (_spec(quantum=0), 2, "least-tokens", _workload(100, 200.0, seed=4)),
    "hybrid, window off the block grid, prefix sharing": (_windowed_spec("gemma2", 40, 96, num_hidden_layers=4), 3,
                                                           "prefix", _workload(150, 400.0, seed=10)),
    "hybrid, window on the block grid, preemption": (
        _windowed_spec("gemma3", 64, 72, num_hidden_layers=6, sliding_window_pattern=3), 2, "least-tokens",
        _workload(150, 4000.0, seed=11)),
    "every layer windowed (one table)": (_windowed_spec("mistral", 48, 64, num_hidden_layers=2), 2, "least-tokens",
                                         _workload(120, 200.0, seed=12)),
    "speculative decoding (never fast-forwards)": (_spec(spec_decode=SpecDecodeSpec(k=3, acceptance=0.6)), 2,
                                                   "least-tokens", _workload(80, 200.0, seed=5)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_fast_forward_gives_the_step_by_step_runs_records_traces_and_caches(case, monkeypatch):
    spec, replicas, router, reqs = CASES[case]
    stepped = Deployment(spec, replicas, router, fast_forward=False)
    one_by_one = drive(stepped, reqs)
    planned = _planned(monkeypatch)
    fast = Deployment(spec, replicas, router)
    _same(one_by_one, drive_replicas(fast, reqs, 1))
    assert [e.steps for e in fast.engines] == [e.steps for e in stepped.engines]  # every StepRecord
    assert fast.stats(1.0) == stepped.stats(1.0)
    assert [(e.clock, e.busy_seconds, e.outstanding_tokens) for e in fast.engines] == \
        [(e.clock, e.busy_seconds, e.outstanding_tokens) for e in stepped.engines]
    assert _kv_state(fast) == _kv_state(stepped)
    assert all(fast.served_by(i) == stepped.served_by(i) for i in range(replicas))
    steps = sum(e.num_steps for e in fast.engines)
    if spec.spec_decode.k:
        assert planned == [0, 0]
    else:  # stretches were taken (a burst leaves fewer: queues mean prefills)
        assert planned[0] > steps / 4 and planned[1] >= 10, (planned, steps)


def test_the_workloads_reach_what_they_are_for():
    records, _, finished = drive(Deployment(*CASES["burst, prefix sharing, preemption"][:3], fast_forward=False),
                                 CASES["burst, prefix sharing, preemption"][3])
    assert any(f.metrics.num_preemptions for f in finished)
    assert any(f.metrics.num_cached_tokens for f in finished)
    assert sum(not r.success for r in records) == 1


@pytest.mark.parametrize("workers", [1, 2])
def test_simulate_fast_forwards_by_default_with_the_same_report(workers, monkeypatch):
    spec, reqs = _spec(blocks=96), _workload(120, 60.0, seed=6)
    off = simulate(Deployment(spec, 2, "least-tokens", keep_steps=False, fast_forward=False), reqs)
    planned = _planned(monkeypatch)
    on = simulate(Deployment(spec, 2, "least-tokens", keep_steps=False), reqs, workers=workers)
    assert on.result.to_dict() == off.result.to_dict() and on.stats == off.stats
    if workers == 1:
        assert planned[0] > 0  # (a worker process's stretches are not counted here)


@pytest.mark.parametrize("case", [c for c in CASES if "window" in c])
def test_windowed_stretches_without_records_give_the_step_by_step_state(case, monkeypatch):
    """Without StepRecords (a cluster run's way) a windowed stretch's steps are applied one at a time too (blocks
    slide out during it): the same records, counters, peak usage and caches as stepping."""
    spec, replicas, router, reqs = CASES[case]
    stepped = Deployment(spec, replicas, router, keep_steps=False, fast_forward=False)
    one_by_one = drive(stepped, reqs)
    planned = _planned(monkeypatch)
    fast = Deployment(spec, replicas, router, keep_steps=False)
    _same(one_by_one, drive_replicas(fast, reqs, 1))
    assert fast.stats(1.0) == stepped.stats(1.0) and _kv_state(fast) == _kv_state(stepped)
    assert [(e.clock, e.busy_seconds, e.outstanding_tokens, e.num_steps) for e in fast.engines] == \
        [(e.clock, e.busy_seconds, e.outstanding_tokens, e.num_steps) for e in stepped.engines]
    assert planned[1] >= 10


def test_turned_off_it_never_plans(monkeypatch):
    def refuse(engine):
        raise AssertionError("planned a stretch with fast_forward off")

    monkeypatch.setattr(fast_forward.DecodeRun, "start", refuse)
    spec, reqs = _spec(), _workload(60, 300.0, seed=7)
    simulate(Deployment(spec, 2, "least-tokens", fast_forward=False), reqs)
    drive_replicas(Deployment(spec, 2, "least-tokens", fast_forward=False), reqs, 1)


def test_a_concurrency_limit_steps_one_at_a_time_with_the_same_results(monkeypatch):
    spec, reqs = _spec(), _workload(60, 300.0, seed=8)
    off = simulate(Deployment(spec, 2, "least-tokens", fast_forward=False), reqs, max_concurrency=4)
    planned = _planned(monkeypatch)
    on = simulate(Deployment(spec, 2, "least-tokens"), reqs, max_concurrency=4)
    assert on.result.to_dict() == off.result.to_dict() and planned == [0, 0]


@pytest.mark.parametrize("router", ["round-robin", "least-tokens", "prefix"])
def test_stretches_applied_while_a_process_waits_change_nothing(router, monkeypatch):
    """sim/parallel.py applies planned stretches while it waits for the other process (a stretch split
    anywhere); here every planned stretch is applied at every wait, in the parent and the children, and the
    records, token times and caches are the sequential run's."""
    applied = []

    def always(self, ready):  # as if the other process were always the slower one
        applied.append(sum(e.planned_steps() for e in self.engines))
        for e in self.engines:
            e.settle()

    monkeypatch.setattr(parallel._Group, "prepay_until", always)
    spec, reqs = _spec(blocks=96), _workload(150, 300.0, seed=9)
    stepped = Deployment(spec, 4, router, fast_forward=False)
    fast = Deployment(spec, 4, router)
    _same(drive(stepped, reqs), drive_replicas(fast, reqs, 2))
    assert _kv_state(fast) == _kv_state(stepped)
    assert [(e.clock, e.busy_seconds, e.outstanding_tokens) for e in fast.engines] == \
        [(e.clock, e.busy_seconds, e.outstanding_tokens) for e in stepped.engines]
    assert sum(applied) > 0  # (the prefix router's meetings apply them, the steps run ahead after plan more)
