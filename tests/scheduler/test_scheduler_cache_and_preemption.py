"""Prefix-cache admission, preemption, errors and finishing, with exact block ids and ref counts."""

from servescope.scheduler.request import RequestStatus
from scheduler_harness import Harness as make, seqs


def test_same_step_prefix_hit():
    h = make(block_size=4)
    prompt = list(range(10))
    a = h.add("a", prompt)
    b = h.add("b", prompt)
    out = h.step()
    # b hits the two full blocks a allocates in this very step
    assert seqs(out) == [("a", 0, 10), ("b", 8, 2)]
    assert out.scheduled[1].block_ids == [0, 1, 3]
    assert out.scheduled[1].is_prefill and out.scheduled[1].will_sample
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert h.refs([0, 1, 2, 3]) == [2, 2, 1, 1]
    assert (h.kv.prefix_cache_queries, h.kv.prefix_cache_hits) == (20, 8)


def test_identical_prompt_multiple_of_block_size_recomputes_last_block():
    h = make(block_size=4)
    h.add("a", list(range(8)))
    h.add("b", list(range(8)))
    out = h.step()
    assert seqs(out) == [("a", 0, 8), ("b", 4, 4)]
    assert h.blocks("a") == [0, 1] and h.blocks("b") == [0, 2]
    assert h.refs([0, 1, 2]) == [2, 1, 1]
    assert out.num_prefill_tokens == 12


def test_shared_prompt_blocks_have_refcount_two_like_n2():
    h = make(block_size=4)
    prompt = list(range(13))
    h.add("x#0", prompt)
    h.add("x#1", prompt)
    h.step()
    assert h.blocks("x#0") == [0, 1, 2, 3] and h.blocks("x#1") == [0, 1, 2, 4]
    assert h.refs([0, 1, 2, 3, 4]) == [2, 2, 2, 1, 1]
    h.step()  # different sampled tokens: the tails stay private
    h.sched.finish_request("x#0", RequestStatus.FINISHED_STOPPED)
    h.kv.check_invariants()
    assert h.refs([0, 1, 2]) == [1, 1, 1] and h.kv.allocator.is_free(3)
    h.sched.finish_request("x#1", RequestStatus.FINISHED_STOPPED)
    h.kv.check_invariants()
    assert h.kv.num_used_blocks == 0 and h.kv.prefix_cache.evictable_blocks() == [2, 1, 0]


def test_later_request_hits_finished_requests_blocks():
    h = make(block_size=4)
    h.add("a", list(range(10)))
    h.step()
    h.sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    b = h.add("b", list(range(10)) + [7, 7])
    out = h.step()
    assert seqs(out) == [("b", 8, 4)] and b.num_cached_tokens == 8
    assert out.scheduled[0].block_ids == [0, 1, 3]


def test_preemption_when_blocks_run_out():
    h = make(block_size=4, num_blocks=4)
    a = h.add("a", 7)
    b = h.add("b", 7)
    h.step()
    assert h.blocks("a") == [0, 1] and h.blocks("b") == [2, 3]
    h.step()  # both at 8 tokens computed... 8 tokens in 2 blocks each: still fits
    assert (a.num_computed_tokens, b.num_computed_tokens) == (8, 8)
    out = h.step()  # a needs a third block: the latest request (b) is preempted
    assert out.preempted_request_ids == ["b"]
    assert seqs(out) == [("a", 8, 1)]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert h.sched.num_preemptions == 1 and out.num_waiting == 1 and out.num_running == 1
    # b's blocks became evictable tail first; a took the least recently freed one (b's tail)
    assert h.blocks("a") == [0, 1, 3] and h.kv.prefix_cache.evictable_blocks() == [2]
    assert h.blocks("b") == []
    h.sched.finish_request("a", RequestStatus.FINISHED_STOPPED)
    assert b.num_tokens == 9
    out = h.step()
    # b recomputes prompt + its 2 outputs; its first block is still cached
    assert seqs(out) == [("b", 4, 5)]
    assert b.status is RequestStatus.RUNNING and b.num_cached_tokens == 4
    assert out.scheduled[0].block_ids[0] == 2
    assert out.scheduled[0].is_prefill and out.scheduled[0].will_sample


def test_preempted_request_goes_to_front_of_waiting():
    h = make(block_size=4, num_blocks=4, max_seqs=2)
    h.add("a", 7)
    h.add("b", 7)
    h.add("c", 3)  # waits: max_num_seqs
    h.step()
    h.step()
    out = h.step()
    assert out.preempted_request_ids == ["b"] and [s.request_id for s in out.scheduled] == ["a"]
    assert [r.request_id for r in h.sched._waiting] == ["b", "c"]


def test_lowest_priority_preempts_itself():
    h = make(block_size=4, num_blocks=4)
    a = h.add("a", 7, priority=1)
    b = h.add("b", 7, priority=0)
    h.step()
    h.step()
    out = h.step()  # a (first in running) cannot grow; it is the lowest priority: it yields
    assert out.preempted_request_ids == ["a"] and seqs(out) == [("b", 8, 1)]
    assert a.status is RequestStatus.PREEMPTED and b.status is RequestStatus.RUNNING


