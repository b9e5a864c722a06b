"""sim/disagg.py's hand-over: each request's timeline (the stages engine/disaggregated.py records for real) and
the local link it is priced on (the KV send path's measured entry, not the all-reduce ring's)."""

import pytest

from servescope.analysis.collectives import LinkSpec, kv_send_key, save_local_link
from servescope.analysis.probe import cpu_model
from servescope.config.engine import BatchingConfig, KVCacheConfig
from servescope.errors import InvalidParameterError
from servescope.sim.disagg import Disaggregated, kv_link_for
from servescope.sim.driver import drive
from servescope.sim.spec import instance_spec
from servescope.sim.workload import synthetic_workload

STAGES = ("arrival", "dispatched", "scheduled", "prefilled", "receiving", "landed", "decode_scheduled", "first_token")


def _spec():
    return instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=512),
                         batching=BatchingConfig(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=4096))


def test_each_hand_over_is_timed_stage_by_stage():
    spec = _spec()
    dep = Disaggregated(spec, 1, 1, kv_link="ib-ndr400")
    reqs = synthetic_workload(6, (100, 900), 5, spec.model.vocab_size, request_rate=50.0, seed=3)
    records, _, finished = drive(dep, reqs)
    assert sorted(dep.timelines) == sorted(f.request_id for f in finished)
    for f, q, r in zip(finished, reqs, records):
        t = dep.timelines[f.request_id]
        times = [t[s] for s in STAGES]
        assert times == sorted(times), t
        assert t["landed"] - t["prefilled"] == pytest.approx(dep.transfer_time(dep.sent_tokens(q.prompt_len)))
        assert t["first_token"] - t["arrival"] == pytest.approx(r.ttft)  # the parts add up to the TTFT


def test_a_local_transfer_is_priced_on_the_measured_kv_send_path(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    spec = _spec()
    with pytest.raises(InvalidParameterError, match="KV send path is not measured"):
        kv_link_for(spec, "local-gloo")
    key = f"{cpu_model()} / {__import__('os').cpu_count()} cores"
    save_local_link(key, LinkSpec("local-gloo", 5e9, 1e-5, call_s=1e-4, step_s=1e-5, max_segment_bytes=1 << 20))
    with pytest.raises(InvalidParameterError):  # the all-reduce ring alone does not price a hand-over
        kv_link_for(spec, "local-gloo")
    save_local_link(kv_send_key(key), LinkSpec("local-gloo", 1e9, 2e-3))
    link = kv_link_for(spec, "local-gloo")
    assert (link.bandwidth, link.latency_s) == (1e9, 2e-3)
    dep = Disaggregated(spec, 1, 1, kv_link="local-gloo")
    assert dep.transfer_time(160) == pytest.approx(160 * spec.kv_bytes_per_token / 1e9 + 2e-3)


def test_the_real_1p1d_takes_a_request_between_its_decode_steps():
    """front "decode" (servescope's own 1P1D): a request that arrives while the decode engine runs a step goes to
    the prefill instance when that step ends; a finished prefill's KV starts across at once (the receiver thread
    runs beside the step: the kernels release the interpreter lock); through a proxy ("proxy", vLLM's) the
    request goes at once too."""
    spec = _spec()
    first = synthetic_workload(1, 300, 60, spec.model.vocab_size, seed=5)[0]
    proxy = Disaggregated(spec, 1, 1, kv_link="ib-ndr400")
    drive(proxy, [first])
    t = proxy.timelines["req-0"]
    mid = (t["first_token"] + proxy.decode[0].clock) / 2  # the decode engine is decoding then
    late = synthetic_workload(1, 200, 4, spec.model.vocab_size, seed=6)[0]
    reqs = [first, type(late)(mid, late.prompt, late.output_len)]
    timelines = {}
    for front in ("proxy", "decode"):
        dep = Disaggregated(spec, 1, 1, kv_link="ib-ndr400", front=front)
        records, _, _ = drive(dep, reqs)
        assert all(r.success for r in records)
        timelines[front] = t1 = dep.timelines["req-1"]
        assert t1["landed"] - t1["receiving"] == pytest.approx(dep.transfer_time(dep.sent_tokens(200)))
        assert t1["receiving"] == t1["prefilled"]  # the KV starts across as the prefill ends, whatever the front
    arrival = timelines["proxy"]["arrival"]
    assert timelines["proxy"]["dispatched"] == arrival
    waited = timelines["decode"]["dispatched"] - arrival
    tpot = (proxy.decode[0].clock - t["first_token"]) / 59
    assert 0 < waited <= tpot * 1.5  # until the running decode step's end: less than about one step
    assert timelines["decode"]["first_token"] > timelines["proxy"]["first_token"]
    with pytest.raises(InvalidParameterError, match="front"):
        Disaggregated(spec, 1, 1, kv_link="ib-ndr400", front="router")
