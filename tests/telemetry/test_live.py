"""Plain data for the dashboard: histogram buckets, the bounded frame queue, a step on the wire."""

import pytest

from servescope.engine.outputs import CompletionOutput, RequestOutput
from servescope.telemetry.live import HIST_EDGES_MS, FrameQueue, Histogram, LatencyHistograms, step_event
from servescope.telemetry.request_metrics import RequestMetrics
from servescope.telemetry.step_record import StepRecord


def _rec(**kw):
    base = dict(step=7, start_time=101.5, wall_seconds=0.004, num_prefill_seqs=1, num_decode_seqs=2,
                num_prefill_tokens=30, num_decode_tokens=2, context_lens=[30, 9, 12], kv_blocks_used=5,
                kv_blocks_free=11, kv_blocks_cached=2, kv_usage=5 / 16, num_running=3, num_waiting=1,
                num_preemptions_total=0, predicted_seconds=0.003, flops=4e9, bytes=1e9, bound="memory")
    base.update(kw)
    return StepRecord(**base)


def test_histogram_buckets_are_log_spaced_and_edge_exact():
    assert HIST_EDGES_MS[0] == 0.1 and HIST_EDGES_MS[4] == 1.0 and HIST_EDGES_MS[-1] == 100_000.0
    h = Histogram()
    for s in (0.00005, 0.0001, 0.00099, 0.001, 0.5, 1e6, -1.0, float("nan"), None):
        h.add(s)
    assert h.total == 6  # negative, NaN and None are not latencies
    assert h.counts[0] == 1  # below 0.1 ms
    assert h.counts[1] == 1  # exactly 0.1 ms: [0.1, 0.1778)
    assert h.counts[4] == 1 and h.counts[5] == 1  # 0.99 ms in [0.5623, 1); 1 ms starts the next bucket
    assert h.counts[-1] == 1  # beyond the last edge
    assert sum(h.counts) == h.total


def test_latency_histograms_count_finished_requests_only():
    m = RequestMetrics(arrival_time=0.0, token_times=[0.05, 0.06, 0.08], finished_time=0.08)
    running = RequestOutput("r", None, [1], [CompletionOutput(0, "", [5, 6], None, metrics=m)], finished=False)
    done = RequestOutput("r", None, [1], [CompletionOutput(0, "", [5, 6, 7], "length", metrics=m)], finished=True)
    lh = LatencyHistograms()
    lh.on_output(running)
    assert lh.finished == 0
    lh.on_output(done)
    d = lh.as_dict()
    assert d["finished"] == 1 and sum(d["ttft"]) == 1 and sum(d["tpot"]) == 1 and sum(d["itl"]) == 2
    assert len(d["ttft"]) == len(d["edges_ms"]) + 1


def test_frame_queue_drops_the_oldest_and_counts():
    q = FrameQueue(3)
    for i in range(5):
        q.put(i)
    assert len(q) == 3 and q.dropped == 2
    assert [q.get(), q.get(), q.get(), q.get()] == [2, 3, 4, None]
    with pytest.raises(ValueError):
        FrameQueue(0)


def test_step_event_carries_optional_fields_only_when_present():
    d = step_event(_rec(), t0=100.0)
    assert d["t"] == 1500.0 and d["ms"] == 4.0 and d["pred_ms"] == 3.0 and d["phase"] == "mixed"
    assert (d["flops"], d["bytes"], d["kv_used"], d["running"]) == (4e9, 1e9, 5, 3)
    assert "spec_proposed" not in d and "comm_seconds" not in d and "moe_tokens" not in d
    rec = _rec(predicted_seconds=None)
    rec.num_draft_tokens, rec.num_accepted_tokens = 8, 5  # a step that verified 8 drafts
    d = step_event(rec, t0=100.0)
    assert d["pred_ms"] is None and (d["spec_proposed"], d["spec_accepted"]) == (8, 5)


def test_a_moe_step_carries_its_routing():
    rec = _rec(moe_experts_active=[3, 2], moe_tokens_per_expert=[4, 0, 1, 1], moe_imbalance=1.75,
               moe_expert_bytes=5 * 1024, moe_expected_experts=2.5)
    d = step_event(rec, t0=100.0)
    assert (d["moe_active"], d["moe_expected"], d["moe_imbalance"]) == (2.5, 2.5, 1.75)
    assert d["moe_tokens"] == [4, 0, 1, 1] and d["moe_bytes"] == 5 * 1024