def test_self_preemption_frees_blocks_for_others():
    h = make(block_size=4, num_blocks=4)
    a = h.add("a", 7, priority=1)
    h.add("b", 6, priority=0)  # admitted first: higher priority
    h.step()
    assert h.blocks("b") == [0, 1] and h.blocks("a") == [2, 3]
    h.step()
    out = h.step()  # a needs a third block and is itself the lowest priority
    assert out.preempted_request_ids == ["a"] and seqs(out) == [("b", 7, 1)]
    c = h.add("c", 3, priority=5)
    out = h.step()  # b grows into a's freed tail block (evicting its hash)
    assert out.preempted_request_ids == [] and seqs(out) == [("b", 8, 1)]
    assert h.blocks("b") == [0, 1, 3] and h.kv.prefix_cache.evictable_blocks() == [2]
    # a (waiting head) hits block 2 but needs 2 more; c must not overtake it
    assert a.status is RequestStatus.PREEMPTED and c.status is RequestStatus.WAITING


def test_victim_scheduled_earlier_in_the_step_is_taken_out():
    h = make(block_size=4, num_blocks=5, budget=64)
    x = h.add("x", 4, priority=1)  # admitted first, so first in running order; lowest priority
    h.step()
    assert h.blocks("x") == [0]
    h.add("y", 11, priority=0)
    assert seqs(h.step()) == [("x", 4, 1), ("y", 0, 11)]
    assert h.blocks("x") == [0, 1] and h.blocks("y") == [2, 3, 4]
    assert seqs(h.step()) == [("x", 5, 1), ("y", 11, 1)]
    out = h.step()  # x is scheduled, then y needs a 4th block: x is preempted and taken out of the step
    assert out.preempted_request_ids == ["x"]
    assert seqs(out) == [("y", 12, 1)] and out.total_num_scheduled_tokens == 1
    assert x.status is RequestStatus.PREEMPTED and x.num_computed_tokens == 0 and x.num_tokens == 7
    # x's written full block 0 stays cached (evictable); its partial block 1 went to y
    assert h.blocks("y") == [2, 3, 4, 1] and h.kv.prefix_cache.evictable_blocks() == [0]


def test_can_never_fit_request_errors_at_once():
    h = make(block_size=4, num_blocks=4, max_model_len=32)
    bad = h.add("bad", 16)  # 16 + 1 tokens need 5 blocks of 4; the cache has 4
    h.add("ok", 15)
    assert bad.status is RequestStatus.FINISHED_ERROR and "4" in bad.error and "16 tokens" in bad.error
    assert h.sched.get_request("bad") is None and h.sched.has_unfinished()
    out = h.step()
    assert out.finished_requests == [bad] and seqs(out) == [("ok", 0, 15)]
    assert h.step().finished_requests == []
    too_long = h.add("long", 31)  # max_model_len 32 leaves room for 31 prompt tokens... but not the cache
    assert too_long.status is RequestStatus.FINISHED_ERROR
    h2 = make(block_size=4, num_blocks=64, max_model_len=32)
    r = h2.add("r", 32)
    assert r.status is RequestStatus.FINISHED_ERROR and "max_model_len" in r.error
    e = h2.add("e", [])
    assert e.status is RequestStatus.FINISHED_ERROR and "empty" in e.error
    out = h2.step()
    assert out.finished_requests == [r, e] and not h2.sched.has_unfinished()


def test_request_that_outgrows_the_cache_errors_instead_of_hanging():
    h = make(block_size=4, num_blocks=2, max_model_len=64)
    a = h.add("a", 6)
    for _ in range(3):
        h.step()
    assert a.num_tokens == 9
    out = h.step()
    assert out.finished_requests == [a] and a.status is RequestStatus.FINISHED_ERROR and "cache" in a.error
    assert not h.sched.has_unfinished() and h.kv.num_used_blocks == 0


def test_finish_request_frees_waiting_midprefill_and_decoding():
    h = make(block_size=4, budget=8)
    waiting = h.add("w0", 3)
    h.sched.finish_request("w0", RequestStatus.FINISHED_ABORTED)
    assert waiting.status is RequestStatus.FINISHED_ABORTED and h.sched.num_waiting == 0

    mid = h.add("mid", 20)
    h.step()
    assert mid.num_computed_tokens == 8 and h.blocks("mid") == [0, 1]
    h.sched.finish_request("mid", RequestStatus.FINISHED_ABORTED)
    h.kv.check_invariants()
    assert h.kv.num_used_blocks == 0 and h.kv.prefix_cache.evictable_blocks() == [1, 0]
    assert h.sched.num_running == 0

    dec = h.add("dec", 5)
    h.step()
    h.step()
    assert dec.num_output_tokens == 2
    h.sched.finish_request("dec", RequestStatus.FINISHED_LENGTH)
    h.kv.check_invariants()
    assert h.kv.num_used_blocks == 0 and not h.sched.has_unfinished()
    assert dec.status.finish_reason == "length"
    h.sched.finish_request("dec", RequestStatus.FINISHED_ABORTED)  # again: ignored
    assert dec.status is RequestStatus.FINISHED_LENGTH


def test_abort_between_schedule_and_update():
    h = make(block_size=4)
    a = h.add("a", 9)
    out = h.sched.schedule()
    h.sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    h.kv.check_invariants()
    # the blocks hashed for the step were never written: they are not offered to others
    assert h.kv.num_cached_blocks == 0 and h.kv.num_used_blocks == 0
    h.sched.update_from_output(out, {"a": 1})
    assert a.num_computed_tokens == 0 and a.output_token_ids == []


def test_discard_kv_keeps_request_running():
    h = make(block_size=4, caching=False)
    a = h.add("a", 5)
    h.step()
    h.sched.discard_kv("a")
    h.kv.check_invariants()
    assert a.status is RequestStatus.RUNNING and h.kv.num_used_blocks == 0
    out = h.step()
    assert seqs(out) == [("a", 0, 6)] and out.scheduled[0].will_sample
    assert a.output_token_ids == [1000, 1001]
