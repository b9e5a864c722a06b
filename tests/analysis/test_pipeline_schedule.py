"""The pipeline schedule: where a step is cut, the GPipe recurrence, and what `explain --pp` predicts
with and without micro-batches (pure functions)."""

import pytest

from servescope.analysis.collectives import LINKS, LinkSpec
from servescope.analysis.hardware import get_hardware
from servescope.analysis.parallel_explain import explain_parallel
from servescope.analysis.pipeline_schedule import (
    auto_micro_batches, cut_points, pipeline_step, schedule, split_seqs,
)
from servescope.analysis.kv_stages import stage_layers
from servescope.analysis.presets import load_preset


def test_cut_points_near_equal_and_clear_of_forbidden_spans():
    assert cut_points(32, 2) == [16]
    assert cut_points(32, 4) == [8, 16, 24]
    assert cut_points(3, 8) == [1, 2]  # no more pieces than tokens
    assert cut_points(1, 2) == [] and cut_points(32, 1) == []
    assert cut_points(32, 2, forbidden=((10, 20),)) in ([10], [20])
    assert cut_points(32, 2, forbidden=((0, 32),)) == []


def test_split_seqs_cuts_a_prompt_into_chunks():
    # two decodes at context 40 and 7, then a 20-token prompt, cut after 9 tokens
    assert split_seqs([(1, 40), (1, 7), (20, 0)], [9]) == [[(1, 40), (1, 7), (7, 0)], [(13, 7)]]
    assert split_seqs([(1, 40), (1, 7)], [1]) == [[(1, 40)], [(1, 7)]]
    assert split_seqs([(4, 0)], []) == [[(4, 0)]]


def test_schedule_recurrence_by_hand():
    # 2 stages, 3 micro-batches of 1 s each, hand-over 0.5 s:
    # stage 0 ends at 1, 2, 3; stage 1 starts at 1.5 then waits for each: ends 2.5, 3.5, 4.5
    s = schedule([[1, 1]] * 3, [0.5] * 3)
    assert s.total_seconds == pytest.approx(4.5) and s.fill_seconds == pytest.approx(1.5)
    assert s.stall_seconds == pytest.approx(0.0) and s.p2p_seconds == pytest.approx(1.5)
    assert s.busy_seconds == (3, 3) and s.bubble_fraction == pytest.approx(1 - 6 / 9)
    # a slow last stage: stage 1 never waits after the first micro-batch
    slow = schedule([[1, 2]] * 2, [0.0] * 2)
    assert slow.total_seconds == pytest.approx(5) and slow.stall_seconds == pytest.approx(0)
    # one micro-batch: the stages one after another
    assert schedule([[1, 2, 3]], [0.25]).total_seconds == pytest.approx(6.5)


def test_stage_layers_and_auto_rule():
    assert stage_layers(30, 2) == [range(0, 15), range(15, 30)] and stage_layers(3, 2) == [range(0, 2), range(2, 3)]
    # by prefill tokens: a decode-only step (0 prefill tokens) stays whole
    assert auto_micro_batches(0, 2) == 1 and auto_micro_batches(15, 2) == 1 and auto_micro_batches(16, 2) == 2
    assert auto_micro_batches(16, 1) == 1
    assert auto_micro_batches(4, 2, asked=3) == 3


def test_pipeline_step_with_one_micro_batch_is_the_stages_in_sequence():
    cfg, hw = load_preset("llama-3-8b"), get_hardware("h100")
    dt = ("bfloat16", "bfloat16", "bfloat16", 2)
    seqs = [(512, 0)] * 4
    one = pipeline_step(cfg, seqs, hw, 2, 1, LINKS["nvlink4"], dtypes=dt)
    assert one.num_micro_batches == 1
    assert one.total_seconds == pytest.approx(sum(one.stage_seconds[0]) + one.p2p_seconds)
    four = pipeline_step(cfg, seqs, hw, 2, 4, LINKS["nvlink4"], dtypes=dt)
    # compute-bound prefill: the same work in 4 pieces, stage 1 overlapping stage 0
    assert four.num_micro_batches == 4 and four.total_seconds < 0.7 * one.total_seconds
    assert sum(four.busy_seconds) == pytest.approx(sum(one.busy_seconds), rel=0.05)


def test_explain_pp_shows_the_overlap_and_the_cost_of_cutting_a_memory_bound_decode():
    cfg, hw = load_preset("llama-3-70b"), get_hardware("h100")
    r = explain_parallel(cfg, hw, LINKS["nvlink4"], 1, 2, batch=16, prompt_len=1024, micro_batches=4)
    prefill, decode = r["phases"]
    pipe = prefill["pipeline"]
    assert pipe["micro_batches"] == 4 and pipe["overlap_speedup"] > 1.4 and pipe["bubble_fraction"] < 0.3
    # against one device holding the whole model (a 70B prefill fits in time, not memory)
    assert prefill["speedup"] > 1.4
    assert "4 micro-batches overlap the stages" in r["verdict"]
    # a decode step reads the weights once per micro-batch: cut in 4, a memory-bound step gets slower
    assert decode["pipeline"]["overlap_speedup"] < 1
    seq = explain_parallel(cfg, hw, LINKS["nvlink4"], 1, 2, batch=16, prompt_len=1024, micro_batches=1)
    assert seq["phases"][0]["pipeline"]["micro_batches"] == 1
    assert seq["phases"][0]["step_seconds"] == pytest.approx(pipe["one_micro_batch_step_seconds"])
    assert "one after another" in seq["verdict"]


def test_explain_pp_on_one_cpu_shares_the_machine():
    """On a CPU spec the P stages share one machine: overlap recovers the split, never beats one process."""
    from servescope.analysis.spec import HardwareSpec

    cpu = HardwareSpec(name="cpu", kind="cpu", peak_flops={d: 1e11 for d in ("float32", "bfloat16", "float16", "int8")},
                       memory_bandwidth=2e10, memory_bytes=1 << 34)
    link = LinkSpec("loop", 1e9, 50e-6)
    r = explain_parallel(load_preset("llama-3-8b"), cpu, link, 1, 2, batch=4, prompt_len=256, weight_dtype="float32")
    prefill = r["phases"][0]
    assert prefill["pipeline"]["micro_batches"] == 2 and prefill["pipeline"]["overlap_speedup"] > 1.1
    assert prefill["speedup"] < 1.0


def test_each_stage_is_priced_on_its_own_layers_kinds():
    """Gemma 3's five local layers to one global over two stages: stage 0 holds three local layers, stage 1 two
    local and the global one, which reads the whole context. A long decode costs stage 1 more (priced as the
    first three layers, it would cost the same)."""
    from tiny_models import tiny_model_config

    cfg = tiny_model_config("gemma3", num_hidden_layers=6, sliding_window_pattern=6, sliding_window=64,
                            max_position_embeddings=131072)
    dt = ("bfloat16", "bfloat16", "bfloat16", 2)
    step = pipeline_step(cfg, [(1, 100_000)] * 8, get_hardware("h100"), 2, 1, None, dtypes=dt)
    local, with_global = step.stage_seconds[0]
    assert with_global > 2 * local
