"""Metric arithmetic on hand-made timelines with known answers (vLLM's definitions)."""

import json
from array import array
import math

import numpy as np
import pytest

from servescope.bench.metrics import (
    LatencyStats,
    RequestRecord,
    compute_metrics,
    max_concurrency_seen,
    parse_goodput,
)
from servescope.errors import InvalidParameterError


def rec(ttft, itl, output_len, start=0.0, prompt_len=10, latency=None):
    # E2E is the last content chunk: ttft + sum of gaps, unless given.
    if latency is None:
        latency = ttft + sum(itl)
    return RequestRecord(success=True, prompt_len=prompt_len, output_len=output_len, ttft=ttft,
                         itl=itl, latency=latency, start_time=start)


# Request A: TTFT 0.1, 4 tokens, gaps 0.02/0.03/0.05 -> e2e 0.2, TPOT 0.1/3.
# Request B: TTFT 0.3, 3 tokens, gaps 0.1/0.1 -> e2e 0.5, TPOT 0.1.
# Request C: TTFT 0.2, 1 token -> e2e 0.2, excluded from TPOT.
# Request D: failed.
A = rec(0.1, [0.02, 0.03, 0.05], 4, start=0.0, prompt_len=10)
B = rec(0.3, [0.1, 0.1], 3, start=0.1, prompt_len=20)
C = rec(0.2, [], 1, start=0.15, prompt_len=30)
D = RequestRecord(success=False, prompt_len=40, latency=0.05, start_time=0.6, error="HTTP 500: boom")


def test_basic_aggregates():
    r = compute_metrics([A, B, C, D], duration_s=2.0)
    assert r.completed == 3 and r.failed == 1
    assert r.total_input_tokens == 60  # the failed request's prompt does not count
    assert r.total_output_tokens == 8
    assert r.request_throughput == pytest.approx(1.5)
    assert r.output_throughput == pytest.approx(4.0)
    assert r.total_token_throughput == pytest.approx(34.0)
    assert r.request_goodput is None
    assert r.error_counts == {"HTTP 500: boom": 1}


def test_ttft_e2el_stats():
    r = compute_metrics([A, B, C, D], duration_s=1.0)
    ttfts = np.array([100.0, 300.0, 200.0])
    assert r.ttft.mean_ms == pytest.approx(200.0)
    assert r.ttft.median_ms == pytest.approx(200.0)
    assert r.ttft.std_ms == pytest.approx(float(np.std(ttfts)))
    # linear interpolation: sorted [100, 200, 300], p90 at rank 1.8 -> 280
    assert r.ttft.percentiles_ms[90.0] == pytest.approx(280.0)
    assert r.ttft.percentiles_ms[99.0] == pytest.approx(298.0)
    assert r.e2el.mean_ms == pytest.approx((200 + 500 + 200) / 3)
    assert r.e2el.median_ms == pytest.approx(200.0)


def test_tpot_excludes_single_token_requests():
    r = compute_metrics([A, B, C], duration_s=1.0)
    tpots = [100.0 / 3, 100.0]  # ms; C (1 token) excluded
    assert A.tpot == pytest.approx(0.1 / 3) and C.tpot is None
    assert r.tpot.mean_ms == pytest.approx(np.mean(tpots))
    assert r.tpot.median_ms == pytest.approx(np.median(tpots))
    assert r.tpot.percentiles_ms[90.0] == pytest.approx(np.percentile(tpots, 90))


def test_itl_pools_all_gaps():
    r = compute_metrics([A, B, C, D], duration_s=1.0)
    gaps = [20.0, 30.0, 50.0, 100.0, 100.0]
    assert r.itl.mean_ms == pytest.approx(60.0)
    assert r.itl.median_ms == pytest.approx(50.0)
    # sorted [20, 30, 50, 100, 100]: p90 at rank 3.6 -> 100; p99 -> 100
    assert r.itl.percentiles_ms[90.0] == pytest.approx(np.percentile(gaps, 90)) == pytest.approx(100.0)


def test_itl_pool_is_every_success_s_gaps_in_request_order_bit_for_bit():
    # mean and std sum in the pool's order: the pool must be the successes' gaps, request by request, exactly
    rng = np.random.default_rng(3)
    recs = [rec(0.1, rng.random(int(n)).tolist(), int(n) + 1) for n in rng.integers(0, 40, 300)]
    recs[7] = RequestRecord(success=False, prompt_len=5, latency=0.1, start_time=0.0, error="boom")
    pool = np.concatenate([np.asarray(r.itl.tolist()) for r in recs if r.success]) * 1000.0
    s = compute_metrics(recs, 1.0).itl
    assert (s.mean_ms, s.std_ms, s.median_ms) == (float(np.mean(pool)), float(np.std(pool)), float(np.median(pool)))
    assert s.percentiles_ms[90.0] == float(np.percentile(pool, 90))
    assert compute_metrics([C, D], 1.0).itl.mean_ms == 0.0  # no gap at all: zeros, as vLLM


def test_tpot_uses_e2e_not_itl_mean():
    # A chunk carrying several tokens: 5 tokens in 2 chunks. TPOT divides by tokens, ITL by chunks.
    r = rec(0.1, [0.4], output_len=5)
    assert r.tpot == pytest.approx(0.1)
    m = compute_metrics([r], 1.0)
    assert m.itl.mean_ms == pytest.approx(400.0)
    assert m.tpot.mean_ms == pytest.approx(100.0)


