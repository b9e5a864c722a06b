"""Scheduler steps on plain integers: what is scheduled, with which blocks, in which order."""

import pytest

from servescope.scheduler.request import RequestStatus
from scheduler_harness import Harness as make, seqs


def test_prefill_then_decode_grows_blocks_at_boundaries():
    h = make(block_size=4)
    a = h.add("a", 6)
    assert a.status is RequestStatus.WAITING and a.num_cached_tokens == -1
    out = h.step()
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.num_new_tokens, s.is_prefill, s.will_sample) == (0, 6, True, True)
    assert s.block_ids == [0, 1]
    assert (out.total_num_scheduled_tokens, out.num_prefill_tokens, out.num_decode_tokens) == (6, 6, 0)
    assert (out.num_running, out.num_waiting) == (1, 0)
    assert a.status is RequestStatus.RUNNING and a.first_scheduled_time == 100.0 and a.num_cached_tokens == 0
    assert a.num_computed_tokens == 6 and a.output_token_ids == [1000]
    out = h.step()
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.num_new_tokens, s.is_prefill, s.will_sample) == (6, 1, False, True)
    assert (out.num_prefill_tokens, out.num_decode_tokens) == (0, 1)
    assert h.kv.num_cached_blocks == 1
    h.step()  # computes token 7: block 1 is full
    assert h.blocks("a") == [0, 1] and h.kv.num_cached_blocks == 2
    out = h.step()  # token 8 starts block 2
    assert out.scheduled[0].block_ids == [0, 1, 2]
    assert a.num_tokens == 10 and a.num_computed_tokens == 9


def test_chunked_prefill_chunk_16():
    h = make(block_size=4, budget=16)
    a = h.add("a", 40)
    outs = [h.step() for _ in range(4)]
    assert [seqs(o) for o in outs] == [[("a", 0, 16)], [("a", 16, 16)], [("a", 32, 8)], [("a", 40, 1)]]
    assert [o.scheduled[0].is_prefill for o in outs] == [True, True, True, False]
    assert [o.scheduled[0].will_sample for o in outs] == [False, False, True, True]
    assert [len(o.scheduled[0].block_ids) for o in outs] == [4, 8, 10, 11]
    assert a.output_token_ids == [1000, 1001]


def test_chunked_prefill_chunk_1():
    h = make(block_size=1, budget=1, num_blocks=16)
    a = h.add("a", 5)
    outs = [h.step() for _ in range(6)]
    assert [seqs(o) for o in outs] == [[("a", i, 1)] for i in range(6)]
    # the last prompt token (position 4) is still a prompt token: prefill
    assert [o.scheduled[0].is_prefill for o in outs] == [True, True, True, True, True, False]
    assert [o.scheduled[0].will_sample for o in outs] == [False, False, False, False, True, True]
    assert a.output_token_ids == [1000, 1001]
    assert h.blocks("a") == [0, 1, 2, 3, 4, 5]


def test_decode_and_prefill_mix_under_token_budget():
    h = make(block_size=4, budget=8)
    h.add("a", 6)
    assert seqs(h.step()) == [("a", 0, 6)]
    h.add("b", 10)
    out = h.step()
    assert seqs(out) == [("a", 6, 1), ("b", 0, 7)]
    assert (out.num_decode_tokens, out.num_prefill_tokens, out.total_num_scheduled_tokens) == (1, 7, 8)
    out = h.step()
    assert seqs(out) == [("a", 7, 1), ("b", 7, 3)]
    assert [s.will_sample for s in out.scheduled] == [True, True]
    assert seqs(h.step()) == [("a", 8, 1), ("b", 10, 1)]


def test_decodes_are_listed_before_prefills():
    h = make(block_size=4, budget=32)
    h.add("a", 5)
    h.add("b", 5)
    h.step()
    h.sched.discard_kv("a")  # a recomputes everything; it is first in running order
    assert h.blocks("a") == [] and h.sched.get_request("a").num_computed_tokens == 0
    out = h.step()
    assert seqs(out) == [("b", 5, 1), ("a", 0, 6)]
    assert [s.is_prefill for s in out.scheduled] == [False, True]


def test_whole_prompt_waits_when_chunking_is_disabled():
    h = make(block_size=4, budget=16, max_model_len=16, chunked=False)
    h.add("a", 10)
    h.add("b", 10)
    assert seqs(h.step()) == [("a", 0, 10)]  # b would need a chunk
    assert seqs(h.step()) == [("a", 10, 1), ("b", 0, 10)]


def test_max_num_seqs():
    h = make(max_seqs=2)
    for r in "abc":
        h.add(r, 3)
    out = h.step()
    assert [s.request_id for s in out.scheduled] == ["a", "b"] and out.num_waiting == 1


def test_priority_then_arrival_order():
    h = make(max_seqs=1)
    h.add("low", 3, priority=1)
    h.add("hi1", 3, priority=0)
    h.add("hi2", 3, priority=0)
    h.add("lowest", 3, priority=5)
    order = []
    while h.sched.has_unfinished():
        out = h.step()
        rid = out.scheduled[0].request_id
        if not order or order[-1] != rid:
            order.append(rid)
        h.sched.finish_request(rid, RequestStatus.FINISHED_STOPPED)
    assert order == ["hi1", "hi2", "low", "lowest"]


def test_fcfs_admission_does_not_skip_ahead():
    h = make(block_size=4, num_blocks=4, budget=64)
    h.add("a", 9)  # 3 blocks
    h.step()
    h.add("big", 8)  # needs 2 blocks, 1 left
    h.add("small", 2)  # would fit, but must not overtake
    out = h.step()
    assert seqs(out) == [("a", 9, 1)] and out.num_waiting == 2


def test_duplicate_request_id_is_rejected():
    h = make()
    h.add("a", 3)
    with pytest.raises(ValueError):
        h.add("a", 3)
