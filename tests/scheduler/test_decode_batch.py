"""Scheduler.decode_batch: the running requests exactly when the next schedule() can only give each of them one
decode token; a simulator applies such steps in bulk on that promise."""

from servescope.config import SamplingParams
from servescope.scheduler.request import Request
from scheduler_harness import Harness as make, seqs


def test_none_while_a_prefill_or_a_waiting_request_is_due():
    h = make(block_size=4, budget=8)
    assert h.sched.decode_batch() is None  # nothing runs
    h.add("a", 12)
    assert h.sched.decode_batch() is None  # waiting
    h.step()  # a chunk of 8: still prefilling
    assert h.sched.decode_batch() is None
    h.step()
    assert [r.request_id for r in h.sched.decode_batch()] == ["a"]
    h.add("b", 3)
    assert h.sched.decode_batch() is None


def test_every_step_after_it_gives_each_request_one_token_until_one_finishes():
    h = make(block_size=4, num_blocks=32, max_model_len=64)
    for rid in "abc":
        h.add(rid, 5)
    h.step()
    batch = h.sched.decode_batch()
    assert [r.request_id for r in batch] == ["a", "b", "c"]
    for _ in range(6):
        before = [(r.request_id, r.num_computed_tokens, 1) for r in batch]
        assert seqs(h.step()) == before
        assert [r.request_id for r in h.sched.decode_batch()] == ["a", "b", "c"]


def test_none_with_drafts_or_more_requests_than_the_token_budget():
    h = make(block_size=4, budget=2, max_seqs=4)
    for rid in "ab":
        h.add(rid, 1)
    h.step()
    h.step()
    assert len(h.sched.decode_batch()) == 2
    h.sched.get_request("a").spec_token_ids = [7, 8]
    assert h.sched.decode_batch() is None
    h.sched.get_request("a").spec_token_ids = []
    h.add("c", 1)
    h.step()  # the decodes take the whole token budget: c waits
    assert h.sched.num_waiting == 1 and h.sched.decode_batch() is None


def test_extend_output_tokens_is_appending_each():
    a = Request("a", [1, 2], SamplingParams(), arrival_time=0.0)
    b = Request("b", [1, 2], SamplingParams(), arrival_time=0.0)
    a.extend_output_tokens([5, 6, 7])
    for t in (5, 6, 7):
        b.append_output_token(t)
    assert (a.output_token_ids, a.all_token_ids, a.num_tokens) == (b.output_token_ids, b.all_token_ids, 5)
