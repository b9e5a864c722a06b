"""The labs' pure parts on synthetic data: fits, calibration, percentiles, report writing."""

import json
import math

import numpy as np
import pytest

from servescope.labs import LABS, all_labs
from servescope.labs.attention_scaling import quadratic_fit, quadratic_share
from servescope.labs.batching import overhead_fit
from servescope.labs.chunked_prefill import stall_window
from servescope.labs.common import md_table, percentile, rel_error, seqs_of, write_report
from servescope.labs.kv_cache import linear_fit
from servescope.labs.validate import error_summary, fit_calibration, fit_decode_efficiency
from servescope.telemetry.step_record import StepRecord


def test_quadratic_fit_recovers_coefficients_and_share():
    n = np.array([128, 512, 1024, 2048, 4096], float)
    a, b, c = 0.02, 3e-4, 5e-8
    fit = quadratic_fit(n, a + b * n + c * n * n)
    assert fit == pytest.approx((a, b, c), rel=1e-6)
    share = quadratic_share(fit, 4096)
    assert share == pytest.approx(c * 4096**2 / (a + b * 4096 + c * 4096**2))
    assert quadratic_share(fit, 128) < share  # the n^2 part grows with n


def test_linear_fit():
    x = [10, 20, 30, 40]
    assert linear_fit(x, [1 + 0.5 * v for v in x]) == pytest.approx((1.0, 0.5))


def test_overhead_fit_is_the_batch_one_gap_and_never_negative():
    assert overhead_fit([0.030, 0.031], [0.010, 0.011]) == pytest.approx(0.020)
    assert overhead_fit([0.005], [0.010]) == 0.0


def _synthetic_predict():
    """A two-point roofline: (memory seconds, compute seconds at efficiency 1) per point."""
    def predict(kind, e, o):
        m, c = {"decode": (0.010, 0.001), "prefill": (0.020, 0.100)}[kind]
        return o + max(c / e, m)
    return predict


def test_fit_calibration_recovers_overhead_and_efficiency():
    predict = _synthetic_predict()
    o_true, e_true = 0.007, 0.6
    t_dec = predict("decode", e_true, o_true)
    t_pre = predict("prefill", e_true, o_true)
    o, e = fit_calibration(predict, t_dec, t_pre)
    assert o == pytest.approx(o_true, rel=1e-6)
    assert e == pytest.approx(e_true, rel=1e-6)


def test_fit_calibration_clamps():
    predict = _synthetic_predict()
    # decode faster than its roofline: no negative overhead; prefill faster than peak: e = 1
    o, e = fit_calibration(predict, 0.005, 0.050)
    assert o == 0.0 and e == 1.0


def test_error_summary_and_rel_error():
    assert rel_error(1.2, 1.0) == pytest.approx(0.2)
    s = error_summary([0.1, -0.3, 0.2])
    assert s["max_abs"] == pytest.approx(0.3)
    assert s["mean_abs"] == pytest.approx(0.2)
    assert s["within_tolerance"] == 2 and s["count"] == 3