def test_goodput_counts_requests_meeting_every_slo():
    # A: ttft 100, tpot 33.3, e2e 200. B: ttft 300, tpot 100, e2e 500. C: ttft 200, tpot 0, e2e 200.
    recs = [A, B, C, D]
    assert compute_metrics(recs, 2.0, goodput="ttft:250").request_goodput == pytest.approx(1.0)  # A, C
    assert compute_metrics(recs, 2.0, goodput="tpot:50").request_goodput == pytest.approx(1.0)  # A, C (tpot 0)
    assert compute_metrics(recs, 2.0, goodput="ttft:150 tpot:50").request_goodput == pytest.approx(0.5)  # A
    assert compute_metrics(recs, 2.0, goodput=["e2el:500"]).request_goodput == pytest.approx(1.5)  # all, inclusive
    assert compute_metrics(recs, 2.0, goodput={"e2el": 100}).request_goodput == 0.0


def test_parse_goodput():
    assert parse_goodput("ttft:200 tpot:50") == {"ttft": 200.0, "tpot": 50.0}
    assert parse_goodput(["E2EL:1000"]) == {"e2el": 1000.0}
    assert parse_goodput(None) == {}
    for bad in ["ttft", "itl:5", "ttft:abc", "ttft:-1"]:
        with pytest.raises(InvalidParameterError):
            parse_goodput(bad)


def test_empty_and_all_failed():
    r = compute_metrics([D], 1.0, goodput="ttft:100")
    assert r.completed == 0 and r.failed == 1
    assert r.ttft.mean_ms == 0.0 and r.itl.percentiles_ms[99.0] == 0.0
    assert r.request_goodput == 0.0 and r.output_throughput == 0.0
    with pytest.raises(ValueError):
        compute_metrics([A], 0.0)


def test_max_concurrency_seen():
    # A [0, 0.2), B [0.1, 0.6), C [0.15, 0.35), D [0.6, 0.65): peak 3; D starts as B ends.
    assert max_concurrency_seen([A, B, C, D]) == 3
    assert max_concurrency_seen([]) == 0
    back_to_back = [rec(0.1, [], 1, start=0.0, latency=1.0), rec(0.1, [], 1, start=1.0, latency=1.0)]
    assert max_concurrency_seen(back_to_back) == 1


def test_to_dict_stable_keys_and_json():
    r = compute_metrics([A, B, C, D], 2.0, goodput="ttft:250", percentiles=(90, 99, 99.9),
                        config={"request_rate": math.inf})
    d = r.to_dict(include_records=True)
    for name in ("ttft", "tpot", "itl", "e2el"):
        for stat in ("mean", "median", "std", "p90", "p99", "p99.9"):
            assert f"{stat}_{name}_ms" in d
    for key in ("request_throughput", "output_throughput", "total_token_throughput", "completed",
                "failed", "duration_s", "request_goodput", "max_concurrency_seen"):
        assert key in d
    assert d["median_ttft_ms"] == pytest.approx(200.0)
    assert len(d["records"]) == 4
    json.dumps(d)  # JSON-able (inf becomes Infinity, which json allows)


def test_record_validation():
    with pytest.raises(ValueError):
        RequestRecord(success=True, prompt_len=-1)
    with pytest.raises(ValueError):
        RequestRecord(success=True, prompt_len=1, ttft=-0.1)


def test_a_record_keeps_its_itls_as_float64s_and_reports_them_as_a_list():
    """RequestRecord.itl is an array("d") whatever sequence of numbers it is given (the simulator's pooling
    reads it as float64s in bulk); equal gaps compare equal, and to_dict writes plain floats."""
    given = [0.25, 1, np.float64(0.5)]
    r = RequestRecord(success=True, prompt_len=3, output_len=4, ttft=0.1, itl=given, latency=1.85)
    assert isinstance(r.itl, array) and r.itl.typecode == "d" and r.itl.tolist() == [0.25, 1.0, 0.5]
    assert r == RequestRecord(success=True, prompt_len=3, output_len=4, ttft=0.1, itl=(0.25, 1.0, 0.5), latency=1.85)
    d = compute_metrics([r], 2.0).to_dict(include_records=True)
    assert d["records"][0]["itl_s"] == [0.25, 1.0, 0.5] and all(type(x) is float for x in d["records"][0]["itl_s"])
    assert d["mean_itl_ms"] == pytest.approx(1750.0 / 3)


@pytest.mark.parametrize("n", [1, 2, 7, 1000, 1001])
def test_latency_stats_equal_numpy_on_an_untouched_copy_bit_for_bit(n):
    """from_seconds partitions its own copy in place for the order statistics: every number is still numpy's
    on the values as given (mean and std in their order), and the input is left as it was."""
    rng = np.random.default_rng(n)
    values = rng.exponential(0.05, n)
    values[rng.integers(0, n, n // 3)] = 0.0125  # ties
    before = values.copy()
    ps = (50.0, 90.0, 99.0, 99.9, 0.0, 100.0)
    s = LatencyStats.from_seconds(values, ps)
    ms = before * 1000.0
    assert np.array_equal(values, before)
    assert s.mean_ms == float(np.mean(ms)) and s.std_ms == float(np.std(ms)) and s.median_ms == float(np.median(ms))
    assert s.percentiles_ms == {p: float(np.percentile(ms, p)) for p in ps}
    assert list(s.percentiles_ms) == list(ps)
