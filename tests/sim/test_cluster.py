"""Deployments: replicas behind a router, prefill/decode disaggregation, the layout search."""

import pytest

from servescope.config.engine import BatchingConfig, KVCacheConfig, ParallelConfig
from servescope.errors import InvalidParameterError
from servescope.sim.cluster import Deployment
from servescope.sim.disagg import Disaggregated
from servescope.sim.driver import drive
from servescope.sim.run import simulate
from servescope.sim.search import Layout, Search, binding
from servescope.sim.spec import instance_spec
from servescope.sim.workload import SimRequest, synthetic_workload


def _spec(**kw):
    return instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=512),
                         batching=BatchingConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=4096), **kw)


def test_round_robin_spreads_requests_evenly():
    spec = _spec()
    dep = Deployment(spec, 3, "round-robin")
    reqs = synthetic_workload(9, 64, 4, spec.model.vocab_size, request_rate=100.0)
    records, _, _ = drive(dep, reqs)
    assert all(r.success for r in records)
    assert [len(dep.served_by(i)) for i in range(3)] == [3, 3, 3]


def test_least_tokens_sends_a_request_to_the_idle_replica():
    spec = _spec()
    dep = Deployment(spec, 2, "least-tokens")
    reqs = [SimRequest(0.0, tuple(range(1, 2000)), 200), SimRequest(1e-3, tuple(range(5, 40)), 4)]
    drive(dep, reqs)
    assert dep.served_by(0) == {"req-0"} and dep.served_by(1) == {"req-1"}


def test_prefix_router_keeps_a_session_on_the_replica_that_holds_its_prefix():
    spec = _spec()
    base = tuple(range(100, 1124))
    reqs = [SimRequest(0.0, base, 4), SimRequest(0.5, tuple(range(3000, 3100)), 4),
            SimRequest(1.0, base + (7,) * 64, 4), SimRequest(1.5, base + (7,) * 64 + (9,) * 64, 4)]
    prefix = Deployment(spec, 2, "prefix")
    _, _, finished = drive(prefix, reqs)
    home = 0 if "req-0" in prefix.served_by(0) else 1
    assert {"req-2", "req-3"} <= prefix.served_by(home)
    assert finished[2].metrics.num_cached_tokens == 1024 and finished[3].metrics.num_cached_tokens == 1088
    rr = Deployment(spec, 2, "round-robin")
    _, _, finished = drive(rr, reqs)
    assert finished[2].metrics.num_cached_tokens == 1024  # round robin puts turn 2 back on replica 0 ...
    assert finished[3].metrics.num_cached_tokens == 0  # ... and turn 3 on replica 1, which never saw it


def test_disaggregation_prefills_on_one_instance_and_decodes_on_the_other():
    spec = _spec()
    dep = Disaggregated(spec, 1, 1, kv_link="ib-ndr400")
    reqs = synthetic_workload(4, (300, 600), 20, spec.model.vocab_size, request_rate=20.0)
    records, _, finished = drive(dep, reqs)
    assert all(r.success and r.output_len == 20 for r in records)
    pre, dec = dep.engines
    assert pre.tokens_scheduled == sum(r.prompt_len for r in reqs)  # each prompt once, on the prefill side
    # the decode side computes only each prompt's last partial block (sampling the first token there), then
    # decodes the other 19
    assert dec.tokens_scheduled == sum((r.prompt_len - 1) % 16 + 1 + 19 for r in reqs)
    assert all(f.metrics.num_cached_tokens == dep.sent_tokens(q.prompt_len) for f, q in zip(finished, reqs))
    assert dep.recomputed == 0 and all(f.metrics.num_preemptions == 0 for f in finished)
    one = drive(Deployment(spec), reqs)[0]
    # the first token comes after the prefill and the KV transfer: later than on one instance
    for r, o, q in zip(records, one, reqs):
        assert r.ttft > o.ttft + dep.transfer_time(dep.sent_tokens(q.prompt_len)) - 1e-12
    assert dep.transfer_time(1000) == pytest.approx(1000 * spec.kv_bytes_per_token / 50e9 + 5e-6)


def test_disaggregation_needs_prefix_caching_to_take_the_kv():
    spec = instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=64, enable_prefix_caching=False),
                         batching=BatchingConfig(max_model_len=1024))
    with pytest.raises(InvalidParameterError, match="prefix caching"):
        Disaggregated(spec, 1, 1, kv_link="ib-ndr400")


def test_search_finds_the_fewest_devices_that_meet_the_slos():
    def spec_for(tp):
        return instance_spec("llama-3-8b", "L4", parallel=ParallelConfig(tensor_parallel_size=tp),
                             batching=BatchingConfig(max_num_seqs=32, max_num_batched_tokens=2048, max_model_len=4096))

    reqs = synthetic_workload(60, (512, 1024), (16, 32), spec_for(1).model.vocab_size, request_rate=6.0)
    slos = {"ttft": 500.0, "tpot": 60.0}
    search = Search(spec_for, reqs, slos, target=0.9, max_devices=8)
    best = search.run()
    assert best is not None and best.meets(0.9)
    assert best.devices == 2 and not any(t.meets(0.9) for t in search.trials.values() if t.devices < 2)
    assert not search.trial(Layout("colocated", 1, instances=1), spec_for(1)).meets(0.9)
    short = search.neighbour(best)
    if short is not None:
        assert "missed by" in binding(short, slos)


def test_a_layout_is_run_once():
    spec = _spec()
    reqs = synthetic_workload(10, 64, 4, spec.model.vocab_size, request_rate=50.0)
    search = Search(lambda tp: spec, reqs, {"ttft": 1000.0})
    a = search.trial(Layout("colocated", 1, instances=2), spec)
    assert search.trial(Layout("colocated", 1, instances=2), spec) is a


def test_simulate_reports_bench_serves_keys():
    spec = _spec()
    run = simulate(Deployment(spec), synthetic_workload(5, 32, 8, spec.model.vocab_size), goodput="ttft:100")
    d = run.result.to_dict()
    for key in ("completed", "request_throughput", "output_throughput", "request_goodput", "median_ttft_ms",
                "p90_ttft_ms", "p99_tpot_ms", "mean_itl_ms", "median_e2el_ms"):
        assert key in d
    assert d["completed"] == 5


def test_a_mixture_of_experts_is_simulated_with_its_experts_split_or_sharded():
    """-ep X on a MoE preset prices each rank's share of the experts and the all-to-alls (its predictor carries
    EP); TP without EP shards each expert; EP on a dense model, or X neither T nor with T = 1, is refused."""
    reqs = synthetic_workload(24, 128, 16, 151936, request_rate=20.0)

    def run(tp: int, ep: int):
        spec = instance_spec("qwen3-30b-a3b", "h100", parallel=ParallelConfig(tensor_parallel_size=tp), ep=ep)
        assert spec.predictor().ep == ep
        return simulate(Deployment(spec), reqs).result.to_dict()

    one, ep2, tp2 = run(1, 1), run(1, 2), run(2, 1)
    assert ep2["median_tpot_ms"] < one["median_tpot_ms"] and tp2["median_tpot_ms"] < one["median_tpot_ms"]
    assert ep2["median_tpot_ms"] != tp2["median_tpot_ms"]
    with pytest.raises(InvalidParameterError, match="no experts to split"):
        instance_spec("llama-3-8b", "h100", ep=2)
    with pytest.raises(InvalidParameterError, match="needs EP = TP"):
        instance_spec("qwen3-30b-a3b", "h100", parallel=ParallelConfig(tensor_parallel_size=4), ep=2)
