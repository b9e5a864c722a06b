"""The measured step table's fit (sim/step_table.py): a bin of few steps cannot lead the table astray."""

import math

import pytest

from servescope.errors import InvalidParameterError
from servescope.sim.step_table import PRIOR_STEPS, between_steps_seconds, fit_step_table, step_bins
from servescope.telemetry.step_record import StepRecord


def _steps(specs) -> list:
    """StepRecords of (count, prefill tokens, decode sequences, context before the step, measured / predicted),
    each measured alone (its period: its own wall time)."""
    out, t = [], 0.0
    for count, prefill, decodes, context, ratio in specs:
        for _ in range(count):
            seqs = max(1, decodes + bool(prefill))
            out.append(StepRecord(
                step=len(out), start_time=t, wall_seconds=0.1 * ratio, num_prefill_seqs=int(bool(prefill)),
                num_decode_seqs=decodes, num_prefill_tokens=prefill, num_decode_tokens=decodes,
                context_lens=[context + (prefill + decodes) / seqs] * seqs, kv_blocks_used=0, kv_blocks_free=0,
                kv_blocks_cached=0, kv_usage=0, num_running=seqs, num_waiting=0, num_preemptions_total=0,
                predicted_seconds=0.1))
            t += 10.0  # idle between steps: each one's period is its own
    return out


# decode steps at 1.0 everywhere; prefill steps of 512 tokens at 1.0 at small and at larger contexts
WELL_MEASURED = [(12, 0, 1, 128, 1.0), (12, 0, 8, 128, 1.0), (12, 0, 1, 1024, 1.0),
                 (12, 512, 0, 0, 1.0), (12, 512, 0, 96, 1.0), (12, 512, 0, 200, 1.0), (12, 256, 0, 0, 1.0)]


@pytest.mark.parametrize("outliers", [1, 2, 3])
def test_a_thin_bin_with_an_outlier_moves_the_prediction_only_as_far_as_its_count_allows(outliers):
    thin = [(outliers, 512, 0, 48, 4.0)]  # a bin of its own (context 32..63) between the two at 1.0
    table = fit_step_table(_steps(WELL_MEASURED + thin))
    bound = 4.0 ** (outliers / (outliers + PRIOR_STEPS))
    assert 1.0 < table.ratio(False, 512, 48) <= bound * (1 + 1e-9)
    assert table.ratio(False, 512, 24) < table.ratio(False, 512, 48)  # between it and the bin at context 1
    # without the shrinkage the same steps set the bin's ratio alone
    assert fit_step_table(_steps(WELL_MEASURED + thin), prior_steps=0).ratio(False, 512, 48) == pytest.approx(4.0)
    # the well-measured bins barely move: their own steps outweigh the outliers beside them
    assert table.ratio(False, 512, 1) < 4.0 ** (outliers * math.exp(-0.5 * 25) / 12)
    assert table.ratio(True, 1, 128) == pytest.approx(1.0)  # the other kind is not touched


def test_a_well_measured_bin_keeps_its_own_ratio_and_a_thin_one_follows_its_near_neighbours():
    specs = WELL_MEASURED[:4] + [(40, 512, 0, 96, 2.0), (12, 512, 0, 200, 1.0), (1, 512, 0, 48, 1.0)]
    table = fit_step_table(_steps(specs))
    assert 2.0 ** (40 / (40 + PRIOR_STEPS)) <= table.ratio(False, 512, 96) < 2.0
    # the one step at context 48 sits next to the 40 at 2.0 (one bin away) and five bins from those at 1.0
    assert table.ratio(False, 512, 48) > 2.0 ** (PRIOR_STEPS / (1 + PRIOR_STEPS)) * 0.95


def test_step_bins_report_each_bins_steps_median_and_the_tables_ratio():
    records = _steps(WELL_MEASURED + [(2, 512, 0, 48, 3.0)])
    rows = step_bins(records)
    assert sum(r["steps"] for r in rows) == len(records)
    table = fit_step_table(records)
    for r in rows:
        assert r["median"] == pytest.approx(3.0 if r["context"] == 48 else 1.0)
        assert table.ratio(r["kind"] == "decode", r["tokens"], r["context"]) == pytest.approx(r["ratio"])
    thin = next(r for r in rows if r["context"] == 48)
    assert thin["steps"] == 2 and 1.0 < thin["ratio"] < 3.0
    assert [r["ratio"] for r in step_bins(records, prior_steps=0)] == pytest.approx([r["median"] for r in rows])


@pytest.mark.parametrize("bad", [-1.0, math.nan])
def test_a_negative_prior_is_refused(bad):
    with pytest.raises(InvalidParameterError):
        fit_step_table(_steps(WELL_MEASURED), prior_steps=bad)
    with pytest.raises(InvalidParameterError):
        step_bins(_steps(WELL_MEASURED), prior_steps=bad)


def test_the_work_between_steps_is_the_median_gap_of_steps_run_back_to_back():
    steps = _steps([(5, 0, 1, 128, 1.0)])  # 0.1 s each, 10 s apart: none followed at once
    assert between_steps_seconds(steps) == 0.0
    t = 0.0
    for r, gap in zip(steps, (2e-3, 1e-3, 3e-3, 50.0, None)):  # a long idle gap is not work between steps
        r.start_time = t
        t += r.wall_seconds + (gap or 0.0)
    assert between_steps_seconds(steps) == pytest.approx(2e-3)
    assert between_steps_seconds(steps[:1]) == 0.0 and between_steps_seconds([]) == 0.0


def test_a_scaled_table_multiplies_every_ratio_and_refuses_a_non_positive_factor():
    table = fit_step_table(_steps(WELL_MEASURED + [(12, 0, 4, 2048, 1.6)]), "profile")
    twice = table.scaled(2.0)
    for decode_only, tokens, context in ((True, 1, 128), (True, 4, 2048), (False, 512, 96), (False, 300, 5000)):
        assert twice.ratio(decode_only, tokens, context) == pytest.approx(2 * table.ratio(decode_only, tokens, context))
    assert twice.source == "profile (x2)" and table.scaled(1.0).to_dict()["decode"] == table.to_dict()["decode"]
    for bad in (0.0, -1.0, math.nan):
        with pytest.raises(InvalidParameterError, match="must be > 0"):
            table.scaled(bad)
