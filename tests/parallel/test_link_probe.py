"""The link probe: two gloo processes time every size asked, and the engine's fit takes what they measured
(the model's own terms are tested in tests/analysis/test_collectives.py, without processes)."""

import pytest

from servescope.analysis.collectives import all_reduce_seconds
from servescope.parallel.link_probe import fit_local_link, measure_all_reduce, socket_buffer_bytes


@pytest.mark.timeout(300)
def test_probe_times_every_size_and_the_fit_predicts_them():
    sizes = (8 * 1024, 64 * 1024, 256 * 1024, 5 << 20)  # the last past gloo's regime change (2N MiB: more steps)
    measured = measure_all_reduce(sizes, runs=3)
    assert sorted(measured) == list(sizes) and all(t > 0 for t in measured.values())
    link = fit_local_link(measured)
    assert link.max_segment_bytes and link.bandwidth > 0 and link.call_s >= 0 and link.step_s >= 0
    for b, t in measured.items():  # four sizes, four terms at most: a loose check, times are noisy
        assert all_reduce_seconds(b, 2, link) == pytest.approx(t, rel=1.0)


@pytest.mark.timeout(300)
def test_step_collectives_probe_times_every_kind_and_size_and_their_fits_predict_them():
    """The collectives a parallel step issues besides the all-reduce, timed between two processes in a step's
    order: the plan's broadcasts at a decode step's payload, all_to_all_single at the bytes one rank sends the
    other (0: the call alone), the all-gathers at the tokens per expert's bytes and each size's slice; fitted to a
    call + bytes / bandwidth each (the plan: one figure); and the ranks' spread on equal work, kept on the link."""
    from servescope.analysis.collectives import all_gather_seconds, all_to_all_seconds, plan_seconds
    from servescope.analysis.link_fit import fit_step_collectives
    from servescope.parallel.link_probe import COUNTS_INTS, DESYNC_BYTES, PLAN_INTS, measure_step_collectives

    sizes = (0, 16 * 1024, 256 * 1024, 4 << 20)
    measured = measure_step_collectives(sizes, runs=3)
    assert sorted(measured) == ["all_gather", "all_to_all", "desync", "plan"]
    assert list(measured["desync"]) == [DESYNC_BYTES] and measured["desync"][DESYNC_BYTES] >= 0
    assert sorted(measured["all_to_all"]) == list(sizes) and list(measured["plan"]) == [PLAN_INTS * 8]
    # a layer's two all-gathers (the tokens per expert, the slice) timed as a pair, at their mean bytes
    assert sorted(measured["all_gather"]) == [(COUNTS_INTS * 8 + max(4, b)) // 2 for b in sizes]
    assert all(t > 0 for by_size in measured.values() for t in by_size.values())
    link = fit_step_collectives(measured, fit_local_link({8192: 1e-4, 1 << 20: 1e-3, 1 << 24: 2e-2}))
    assert link.a2a_bandwidth > 0 and link.ag_bandwidth > 0 and link.plan_s > 0
    for b, t in measured["all_to_all"].items():  # two terms, four noisy sizes: a loose check
        assert all_to_all_seconds(b, 2, link) == pytest.approx(t, rel=1.0)
    for b, t in measured["all_gather"].items():
        assert all_gather_seconds(b, 2, link) == pytest.approx(t, rel=1.0)
    assert plan_seconds(PLAN_INTS * 8, 2, link) == pytest.approx(measured["plan"][PLAN_INTS * 8], rel=0.01)
    assert link.desync == measured["desync"][DESYNC_BYTES]


def test_socket_buffer_is_read_from_the_kernel(tmp_path):
    f = tmp_path / "tcp_rmem"
    f.write_text("4096\t131072\t33554432\n")
    assert socket_buffer_bytes(str(f)) == 131072
    assert socket_buffer_bytes(str(tmp_path / "absent")) == 0  # not Linux: one rate for every byte
    f.write_text("garbage")
    assert socket_buffer_bytes(str(f)) == 0


def test_tp_step_predictions_use_the_gloo_ring(monkeypatch):
    """StepRecords of a TP=2 engine add the collectives as the measured link's ring model predicts them."""
    import torch

    from servescope.analysis.collectives import LinkSpec, gather_seconds, plan_bytes, plan_seconds
    from servescope.analysis.hardware import get_hardware
    from servescope.analysis.presets import load_preset
    from servescope.engine import step_cost
    from servescope.telemetry.step_record import StepRecord

    link = LinkSpec("local-gloo", bandwidth=1e9, latency_s=3e-4, call_s=2e-4, step_s=1e-4, max_segment_bytes=1 << 20,
                    buffer_bytes=128 << 10, buffered_bandwidth=4e9)
    cfg = load_preset("llama-3-8b")
    pred = step_cost.StepCostPredictor(cfg, get_hardware("h100"), link, torch.float32, torch.float32, None, tp=2)
    rec = StepRecord(0, 0.0, 0.0, 0, 4, 0, 4, [8] * 4, 0, 0, 0, 0.0, 4, 0, 0)
    pred.annotate(rec, [(1, 8)] * 4, num_logits=4)
    act = 4 * cfg.hidden_size * 4  # [T, Dm] float32: 64 KiB, inside the socket buffer
    reduces = (2 * cfg.num_hidden_layers + 1) * (2e-4 + 4 * 1e-4 + act / 4e9)
    logits = gather_seconds(4 * -(-cfg.vocab_size // 2) * 4, 2, link)  # the [B, V/2] shards on shard 0
    plan = plan_seconds(plan_bytes(4, 4), 2, link)  # rank 0's broadcasts of the step plan, before any of them
    assert rec.predicted_comm_seconds == pytest.approx(reduces + logits + plan)
    assert all_reduce_seconds(act, 2, link) == pytest.approx(2e-4 + 4 * 1e-4 + act / 4e9)