def test_percentile_matches_numpy():
    xs = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    for q in (0, 25, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert math.isnan(percentile([], 50))


def test_stall_window_keeps_gaps_overlapping_the_prefill():
    # gaps end at t; gap g spans [t - g, t]
    times = [1.0, 2.0, 5.0, 5.2, 9.0]
    gaps = [0.1, 0.1, 3.0, 0.2, 0.1]
    assert stall_window(times, gaps, start=2.5, end=5.1) == [3.0, 0.2]


def _rec(prefill=0, decode=0, ctx=(), seqs=1):
    return StepRecord(step=1, start_time=0.0, wall_seconds=0.01, num_prefill_seqs=seqs if prefill else 0,
                      num_decode_seqs=decode, num_prefill_tokens=prefill, num_decode_tokens=decode,
                      context_lens=list(ctx), kv_blocks_used=1, kv_blocks_free=1, kv_blocks_cached=0,
                      kv_usage=0.5, num_running=1, num_waiting=0, num_preemptions_total=0)


def test_seqs_of_rebuilds_step_shapes():
    assert seqs_of(_rec(decode=2, ctx=(129, 140))) == [(1, 128), (1, 139)]
    assert seqs_of(_rec(prefill=512, ctx=(512,))) == [(512, 0)]
    assert seqs_of(_rec(prefill=256, ctx=(768,))) == [(256, 512)]  # a later chunk
    assert seqs_of(_rec(prefill=10, decode=1, ctx=(10, 5))) is None  # mixed: unknown split


def test_write_report_and_md_table(tmp_path):
    table = md_table(["a", "b"], [[1, 0.123456], ["x", float("nan")]])
    assert table.splitlines()[0] == "| a | b |"
    assert "0.1235" in table and "| x | - |" in table
    plot = tmp_path / "p.png"
    path = write_report(tmp_path, "T", [("S", table)], [plot], {"v": [1.0, float("inf")]}, footer="end")
    text = path.read_text()
    assert text.startswith("# T") and "## S" in text and "![p](p.png)" in text and text.rstrip().endswith("end")
    assert json.loads((tmp_path / "results.json").read_text()) == {"v": [1.0, None]}
    assert not list(tmp_path.glob(".*.tmp"))


def test_registry_names():
    assert list(LABS) == ["prefill-vs-decode", "kv-cache", "attention-scaling", "batching",
                          "latency-vs-throughput", "chunked-prefill", "speculative", "quantization", "moe",
                          "kv-layouts"]
    assert list(all_labs()) == list(LABS) + ["validate", "simulate", "cluster", "parallelism"]


def test_fit_decode_efficiency_bisects_and_clamps():
    predict = lambda ed: 0.01 + 0.05 / ed  # noqa: E731 (falls as the efficiency grows)
    assert fit_decode_efficiency(predict, 0.01 + 0.05 / 0.4) == pytest.approx(0.4, rel=1e-6)
    assert fit_decode_efficiency(predict, 0.05) == 1.0  # faster than the roofline at e_d = 1


def test_error_summary_of_nothing():
    assert error_summary([])["count"] == 0


def _step(t, wall, prefill, decodes, pred):
    """A StepRecord of a step at t taking `wall` seconds: a prefill of `prefill` tokens and `decodes` decodes, each
    sequence at context 100 after it, predicted at `pred` seconds."""
    return StepRecord(step=0, start_time=t, wall_seconds=wall, num_prefill_seqs=int(bool(prefill)),
                      num_decode_seqs=decodes, num_prefill_tokens=prefill, num_decode_tokens=decodes,
                      context_lens=[100] * (decodes + bool(prefill)), kv_blocks_used=0, kv_blocks_free=0,
                      kv_blocks_cached=0, kv_usage=0, num_running=1, num_waiting=0, num_preemptions_total=0,
                      predicted_seconds=pred)


def test_simulate_lab_counts_steps_by_kind_and_their_period_over_the_prediction():
    from servescope.labs.sim_validation import step_kinds

    # the engine: a prefill, then three decodes of one sequence back to back (periods 0.011), the last alone
    real = [_step(0.0, 0.1, 64, 0, 0.08), _step(0.101, 0.010, 0, 1, 0.011), _step(0.112, 0.010, 0, 1, 0.011),
            _step(0.123, 0.010, 0, 1, 0.011)]
    sim = [_step(0.0, 0.08, 64, 0, 0.08)] + [_step(0.1, 0.011, 0, 1, 0.011)] * 2 + [_step(0.2, 0.02, 0, 2, 0.02)]
    sim += [_step(0.3, 0.02, 0, 3, 0.02), _step(0.4, 0.03, 0, 4, 0.03), _step(0.5, 0.03, 0, 5, 0.03)]
    kinds = {(k["kind"], k["seqs"]): k for k in step_kinds(real, sim)}
    assert set(kinds) == {("prefill", 1), ("decode", 1), ("decode", 2), ("decode", 4), ("decode", 8)}
    assert kinds["decode", 4]["simulated steps"] == 2 and kinds["decode", 4]["simulated ms"] == pytest.approx(25.0)
    d1 = kinds["decode", 1]
    assert d1["engine steps"] == 3 and d1["simulated steps"] == 2
    assert d1["engine period ms"] == pytest.approx(11.0)
    assert d1["measured / predicted"] == pytest.approx(1.0)  # periods 11, 11 and the last one's wall 10 ms
    assert kinds["prefill", 1]["measured / predicted"] == pytest.approx(0.101 / 0.08)
    assert kinds["decode", 2]["engine steps"] == 0 and kinds["decode", 2]["engine period ms"] is None
    assert kinds["decode", 2]["simulated ms"] == pytest.approx(20.0)


def test_simulate_lab_sensitivity_says_how_far_a_step_time_error_moves_each_metric():
    import math as _math

    from servescope.config.engine import KVCacheConfig
    from servescope.errors import InvalidParameterError
    from servescope.labs.sim_validation import FLOORS, Workload, sensitivity
    from servescope.sim.spec import instance_spec
    from servescope.sim.step_table import StepTable
    from servescope.sim.workload import synthetic_workload

    flat = StepTable(((1.0, ((1.0, 1.0),)),), ((1.0, ((1.0, 1.0),)),))
    spec = instance_spec("smollm2-135m", "H100", cache=KVCacheConfig(num_kv_blocks=512, enable_prefix_caching=False))
    # everything at once: every time scales with the steps, the throughput inversely
    w = Workload("saturation", 16, (64, 128), (8, 16), _math.inf)
    reqs = synthetic_workload(16, (64, 128), (8, 16), 1000, _math.inf, seed=0)
    s = sensitivity(spec.replace(step_table=flat), w, reqs)
    assert set(s) == set(FLOORS) | {"busy"} and s["busy"] == pytest.approx(1.0, abs=0.02)
    for k in ("median_ttft_ms", "median_tpot_ms", "p90_ttft_ms"):
        assert s[k] == pytest.approx(1.0, abs=0.05), k
    assert s["output_throughput"] == pytest.approx(-1.0, abs=0.05)
    # one request every 10 s on an engine that needs milliseconds: idle, the offered load sets the throughput
    w = Workload("low rate", 4, (64, 128), (8, 16), 0.1)
    reqs = synthetic_workload(4, (64, 128), (8, 16), 1000, 0.1, seed=0)
    s = sensitivity(spec.replace(step_table=flat), w, reqs)
    assert s["busy"] < 0.05 and abs(s["output_throughput"]) < 0.05
    assert s["median_ttft_ms"] == pytest.approx(1.0, abs=0.05) and s["median_tpot_ms"] == pytest.approx(1.0, abs=0.05)
    with pytest.raises(InvalidParameterError, match="step table"):
        sensitivity(spec, w, reqs)


def test_simulate_lab_says_how_far_a_runs_steps_were_from_the_step_table():
    from servescope.labs.sim_validation import table_drift
    from servescope.sim.step_table import StepTable

    # decode steps priced at 2x their prediction, prefill steps at 3x
    table = StepTable(((1.0, ((1.0, 2.0),)),), ((1.0, ((1.0, 3.0),)),))
    as_priced = [_step(0.0, 0.3, 64, 0, 0.1), _step(10.0, 0.02, 0, 1, 0.01), _step(20.0, 0.04, 0, 2, 0.02)]
    assert table_drift(as_priced, table) == pytest.approx({"decode": 1.0, "prefill": 1.0})
    # the decode steps a fifth longer in total (one of them 1.6x), the prefill 10% shorter
    slower = [_step(0.0, 0.27, 64, 0, 0.1), _step(10.0, 0.02, 0, 1, 0.01), _step(20.0, 0.052, 0, 2, 0.02)]
    assert table_drift(slower, table) == pytest.approx({"decode": 1.2, "prefill": 0.9})
    # back to back, a step's period (to the next start) is what counts; steps without a prediction do not
    back_to_back = [_step(0.0, 0.02, 0, 1, 0.01), _step(0.025, 0.02, 0, 1, 0.01), _step(0.05, 0.02, 0, 1, None)]
    assert table_drift(back_to_back, table) == pytest.approx({"decode": 1.25, "prefill": None})
    assert table_drift([_step(0.0, 0.02, 0, 1, None)], table) == {"decode": None, "prefill": None}
