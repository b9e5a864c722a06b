"""Speculative steps on plain integers: drafts scheduled as one query with the last token, cut to the
budget and the context, rejected slots rolled back (emptied blocks freed), lookahead never hashed, and
only verified tokens in the prefix cache."""

from scheduler_harness import Harness, seqs

from servescope.scheduler.request import RequestStatus


def _decoding(h, rid="a", prompt=6):
    req = h.add(rid, prompt)
    h.step()  # prefill, samples one token
    return req


def test_drafts_scheduled_with_the_last_token_and_rolled_back():
    h = Harness(num_blocks=16, block_size=4)
    req = _decoding(h)  # 7 tokens, 6 computed: blocks for 6
    assert len(h.blocks("a")) == 2
    req.spec_token_ids = [11, 12, 13, 14]
    out = h.sched.schedule()
    s = out.scheduled[0]
    assert (s.num_computed_tokens, s.num_new_tokens, s.spec_token_ids) == (6, 5, (11, 12, 13, 14))
    assert s.will_sample and not s.is_prefill and s.num_sample_positions == 5
    assert s.token_ids() == [req.all_token_ids[6], 11, 12, 13, 14]
    assert len(h.blocks("a")) == 3  # positions 6..10 need a third block
    assert req.spec_token_ids == []  # consumed
    h.sched.update_from_output(out, {"a": [11, 99]})  # one draft accepted, then the target's token
    h.kv.check_invariants()
    assert req.output_token_ids[-2:] == [11, 99] and req.num_computed_tokens == 8 and req.num_tokens == 9
    assert len(h.blocks("a")) == 3  # 9 tokens: 3 blocks
    req.spec_token_ids = [1, 2, 3]
    out = h.sched.schedule()
    assert seqs(out) == [("a", 8, 4)] and len(h.blocks("a")) == 3
    h.sched.update_from_output(out, {"a": [5]})  # everything rejected
    h.kv.check_invariants()
    assert req.num_computed_tokens == 9 and req.num_tokens == 10 and len(h.blocks("a")) == 3


def test_rejected_block_is_freed_and_prefix_cache_holds_only_verified_tokens():
    h = Harness(num_blocks=8, block_size=4)
    req = _decoding(h, prompt=7)  # 8 tokens, 7 computed, blocks for 7 (2)
    free0 = h.kv.num_free_blocks
    req.spec_token_ids = [1, 2, 3, 4, 5]  # positions 7..12 need blocks 2 and 3 more
    out = h.sched.schedule()
    assert len(h.blocks("a")) == 4 and h.kv.num_free_blocks == free0 - 2
    cached = h.kv.num_cached_blocks
    h.sched.update_from_output(out, {"a": [9]})  # all rejected: 9 tokens, blocks 3 needed
    h.kv.check_invariants()
    assert len(h.blocks("a")) == 3 and h.kv.num_free_blocks == free0 - 1
    # the hashed blocks are the verified prompt/output ones, never one holding a draft
    assert h.kv.num_cached_blocks == cached <= 2
    h.sched.finish_request("a", RequestStatus.FINISHED_ABORTED)
    h.kv.check_invariants()
    assert h.kv.num_used_blocks == 0


def test_drafts_cut_to_budget_and_context():
    h = Harness(num_blocks=32, block_size=4, budget=4, max_model_len=12)
    req = _decoding(h, prompt=4)  # prefill fits the 4-token budget
    req.spec_token_ids = [1, 2, 3, 4, 5, 6]
    out = h.sched.schedule()
    assert out.scheduled[0].spec_token_ids == (1, 2, 3)  # budget 4 = last token + 3 drafts
    h.sched.update_from_output(out, {"a": [1, 2, 3, 7]})  # all accepted + bonus: 9 tokens
    assert req.num_tokens == 9 and req.num_computed_tokens == 8
    req.spec_token_ids = [1, 2, 3, 4]
    out = h.sched.schedule()
    assert out.scheduled[0].spec_token_ids == (1, 2, 3)  # positions 8..11 < max_model_len 12
    h.kv.check_invariants()


def test_lookahead_reserved_without_hashing_and_given_back():
    h = Harness(num_blocks=8, block_size=4)
    req = _decoding(h, prompt=3)  # 4 tokens, 3 computed: 1 block
    cached = h.kv.num_cached_blocks
    tables = h.sched.reserve_lookahead("a", 6)  # positions 3..8: 3 blocks (one table for all layers)
    assert tables == (h.blocks("a"),) and len(tables[0]) == 3 and h.kv.num_cached_blocks == cached
    h.kv.check_invariants()
    assert h.sched.reserve_lookahead("a", 40) is None and len(h.blocks("a")) == 3  # no room: unchanged
    out = h.sched.schedule()  # no drafts after all: a plain decode
    h.sched.update_from_output(out, {"a": 5})
    assert req.num_tokens == 5
    h.kv.rollback(req, req.num_tokens)
    assert len(h.blocks("a")) == 2
    h.kv.check_invariants()


def test_drafts_without_room_decode_plainly_and_preemption_drops_drafts():
    h = Harness(num_blocks=4, block_size=4, budget=64)
    a = _decoding(h, "a", prompt=7)  # 8 tokens, 7 computed: 2 blocks of 4
    a.spec_token_ids = list(range(1, 10))  # positions 7..16 would need 5 blocks
    out = h.sched.schedule()
    assert [(s.num_new_tokens, s.spec_token_ids) for s in out.scheduled] == [(1, ())]
    assert h.sched.num_preemptions == 0
    h.sched.update_from_output(out, {"a": 5})  # 9 tokens
    b = h.add("b", 3)
    a.spec_token_ids = [1, 2, 3]
    out = h.sched.schedule()  # a verifies into its third block, b is admitted into the fourth
    assert seqs(out) == [("a", 8, 4), ("b", 0, 3)]
    h.sched.update_from_output(out, {"a": [1, 2, 3, 9], "b": 7})  # a: 13 tokens, its next needs a 4th block
    b.spec_token_ids = [7]
    out = h.sched.schedule()  # b is preempted for a's block, and its drafts are dropped
    h.kv.check_invariants()
    assert h.sched.num_preemptions == 1 and b.spec_token_ids == [] and seqs(out) == [("a", 12, 1)]
